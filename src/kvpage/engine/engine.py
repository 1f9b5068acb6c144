"""LLMEngine: requests in, tokens out, one step at a time, on the paged KV cache.

``add_request`` validates and queues; ``step`` schedules, runs the model, samples and
returns the outputs of every request that progressed. See ``kvpage.engine.LLM`` for the
batch API and ``kvpage.engine.config`` for how the engine is built.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from kvpage.engine.config import (
    EngineComponents,
    EngineConfig,
    build_components,
    resolve_generation_config,
)
from kvpage.engine.engine_metrics import (
    CACHE_MISS_KEYS,
    CACHE_MISS_METRIC,
    METRIC_NAMES,
    TIER_METRIC_TEMPLATES,
    StepStats,
    StepTimer,
    collect_metrics,
)
from kvpage.engine.output_processor import OutputProcessor, ParentRequest
from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.engine.processing import compute_logprobs
from kvpage.engine.prompts import parse_prompt
from kvpage.engine.queue_policy import check_priority
from kvpage.engine.request import Request
from kvpage.engine.request_extras import prompt_logprob_spans
from kvpage.engine.sampler import LogprobEntry, Sampler, greedy_ops
from kvpage.engine.scheduler import SchedulerOutput
from kvpage.engine.spec_decode import (
    SpecDecodeStats,
    accept_greedy,
    accept_sampled,
    check_spec_request,
)
from kvpage.engine.structured import GrammarCompilerPool
from kvpage.errors import RequestRejected, got_repr
from kvpage.models.generation_config import sampling_defaults
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.specs.speculative import parse_speculative_config


class LLMEngine:
    """The engine (see the module docstring). Build with :meth:`from_config`.

    A step runs through objects that own their state: the ``scheduler`` plans it
    (admission, blocks, preemption), the ``runner`` computes its logits, the ``sampler``
    picks the tokens, ``scheduler.update`` appends them, and ``outputs`` (the
    :class:`OutputProcessor`, which owns each user request's engine-side state) builds the
    ``RequestOutput``s; ``step_stats`` adds up the stage times of one timer per step.

    Attributes:
        config: the resolved EngineConfig.
        tokenizer: the model's tokenizer (None for a model without one).
        eos_token_id / extra_eos_token_ids: the EOS id and the model's other EOS ids.
        default_sampling_params: request defaults from generation_config.json.
        cache_spec: the KV cache layout in use.
        backend_name: the attention backend's name.
        kv_cache_manager, scheduler, runner: the components (read-only use).
        sampler: the :class:`~kvpage.engine.sampler.Sampler`.
        outputs: the :class:`~kvpage.engine.output_processor.OutputProcessor`.
        step_stats: cumulative :class:`StepStats`.
        spec_config: the resolved speculative decoding settings (None = off).
        spec_stats: speculative decoding's draft/accepted counters (None = off).
        stream_text: when True, unfinished outputs carry decoded text too (costs a
            decode per token); finished outputs always do.
    """

    def __init__(self, config: EngineConfig, components: EngineComponents) -> None:
        self.config = config
        self.model = components.model
        self.tokenizer: Tokenizer | None = getattr(self.model, "tokenizer", None)
        self.cache_spec = components.cache_spec
        self.backend = components.backend
        self.backend_name: str = str(getattr(self.backend, "name", type(self.backend).__name__))
        self.kv_cache_manager = components.kv_cache_manager
        self.scheduler = components.scheduler
        self.runner = components.runner
        #: the KV tiers below the pool (None = none configured)
        self.tiers = components.tiers
        self.sampler = Sampler(greedy_ops(self.backend, self.model.dtype, self.runner.device))
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, config.seed)
        self.vocab_size = int(self.model.config.get("vocab_size", 0))
        self.eos_token_id = getattr(self.tokenizer, "eos_id", None)
        if self.eos_token_id is None:
            eos = self.model.config.get("eos_token_id")
            self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        #: the model's other EOS ids (HF folders: config.json's, generation_config.json's
        #: and the tokenizer's, ``HFTokenizer``): they end a sequence like extra
        #: ``stop_token_ids`` unless ``ignore_eos``, as vLLM's
        #: ``SamplingParams.update_from_generation_config`` adds them
        eos_all = getattr(self.tokenizer, "eos_token_ids", None) or ()
        self.extra_eos_token_ids = frozenset(int(i) for i in eos_all) - {self.eos_token_id}
        #: the generation_config.json read for request defaults (None: none) and the
        #: fields it sets (``EngineConfig.generation_config``)
        self.generation_config_path, self.generation_config = resolve_generation_config(config)
        #: SamplingParams defaults from it (``sampling_defaults``; {} = kvpage's own):
        #: ``LLM.generate`` without params and server fields a request leaves unset
        self.default_sampling_params: dict[str, Any] = sampling_defaults(self.generation_config)
        self.step_stats = StepStats()
        self.spec_config = parse_speculative_config(config.speculative_config)
        self.spec_stats = SpecDecodeStats() if self.spec_config is not None else None
        #: the adaptive draft policy's step cost clock: process CPU seconds on a CPU
        #: device (the step's own work, not other jobs on a shared machine), wall
        #: seconds elsewhere (an accelerator's time is not the host's CPU time)
        self._policy_cpu_clock = (
            self.scheduler.draft_policy is not None
            and self.scheduler.draft_policy.adaptive
            and torch.device(config.device).type == "cpu"
        )
        self._unique_salts = 0
        #: ids of user requests dropped by failed steps (oldest first)
        self.failed_request_ids: deque[str] = deque(maxlen=1024)
        #: constrained requests whose grammar is still compiling, in arrival order:
        #: (compile future, sample 0); they join the scheduler once it is done
        self._compiling: list[tuple[concurrent.futures.Future[Any], Request]] = []

    @property
    def grammars(self) -> GrammarCompilerPool:
        """The grammar compiler pool of this engine's tokenizer (made on first use).

        Raises:
            RequestRejected: reason ``"structured_outputs_unavailable"``: the model has
                no tokenizer, or xgrammar is missing.
        """
        pool = self.outputs.grammars
        if pool is None:
            if self.tokenizer is None:
                raise RequestRejected(
                    "structured_outputs: expected a model with a tokenizer (grammars are "
                    "compiled against its vocabulary), got a model without one",
                    reason="structured_outputs_unavailable",
                )
            stops = [] if self.eos_token_id is None else [int(self.eos_token_id)]
            pool = GrammarCompilerPool(self.tokenizer, self.vocab_size, stops)
            self.outputs.grammars = pool
        return pool

    @classmethod
    def from_config(cls, **kwargs: Any) -> LLMEngine:
        """Build an engine from the ``LLM`` keyword arguments (see EngineConfig)."""
        config = EngineConfig(**kwargs)
        return cls(config, build_components(config))

    @property
    def stream_text(self) -> bool:
        """When True, unfinished outputs carry decoded text too (costs a decode per
        token); finished outputs always do."""
        return self.outputs.stream_text

    @stream_text.setter
    def stream_text(self, value: bool) -> None:
        self.outputs.stream_text = value

    def get_metrics(self) -> dict[str, float]:
        """The engine metrics (:func:`kvpage.engine.engine_metrics.collect_metrics`)."""
        return collect_metrics(
            self.kv_cache_manager,
            self.scheduler,
            self.tiers,
            self.outputs.counters,
            self.spec_stats,
        )

    # ---- requests -----------------------------------------------------------------------
    def _parse_prompt(self, prompt: Any) -> tuple[str | None, list[int], str | None]:
        return parse_prompt(prompt, self.tokenizer, self.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | Mapping[str, Any],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request; it joins the batch at the next step.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, token ids, or ``{"prompt_token_ids": [...] | "prompt": str,
                "cache_salt": str}``.
            params: sampling parameters (default ``SamplingParams()``).
            arrival_time: ``time.monotonic()`` seconds (default now).
            priority: scheduling priority (vLLM's ``priority``: lower is served first,
                FCFS among equals; any int). Only 0 unless the engine was built with
                ``scheduling_policy="priority"``.

        Raises:
            RequestRejected: with ``reason`` "invalid_prompt", "empty_prompt",
                "prompt_too_long", "exceeds_kv_capacity", "invalid_sampling_params",
                "invalid_request_id", "invalid_request" (bad arrival_time or priority) or
                "duplicate_request_id"; with speculative decoding on, "invalid_sampling_params"
                for a request it cannot serve exactly (n > 1, logprobs, prompt_logprobs,
                penalties, min_tokens, min_p, structured_outputs:
                ``kvpage.engine.spec_decode.check_spec_request``). No state changes
                (apart from the rejected-requests counter).
        """
        try:
            if not isinstance(request_id, str) or not request_id:
                raise RequestRejected(
                    f"request_id: expected a non-empty string, got {request_id!r}",
                    reason="invalid_request_id",
                )
            if params is None:
                params = SamplingParams()
            if not isinstance(params, SamplingParams):
                raise RequestRejected(
                    f"params: expected SamplingParams, got {type(params).__name__}",
                    reason="invalid_sampling_params",
                )
            params.validate()
            if self.spec_config is not None:
                check_spec_request(params)
            bad_stop = [t for t in params.stop_token_ids or () if not t < self.vocab_size]
            if bad_stop:
                raise RequestRejected(
                    f"stop_token_ids: expected ids in [0, {self.vocab_size}) (the model's "
                    f"vocabulary), got {got_repr(bad_stop)}",
                    reason="invalid_sampling_params",
                )
            at = arrival_time
            if at is not None and (
                isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at)
            ):
                raise RequestRejected(
                    f"arrival_time: expected None or a finite number (time.monotonic() "
                    f"seconds), got {at!r}",
                    reason="invalid_request",
                )
            check_priority(priority, getattr(self.scheduler, "policy", "fcfs"))
            text, ids, salt = self._parse_prompt(prompt)
            if params.kv_retention is not None and not self.config.enable_prefix_caching:
                raise RequestRejected(
                    "kv_retention: expected no policy when prefix caching is off (nothing "
                    "is cached to retain), got a policy",
                    reason="invalid_sampling_params",
                )
            if params.prompt_logprobs is not None:
                # every prompt token must be computed to have logits: a salt of its own
                # makes the prefix cache miss (vLLM also skips hits for such requests)
                self._unique_salts += 1
                salt = f"{salt or ''}\x00prompt_logprobs\x00{self._unique_salts}"
            mml = self.scheduler.max_model_len
            cap = mml - len(ids) if params.max_tokens is None else params.max_tokens
            req = Request(
                request_id=request_id,
                parent_id=request_id,
                sample_index=0,
                token_ids=list(ids),
                num_prompt_tokens=len(ids),
                params=params,
                max_tokens=max(1, min(cap, mml - len(ids))),
                eos_token_id=self.eos_token_id,
                cache_salt=salt,
                num_pending_samples=params.n - 1,
                stop_token_set=frozenset(params.stop_token_ids or ())
                | (frozenset() if params.ignore_eos else self.extra_eos_token_ids),
                priority=priority,
            )
            compiling = None
            parked = False  # decided once: the future may finish at any moment
            grammar = None
            if params.structured_outputs is not None:
                if request_id in self.outputs:
                    raise RequestRejected(
                        f"request_id: expected a new id, got {request_id!r} (already running)",
                        reason="duplicate_request_id",
                    )
                # checked now (a bad schema is refused here), compiled on the pool's thread
                compiling = self.grammars.submit(params.structured_outputs)
            parked = compiling is not None and not compiling.done()
            if parked:
                self.scheduler.check_new(req)
            else:
                grammar = None if compiling is None else compiling.result()
                self.scheduler.add_request(req)
        except RequestRejected as e:
            e.request_id = request_id
            self.outputs.counters.rejected += 1
            raise
        now = time.monotonic() if arrival_time is None else arrival_time
        preq = ParentRequest(request_id, text, list(ids), params, now, req.arrival_order)
        if parked:
            assert compiling is not None
            self._compiling.append((compiling, req))
        else:
            preq.grammar = grammar
        self.outputs.add(preq)

    def _admit_compiled(self) -> None:
        """Move the requests whose grammar finished compiling into the scheduler (in
        arrival order); with nothing else to run, wait up to 5 ms for the first one.

        Raises:
            RuntimeError: a grammar that passed the admission check failed to compile (or
                its request no longer fits): those requests are dropped and listed in
                ``failed_request_ids`` (as after a failed step, so the server fails
                exactly them); every other request is untouched.
        """
        if not self._compiling:
            return
        if not self.scheduler.has_unfinished():
            concurrent.futures.wait([self._compiling[0][0]], timeout=0.005)
        keep = []
        errors: list[str] = []
        for fut, req in self._compiling:
            if not fut.done():
                keep.append((fut, req))
                continue
            error = self._admit_one(fut, req)
            if error is not None:
                errors.append(error)
        self._compiling = keep
        if errors:
            raise RuntimeError(f"structured_outputs: grammar not admitted ({'; '.join(errors)})")

    def _admit_one(self, fut: concurrent.futures.Future[Any], req: Request) -> str | None:
        """Add ``req``, whose grammar ``fut`` finished compiling, to the scheduler and
        hand the grammar to its user request; on failure forget the request, list it
        in ``failed_request_ids`` and return ``"<id>: <error>"``."""
        pid = req.parent_id
        try:
            grammar = fut.result()
            self.scheduler.add_request(req)
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            self.outputs.forget(pid)
            self.failed_request_ids.append(pid)
            return f"{pid}: {e}"
        preq = self.outputs.parent(pid)
        preq.grammar = grammar
        preq.arrival_order = req.arrival_order  # the scheduler numbers arrivals
        return None

    def abort_request(self, request_id: str) -> None:
        """Abort a request: every sample stops and its blocks are freed at once.
        Unknown or finished ids are ignored."""
        if request_id not in self.outputs:
            return
        self._compiling = [(f, r) for f, r in self._compiling if r.parent_id != request_id]
        self.scheduler.abort(request_id)
        self.scheduler.release(request_id)
        self.outputs.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs)

    # ---- one step: schedule -> execute -> sample -> update -> emit ----------------------
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step and the model.

        Args:
            finished_only: return only the requests that finished this step (skips
                building outputs of running requests; for offline batch use).

        Returns:
            One RequestOutput per user request that progressed (got a token or
            finished: ``finished=True``) this step.

        Raises:
            Exception: whatever the model, sampler or scheduler raised. The requests of
                the failed step (every running one if scheduling failed) are aborted and
                listed in ``failed_request_ids``; the others are untouched.
        """
        timer = StepTimer()
        cpu0 = time.process_time() if self._policy_cpu_clock else 0.0
        if self._compiling:  # grammars compiling: admit those that are done
            self._admit_compiled()
        out = self._schedule()
        if out is None:
            return []
        try:
            results = self._run_scheduled(out, timer, cpu0, finished_only)
        except BaseException:
            # a model, sampler or bookkeeping failure: the requests of this step are
            # dropped (blocks freed, ids forgotten) so the engine stays usable
            self._fail_requests({s.request.parent_id for s in out.scheduled})
            raise
        self.step_stats.record(out, timer.laps)
        return results

    def _run_scheduled(
        self, out: SchedulerOutput, timer: StepTimer, cpu0: float, finished_only: bool
    ) -> list[RequestOutput]:
        """Execute → sample → update → emit plan ``out``, one timer lap per stage
        (``cpu0``: the process CPU clock at the step's start, for the draft policy)."""
        if self.tiers is not None:
            # one batched copy-out of the blocks evicted while scheduling, before
            # the forward (and its copy-on-write copies) writes into them
            self.tiers.flush()
        started = time.monotonic()
        timer.lap()  # schedule
        logits, verify = self._execute(out, timer)  # laps model
        sampled, spec_lp = self._sample(out, logits, verify, started)
        timer.lap()  # sample
        progressed, _ = self.scheduler.update(out, sampled)
        for seq, toks, ents in spec_lp:
            self.outputs.record_sequence_logprobs(seq, toks, ents)
        timer.lap()  # update
        if self.scheduler.draft_policy is not None:
            cost = time.process_time() - cpu0 if self._policy_cpu_clock else sum(timer.laps)
            self._observe_policy(out, sampled, cost)
        results = self.outputs.emit(progressed, time.monotonic(), finished_only)
        timer.lap()  # output
        return results

    def _schedule(self) -> SchedulerOutput | None:
        """The step's plan, or None when nothing runs (then the KV tiers demote the
        blocks evicted while scheduling)."""
        try:
            out = self.scheduler.schedule()
        except BaseException:
            # the plan may be half-built: drop every running request (frees its blocks)
            self._fail_requests({r.parent_id for r in self.scheduler.running})
            raise
        if out.is_empty:
            if self.tiers is not None:
                self.tiers.flush()
            # snapshots taken after the last step must land before any later forward
            self.runner.copy_state_slots(out.state_copies)
            return None
        return out

    def _execute(
        self, out: SchedulerOutput, timer: StepTimer
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model on plan ``out``: the logits of the sequences that sample (the
        prompt-logprob rows are split off and recorded), and the verification rows of
        the draft positions (``[num_drafts, vocab]``, batch order; None without drafts).
        Closes the timer's model lap."""
        spans = prompt_logprob_spans(out) if self.outputs.wants_prompt_logprobs else []
        drafts = []
        if self.spec_config is not None:
            for i, s in enumerate(out.scheduled):
                if s.draft_token_ids:
                    drafts.append((i, 0, len(s.draft_token_ids)))
        extra = spans + drafts
        logits = self.runner.execute(out, extra) if extra else self.runner.execute(out)
        model_s = timer.lap()
        if self.scheduler.swapper is not None:  # the measured prefill rate of swap's cost model
            self.scheduler.swapper.cost.observe(out.num_batched_tokens, model_s)
        verify = None
        if extra:
            keep = int(logits.shape[0]) - sum(b for _, _, b in extra)
            mid = keep + sum(b for _, _, b in spans)
            if spans:
                self.outputs.record_prompt_logprobs(out, spans, logits[keep:mid].float())
            if drafts:
                verify = logits[mid:].float()
            logits = logits[:keep]
        return logits, verify

    def _verify(
        self,
        out: SchedulerOutput,
        verify: torch.Tensor,
        sampled: dict[str, list[int]],
        held: dict[str, LogprobEntry],
    ) -> list[tuple[Request, list[int], list[LogprobEntry]]]:
        """Replace each drafting sequence's sampled token (its bonus, after every draft)
        in ``sampled`` (mutated) by the tokens its verification emits
        (:meth:`_verify_one` on its ``verify`` rows, ``[num_drafts, vocab]`` in batch
        order) and count them (:meth:`_count_verified`). Returns, for each drafting
        sequence that asked for logprobs, ``(sequence, emitted ids, their entries)``."""
        targets: list[int] = torch.argmax(verify, dim=-1).tolist()
        lps: list[tuple[Request, list[int], list[LogprobEntry]]] = []
        r = 0
        for s in out.scheduled:
            d = s.draft_token_ids
            if not d:
                continue
            rid = s.request.request_id
            span = slice(r, r + len(d))
            emitted, ents = self._verify_one(
                s.request, d, verify[span], targets[span], sampled[rid][0], held
            )
            if ents is not None:
                lps.append((s.request, emitted, ents))
            r += len(d)
            sampled[rid] = emitted
            self._count_verified(rid, len(d), len(emitted) - 1)
        return lps

    def _count_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Add one verified draft run to ``spec_stats`` and the draft policy."""
        assert self.spec_stats is not None
        if self.scheduler.draft_policy is not None:
            self.scheduler.draft_policy.observe_verified(request_id, num_drafts, num_accepted)
        self.spec_stats.num_drafts += 1
        self.spec_stats.num_draft_tokens += num_drafts
        self.spec_stats.num_accepted_tokens += num_accepted

    def _verify_one(
        self,
        req: Request,
        drafts: list[int],
        rows: torch.Tensor,
        targets: list[int],
        bonus: int,
        held: dict[str, LogprobEntry],
    ) -> tuple[list[int], list[LogprobEntry] | None]:
        """The tokens one drafting sequence emits (greedy: ``accept_greedy`` on
        ``targets``, the argmax of its verification ``rows`` ``[len(drafts), vocab]``;
        sampled: ``accept_sampled`` on their target probabilities) and, when it asked
        for logprobs, one entry per emitted id (else None): draft position ``j`` scored
        on row ``j``, the ``bonus`` by its sampled row (``held``)."""
        p = req.params
        if p.greedy:
            emitted = accept_greedy(drafts, targets, bonus)
        else:
            probs = self.sampler.target_probs(rows.float().cpu(), [p] * len(drafts))
            gen = self.outputs.generator(req.parent_id, req.sample_index)
            assert gen is not None  # a sampled row has one
            emitted = accept_sampled(drafts, probs, bonus, gen)
        if p.logprobs is None:
            return emitted, None
        m = min(len(emitted), len(drafts))
        ents = compute_logprobs(rows[:m], emitted[:m], [p.logprobs] * m)
        if len(emitted) > len(drafts):
            ents.append(held[req.request_id])
        return emitted, ents

    def _observe_policy(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], seconds: float
    ) -> None:
        """Feed the draft policy this step's ``seconds`` (schedule to update; process CPU
        seconds on a CPU device, else wall) and emitted tokens; a step is pure decode when every scheduled sequence computed
        one token (or its last token and drafts) and sampled."""
        policy = self.scheduler.draft_policy
        assert policy is not None
        pure = all(s.samples and (s.draft_token_ids or s.num_tokens == 1) for s in out.scheduled)
        emitted = sum(len(v) for v in sampled.values())
        policy.observe_step(seconds, emitted, pure)

    def _sample(
        self,
        out: SchedulerOutput,
        logits: torch.Tensor,
        verify: torch.Tensor | None,
        started: float,
    ) -> tuple[dict[str, list[int]], list[tuple[Request, list[int], list[LogprobEntry]]]]:
        """Sample plan ``out``'s rows from ``logits`` and record the logprobs asked for;
        with draft ``verify`` rows, verify the drafts (:meth:`_verify`; the drafting
        sequences' logprobs wait for it). Returns ``({sequence id: its emitted ids},
        the drafting sequences' (sequence, emitted ids, logprob entries))``."""
        defer: frozenset[str] = frozenset()
        if verify is not None:
            defer = frozenset(s.request.request_id for s in out.scheduled if s.draft_token_ids)
        rows = self.outputs.sampling_rows(out, started)
        res = self.sampler.sample(logits, rows)
        held = self.outputs.record_logprobs(rows, res, defer)
        sampled = rows.by_request(res.token_ids)
        if verify is None:
            return sampled, []
        return sampled, self._verify(out, verify, sampled, held)

    def _fail_requests(self, parent_ids: set[str]) -> None:
        """Abort and forget the user requests ``parent_ids`` after a failed step."""
        for pid in sorted(parent_ids):
            self.scheduler.abort(pid)
            self.scheduler.release(pid)
            self.outputs.forget(pid)
        self.failed_request_ids.extend(sorted(parent_ids))


__all__ = [
    "CACHE_MISS_KEYS",
    "CACHE_MISS_METRIC",
    "METRIC_NAMES",
    "TIER_METRIC_TEMPLATES",
    "LLMEngine",
    "StepStats",
]
