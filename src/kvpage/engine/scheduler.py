"""The scheduler: continuous batching with a per-step token budget (vLLM v1 style).

Model-free: it sees token counts and token ids and the :class:`KVCacheManager`, never
a tensor, so the simulator (``kvpage.sim``) drives it with a cost model and fake tokens.

One step (:meth:`Scheduler.schedule`):

1. Running sequences, oldest first, each get ``min(remaining, budget)`` tokens, where
   ``remaining = num_tokens - num_computed_tokens`` (1 for a decode, the rest of the
   prompt for a chunked prefill) — decode and chunked prefill are one path. If the
   cache manager cannot allocate, the **newest** running sequence is preempted
   (blocks freed, progress dropped: recompute — or, with a :attr:`Scheduler.swapper`
   that takes it, its K/V copied to host memory and back on readmission: swap) and the
   allocation retried; a sequence that is itself the newest preempts itself.
2. If nothing was preempted, waiting sequences (preempted ones first, then by arrival)
   are admitted in order while the budget, ``max_num_seqs`` and the pool allow, each
   taking its prefix-cache hit (only blocks committed by earlier steps, C04). With a
   prefix-caching allocator (``RetentionAllocator``), a first admission also records
   why the hit ended (``Request.cache_miss``, counted in ``miss_reasons``) and every
   allocation from scratch hands the request's ``kv_retention`` policy to the cache.

With an allocator whose prefill chunks hold transient blocks (``FitAllocator`` with
``has_transient_blocks``: a unified pool with a sliding-window group) both steps are
budgeted: a sequence without blocks is admitted only when its settled footprint
(``admission_demand``) fits beside the running sequences' reserve (``growth_demand`` of
each: the rest of its known tokens and one block), every prefill chunk (the first one
too) is cut to what fits while the older sequences' next blocks stay free
(``fit_new_tokens``), and a non-oldest prefill that cannot take one token is stalled for
the step (its window release only) instead of preempting. Per-group pools and
one-group models are scheduled as above, unchanged (docs/architecture.md, "One pool
for every kind of layer").

After the model ran, :meth:`Scheduler.update` advances every scheduled sequence,
commits its full blocks to the prefix cache, appends sampled tokens, forks parallel
samples (``n > 1``) once the prompt is computed, and frees finished sequences.

Orders are the policy's (:mod:`kvpage.engine.queue_policy`): ``fcfs`` as above;
``priority`` sorts both queues by ``(priority, arrival)``, so the victim is the lowest
priority, newest sequence ("oldest" below then means "smallest key").

Progress guarantees: the oldest running sequence is never preempted by a newer one,
and every admitted request fits the pool on its own (:meth:`Scheduler.check_capacity`),
so the oldest always completes (no deadlock); preempted sequences go to the front of
the queue and no new request is admitted in a step that preempted (no starvation).
Source of the policy: vLLM v1 scheduler design (docs.vllm.ai, "vLLM V1" blog, 2025).

The scheduler picks the victims; its :class:`~kvpage.engine.preemption.Preemptor`
carries the preemption out (recompute or swap) and owns the swapper.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpage.cache.allocation import Allocation
from kvpage.cache.explain import CacheMissExplanation
from kvpage.cache.protocol import FitAllocator, KVAllocator, RetentionAllocator, StateAllocator
from kvpage.engine.preemption import Preemptor
from kvpage.engine.queue_policy import SchedulingPolicy, make_queue
from kvpage.engine.request import Request, RequestStatus, sample_id
from kvpage.engine.scheduled import ScheduledRequest
from kvpage.engine.spec_decode import DraftPolicy, Proposer
from kvpage.engine.structured import DEAD_END_FINISH_REASON
from kvpage.engine.swap import Swapper
from kvpage.errors import RequestRejected, SpecError


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled: sequences to compute, in batch order.
        copies: per KV group, copy-on-write ``(src, dst)`` block copies to run before
            the step writes any K/V.
        preempted: ids of sequences preempted while scheduling this step.
        num_batched_tokens: tokens computed in this step (<= max_num_batched_tokens).
        state_copies: recurrent-state slot copies ``(src, dst)`` to run, in order, on
            every ``StateCache`` before the step's forward (snapshots taken after the
            last step, prefix-hit restores, forks; ``KVCacheManager.take_state_copies``);
            the engine runs them even when nothing is scheduled. Empty without state
            layers.
        state_slots: per scheduled sequence (batch order), its live state slot (empty
            without state layers).
    """

    scheduled: list[ScheduledRequest]
    copies: list[list[tuple[int, int]]]
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous-batching scheduler over one :class:`KVCacheManager`.

    Args:
        kv_cache_manager: the allocator (``kvpage.cache.KVAllocator``: the paged
            ``KVCacheManager`` or the simulator's contiguous allocator).
        max_num_seqs: most sequences running at once (>= 1).
        max_num_batched_tokens: token budget of one step (>= 1).
        max_model_len: longest sequence (prompt + output) in tokens (>= 1).
        policy: ``"fcfs"`` or ``"priority"`` (:mod:`kvpage.engine.queue_policy`).
        proposer: speculative decoding's draft proposer
            (:mod:`kvpage.engine.spec_decode`); None = off. With one, every running
            sequence about to decode gets up to ``k`` draft tokens scheduled after its
            last token (KV slots allocated for them; fewer when the step's budget, its
            ``max_tokens`` or the pool is short), and :meth:`update` takes 1 .. d + 1
            verified tokens for it and rolls its KV back to the accepted length.
        draft_policy: whether a step drafts and how many drafts each sequence gets
            (:class:`kvpage.engine.spec_decode.DraftPolicy`; None = up to ``k`` always).

    With an allocator holding recurrent state (``StateAllocator`` with a ``state``
    pool: hybrid models), a prefill chunk ends exactly at each block boundary the
    snapshot policy wants (``state_chunk_end``), the plan carries the state slot copies
    and every sequence's live slot, and speculative decoding is refused.

    Raises:
        SpecError: a limit is < 1, an unknown policy, or a proposer with recurrent
            state layers.
    """

    def __init__(
        self,
        kv_cache_manager: KVAllocator,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 512,
        policy: SchedulingPolicy = "fcfs",
        proposer: Proposer | None = None,
        draft_policy: DraftPolicy | None = None,
    ) -> None:
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"{name}: expected an int >= 1, got {v!r}")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_groups = kv_cache_manager.num_groups
        self.proposer = proposer
        self.draft_policy = draft_policy
        #: waiting sequences in service order (a deque for fcfs, a heap for priority)
        self.waiting = make_queue(policy)
        self.policy: SchedulingPolicy = self.waiting.policy
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.samples: dict[str, list[Request]] = {}
        self.preemptor = Preemptor(kv_cache_manager, self.waiting)
        self.num_steps = 0
        self._arrivals = 0
        #: first admissions by cache-miss reason (``kvpage.cache.MISS_REASONS``)
        self.miss_reasons: dict[str, int] = {}
        self._retaining = (
            kv_cache_manager if isinstance(kv_cache_manager, RetentionAllocator) else None
        )
        self._stateful = (
            kv_cache_manager
            if isinstance(kv_cache_manager, StateAllocator) and kv_cache_manager.state is not None
            else None
        )
        #: an allocator whose prefill chunks hold transient blocks (a unified pool with
        #: a sliding group): admission and chunks are budgeted (module docstring)
        self._fitting = (
            kv_cache_manager
            if isinstance(kv_cache_manager, FitAllocator) and kv_cache_manager.has_transient_blocks
            else None
        )
        if self._stateful is not None and proposer is not None:
            raise SpecError(
                "speculative_config: expected none for a model with recurrent state layers "
                "(rejected drafts would need the recurrent state rolled back), got a proposer"
            )

    @property
    def swapper(self) -> Swapper | None:
        """Swap preemption (``kvpage.engine.swap.Swapper``); None = always recompute
        (the preemptor's; settable)."""
        return self.preemptor.swapper

    @swapper.setter
    def swapper(self, swapper: Swapper | None) -> None:
        self.preemptor.swapper = swapper

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the start."""
        return self.preemptor.num_preemptions

    @property
    def max_servable_len(self) -> int:
        """Longest sequence (prompt + max_tokens, in tokens) one request can be given:
        ``min(max_model_len, kv.max_request_tokens + 1)`` (see :meth:`check_capacity`
        for the ``+ 1``). Below ``max_model_len`` when the pool is smaller than one
        full-length sequence; servers validate against it (and default ``max_tokens``
        to it) so such requests are refused up front, not cut."""
        return min(self.max_model_len, self.kv.max_request_tokens + 1)

    # ---- admission ------------------------------------------------------------------
    def check_capacity(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise unless one sequence of this size can ever fit the pool alone.

        The formula: a sequence of ``P`` prompt and ``M`` generated tokens holds at most
        ``P + M - 1`` tokens in the KV cache (the last sampled token is never computed),
        so it is admitted iff ``P + M - 1 <= kv.max_request_tokens``.

        Raises:
            RequestRejected: reason ``"exceeds_kv_capacity"``.
        """
        need = num_prompt_tokens + max_tokens - 1
        cap = self.kv.max_request_tokens
        if need > cap:
            raise RequestRejected(
                f"request: expected prompt + max_tokens - 1 <= {cap} tokens (the KV cache "
                f"pool's capacity for one sequence), got {num_prompt_tokens} + {max_tokens} - 1"
                f" = {need}",
                reason="exceeds_kv_capacity",
            )

    def add_request(self, request: Request) -> None:
        """Queue a new user request (sample 0; its ``num_pending_samples`` forks later).

        Raises:
            RequestRejected: duplicate id (``"duplicate_request_id"``), empty prompt
                (``"empty_prompt"``), more samples than
                ``max_num_seqs`` (``"invalid_sampling_params"``), prompt not shorter
                than ``max_model_len`` (``"prompt_too_long"``), or never fits the pool
                (``"exceeds_kv_capacity"``). Nothing changes then.
        """
        self.check_new(request)
        request.arrival_order = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.samples[request.parent_id] = [request]
        self.waiting.append(request)

    def check_new(self, request: Request) -> None:
        """The checks of :meth:`add_request`, changing nothing (the engine runs them when
        it holds a request back until its grammar is compiled).

        Raises:
            RequestRejected: as :meth:`add_request`.
        """
        pid = request.parent_id
        if pid in self.samples:
            raise RequestRejected(
                f"request_id: expected a new id, got {pid!r} (already running)",
                reason="duplicate_request_id",
                request_id=pid,
            )
        if request.num_pending_samples + 1 > self.max_num_seqs:
            raise RequestRejected(
                f"n: expected <= max_num_seqs={self.max_num_seqs}, "
                f"got {request.num_pending_samples + 1}",
                reason="invalid_sampling_params",
                request_id=pid,
            )
        if request.num_prompt_tokens == 0:
            raise RequestRejected(
                "prompt: expected at least 1 token, got 0", reason="empty_prompt", request_id=pid
            )
        if request.num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"prompt: expected < max_model_len={self.max_model_len} tokens (room for "
                f"one generated token), got {request.num_prompt_tokens}",
                reason="prompt_too_long",
                request_id=pid,
            )
        try:
            self.check_capacity(request.num_prompt_tokens, request.max_tokens)
        except RequestRejected as e:
            e.request_id = pid
            raise

    def cap_max_tokens(self, cap: int) -> dict[str, int]:
        """Lower every unfinished sequence's ``max_tokens`` to ``max(cap, generated + 1)``
        (degraded mode acting on admitted work: a sequence already past ``cap`` stops
        after its next token). Mutates ``Request.max_tokens`` only; blocks, queues and
        tokens are untouched, so a capped sequence finishes with ``"length"`` in a
        later step.

        Returns:
            parent request id -> its new (largest over samples) ``max_tokens``, for the
            requests it lowered.
        """
        out: dict[str, int] = {}
        for r in self.requests.values():
            if r.is_finished:
                continue
            new = max(int(cap), r.num_output_tokens + 1)
            if r.max_tokens > new:
                r.max_tokens = new
                out[r.parent_id] = max(out.get(r.parent_id, 0), new)
        return out

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring). Mutates the running/waiting queues
        and allocates blocks through the cache manager."""
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], [[] for _ in range(self.num_groups)])
        self.waiting.order_running(self.running)
        i = 0
        running, allocate = self.running, self.kv.allocate
        drafts = self._propose() if self.proposer is not None else None
        fit, bs = self._fitting, self.kv.block_size
        reserve = 0  # fit: the next blocks of the sequences before ``req``
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n >= 1, f"running sequence {req.request_id} has nothing to compute"
            if self._stateful is not None and n > 1:
                n = self._stateful.state_chunk_end(
                    req.request_id, req.token_ids, req.num_computed_tokens,
                    req.num_computed_tokens + n, cache_salt=req.cache_salt,
                ) - req.num_computed_tokens  # fmt: skip
            draft = drafts.get(req.request_id) if drafts else None
            if draft:
                draft = draft[: budget - 1]
                alloc = allocate(req.request_id, req.token_ids, 1 + len(draft)) if draft else None
                if alloc is not None:
                    assert draft is not None
                    self._emit(out, req, 1 + len(draft), alloc, draft)
                    budget -= 1 + len(draft)
                    i += 1
                    continue
                # no room for the drafts: decode plainly (preempting as usual)
            if fit is not None and n > 1:
                m = self._fit_chunk(fit, req, req.num_computed_tokens, n, reserve)
                if m == 0 and i > 0:  # stalled: the older sequences keep their next blocks
                    allocate(req.request_id, req.token_ids, 0)  # its window release only
                    reserve += fit.growth_demand(req.request_id, req.num_tokens + bs)
                    i += 1
                    continue
                n = m or n  # the oldest: as usual (preempting the newest until it fits)
            alloc = allocate(req.request_id, req.token_ids, n)
            while alloc is None:
                victim = running.pop()
                self.preemptor.preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
                alloc = self.kv.allocate(req.request_id, req.token_ids, n)
            if alloc is None:
                break
            self._emit(out, req, n, alloc)
            budget -= n
            i += 1
            if fit is not None:
                end = req.num_computed_tokens + n
                reserve += fit.growth_demand(req.request_id, end + bs)
        if not out.preempted:
            budget = self._admit(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if self._stateful is not None:
            stateful = self._stateful
            out.state_copies = stateful.take_state_copies()
            out.state_slots = [stateful.state_slot(s.request.request_id) for s in out.scheduled]
        self.num_steps += 1
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in order while the budget, ``max_num_seqs`` and the
        pool allow (module docstring, step 2); returns the budget left. With transient
        blocks (:attr:`_fitting`) a sequence without blocks is admitted only when its
        settled footprint (``admission_demand`` of all its known tokens) fits beside
        the running sequences' reserve (``growth_demand`` of each: the rest of its known
        tokens and one block more), and its first chunk is cut to what fits beside that
        reserve."""
        fit, bs = self._fitting, self.kv.block_size
        reserve = -1  # fit: blocks the running sequences still need (computed on demand)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if len(self.running) + 1 + req.num_pending_samples > self.max_num_seqs:
                break
            cached = 0
            swapped = req.swapped_tokens  # K/V waiting in host memory (swap)
            why: CacheMissExplanation | None = None
            if not req.has_blocks and not swapped:
                cached = self.kv.get_num_cached_tokens(req.token_ids, cache_salt=req.cache_salt)
                if req.num_cached_tokens < 0 and self._retaining is not None:
                    # explained before the allocation, which may evict blocks itself
                    why = self._explain(req, self._retaining, cached)
            n = min(req.num_tokens - cached - swapped, budget)
            if fit is not None and not req.has_blocks:
                if reserve < 0:
                    reserve = sum(
                        fit.growth_demand(r.request_id, r.num_tokens + bs)
                        for r in self.running
                        if r.has_blocks
                    )
                need = fit.admission_demand(
                    req.token_ids, req.num_tokens, num_cached_tokens=cached,
                    cache_salt=req.cache_salt,
                )  # fmt: skip
                if need + reserve > self.kv.num_free_blocks:
                    break
                m = fit.fit_new_tokens(
                    req.request_id, req.token_ids, n, keep_free=reserve,
                    num_cached_tokens=cached, num_swapped_tokens=swapped,
                    cache_salt=req.cache_salt,
                )  # fmt: skip
                if m < 1:
                    break
                n = m
            if self._stateful is not None and n > 1:
                s0 = cached + swapped  # one is 0: a swapped-in chunk starts at swapped
                n = self._stateful.state_chunk_end(
                    req.request_id, req.token_ids, s0, s0 + n, cache_salt=req.cache_salt
                ) - s0  # fmt: skip
            if swapped:  # per KV group only the blocks a continuation needs
                alloc = self.preemptor.allocate_swapped(req, n)
            else:
                alloc = self.kv.allocate(
                    req.request_id, req.token_ids, n, num_cached_tokens=cached,
                    cache_salt=req.cache_salt,
                )  # fmt: skip
            if alloc is None:
                break
            self.waiting.popleft()
            policy = req.params.kv_retention
            if not req.has_blocks and policy is not None and self._retaining is not None:
                self._retaining.set_retention(req.request_id, policy, req.num_prompt_tokens)
            if why is not None:
                req.cache_miss = why
                self.miss_reasons[why.reason] = self.miss_reasons.get(why.reason, 0) + 1
            req.has_blocks = True
            if swapped:
                self.preemptor.swap_in(req)
            req.num_computed_tokens = alloc.num_cached_tokens + swapped
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = alloc.num_cached_tokens
                req.num_cached_tokens_by_tier = alloc.cached_tokens_by_tier
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(out, req, n, alloc)
            budget -= n
            if fit is not None and reserve >= 0:
                reserve += fit.growth_demand(req.request_id, req.num_tokens + bs)
        return budget

    def _fit_chunk(
        self, fit: FitAllocator, req: Request, start: int, n: int, keep_free: int
    ) -> int:
        """A running prefill's chunk cut to what the pool holds while ``keep_free``
        blocks stay free for the older sequences' next blocks (``fit_new_tokens``; 0 =
        not even one token), ending at a snapshot boundary if the cut moved one inside
        (recurrent state, ``state_chunk_end``)."""
        m = fit.fit_new_tokens(req.request_id, req.token_ids, n, keep_free=keep_free)
        if 1 < m < n and self._stateful is not None:
            m = self._stateful.state_chunk_end(
                req.request_id, req.token_ids, start, start + m, cache_salt=req.cache_salt
            ) - start  # fmt: skip
        return m

    def _propose(self) -> dict[str, list[int]]:
        """Draft tokens of the running sequences about to decode one token (their
        prompt computed, no sample left to fork), at most ``max_tokens - generated - 1``
        each (the step emits one more) and at most the draft policy's limit: one batched
        proposer call (none when the policy skips drafting this step)."""
        assert self.proposer is not None
        seqs: list[Request] = []
        limits: list[int] = []
        policy = self.draft_policy
        if policy is not None:
            if len(policy.draft_len) > 2 * len(self.running) + 64:
                policy.prune(r.request_id for r in self.running)
            if not policy.drafting(len(self.running)):
                return {}
        for r in self.running:
            room = r.max_tokens - r.num_output_tokens - 1
            if (
                room > 0
                and r.num_tokens - r.num_computed_tokens == 1
                and r.num_output_tokens >= 1
                and not r.num_pending_samples
            ):
                seqs.append(r)
                limits.append(room if policy is None else min(room, policy.limit(r.request_id)))
        if not seqs:
            return {}
        got = self.proposer.propose([r.token_ids for r in seqs], limits)
        return {r.request_id: d for r, d in zip(seqs, got) if d}

    @staticmethod
    def _explain(req: Request, kv: RetentionAllocator, cached: int) -> CacheMissExplanation:
        """Why the first admission's prefix hit is ``cached`` tokens (kept, and counted
        in ``miss_reasons``, once the admission succeeds; a readmission after preemption
        keeps the first reason)."""
        if req.params.prompt_logprobs is not None:  # a unique salt: every token computed
            return CacheMissExplanation("prompt_logprobs", req.num_tokens, cached)
        return kv.explain_miss(req.token_ids, cached, cache_salt=req.cache_salt)

    def _emit(
        self,
        out: SchedulerOutput,
        req: Request,
        n: int,
        alloc: Allocation,
        draft: list[int] | None = None,
    ) -> None:
        copies = alloc.copies
        if copies and any(copies):
            for g, pairs in enumerate(copies):
                out.copies[g].extend(pairs)
        start = req.num_computed_tokens
        toks = req.token_ids
        tables = self.kv.block_tables(req.request_id)
        if draft:  # the last known token, then the drafts (n = 1 + len(draft))
            out.scheduled.append(
                ScheduledRequest(req, start, n, [toks[start], *draft], tables, True, draft)
            )
            return
        end = start + n
        out.scheduled.append(
            ScheduledRequest(req, start, n, toks[start:end], tables, end == len(toks))
        )

    def update(
        self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> tuple[list[Request], list[Request]]:
        """Apply the results of the step ``out`` planned: commit each scheduled
        sequence's computed tokens, then append its ``sampled`` tokens (the
        ``num_samples`` ids of one with ``samples`` set, sample 0's first:
        :meth:`_append_sampled`); one with drafts gets the 1 .. d + 1 tokens its
        verification emits instead (:meth:`_update_verified`).

        Returns:
            ``(progressed, finished)``: sequences that got a token this step (forked
            samples included) and those that finished.
        """
        progressed: list[Request] = []
        finished: list[Request] = []
        running = RequestStatus.RUNNING
        commit = self.kv.commit
        for s in out.scheduled:
            req = s.request
            if req.status is not running:
                continue  # aborted after scheduling
            if s.draft_token_ids:
                self._update_verified(req, s.start, sampled[req.request_id], progressed, finished)
                continue
            req.num_computed_tokens = n_done = s.start + s.num_tokens
            commit(req.request_id, req.token_ids, n_done)
            if s.samples:
                self._append_sampled(s, sampled[req.request_id], progressed, finished)
        return progressed, finished

    def _append_sampled(
        self,
        s: ScheduledRequest,
        toks: Sequence[int],
        progressed: list[Request],
        finished: list[Request],
    ) -> None:
        """Append ``toks`` (one per sample, by index) to ``s.request`` and the samples
        forked from it now (:meth:`_fork`); each goes to ``progressed``, and to
        ``finished`` when it stops (``Request.check_stop``). A negative token
        (``DEAD_END_TOKEN``: its grammar allows none) finishes its sample without one.

        Raises:
            SpecError: not one token per sample (nothing appended).
        """
        req = s.request
        if len(toks) != 1 + req.num_pending_samples:
            raise SpecError(
                f"sampled[{req.request_id!r}]: expected {s.num_samples} tokens, got {len(toks)}"
            )
        seqs = (req, *self._fork(req)) if req.num_pending_samples else (req,)
        for seq, tok in zip(seqs, toks):
            tok = int(tok)
            if tok < 0:  # DEAD_END_TOKEN: its grammar allows no token
                seq.num_new_tokens = 0
                progressed.append(seq)
                self.finish(seq, DEAD_END_FINISH_REASON)
                finished.append(seq)
                continue
            seq.token_ids.append(tok)
            seq.num_new_tokens = 1
            progressed.append(seq)
            reason = seq.check_stop(tok)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)

    def _update_verified(
        self,
        req: Request,
        start: int,
        toks: Sequence[int],
        progressed: list[Request],
        finished: list[Request],
    ) -> None:
        """Apply a speculative step's emitted tokens ``toks`` (1 .. d + 1) to ``req``,
        scheduled at ``start`` with d drafts: append up to the first that stops it,
        roll the KV back to ``start + appended`` positions (the last appended token is
        not computed yet; the rejected drafts' slots and blocks are freed) and commit
        only those."""
        reason = None
        appended = 0
        for tok in toks:
            req.token_ids.append(int(tok))
            appended += 1
            reason = req.check_stop(int(tok))
            if reason is not None:
                break
        n_done = start + appended
        req.num_computed_tokens = n_done
        req.num_new_tokens = appended
        self.kv.truncate(req.request_id, n_done)
        self.kv.commit(req.request_id, req.token_ids, n_done)
        progressed.append(req)
        if reason is not None:
            self.finish(req, reason)
            finished.append(req)

    def _fork(self, parent: Request) -> list[Request]:
        """Create the parent's pending samples, sharing its blocks (copy-on-write)."""
        k = parent.num_pending_samples
        if k == 0:
            return []
        parent.num_pending_samples = 0
        children = []
        pos = self.running.index(parent) + 1
        for idx in range(1, k + 1):
            child = Request(
                request_id=sample_id(parent.parent_id, idx),
                parent_id=parent.parent_id,
                sample_index=idx,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                params=parent.params,
                max_tokens=parent.max_tokens,
                eos_token_id=parent.eos_token_id,
                cache_salt=parent.cache_salt,
                arrival_order=parent.arrival_order,
                priority=parent.priority,
                status=RequestStatus.RUNNING,
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
                has_blocks=True,
                stop_token_set=parent.stop_token_set,
                cache_miss=parent.cache_miss,
            )
            self.kv.fork(parent.request_id, child.request_id)
            self.requests[child.request_id] = child
            self.samples[parent.parent_id].append(child)
            children.append(child)
        self.running[pos:pos] = children
        return children

    # ---- finishing ----------------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished with ``reason`` and free its blocks (idempotent)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.has_blocks:
            self.kv.free(req.request_id)
            req.has_blocks = False
        if req.swapped_tokens:
            self.preemptor.discard_swap(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def abort(self, parent_id: str) -> list[Request]:
        """Abort every sample of user request ``parent_id`` and free their blocks now.

        Returns the aborted sequences (empty for an unknown or finished id)."""
        seqs = self.samples.get(parent_id, [])
        out = [r for r in seqs if not r.is_finished]
        for r in out:
            self.finish(r, "abort")
            r.num_pending_samples = 0
        return out

    def samples_finished(self, parent_id: str) -> bool:
        """True when every sample of ``parent_id`` has finished (and none is pending)."""
        for r in self.samples[parent_id]:  # a loop: this runs per request per step
            if r.status is not RequestStatus.FINISHED or r.num_pending_samples:
                return False
        return True

    def release(self, parent_id: str) -> None:
        """Forget a finished user request (its sequences and ids)."""
        for r in self.samples.pop(parent_id, []):
            self.requests.pop(r.request_id, None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)


__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]
