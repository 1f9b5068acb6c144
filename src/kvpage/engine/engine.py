"""LLMEngine: requests in, tokens out, one step at a time, on the paged KV cache.

``add_request`` validates and queues; ``step`` schedules, runs the model, samples and
returns the outputs of every request that progressed. See ``kvpage.engine.LLM`` for the
batch API and ``kvpage.engine.config`` for how the engine is built.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpage.cache.explain import MISS_REASONS
from kvpage.engine.config import EngineComponents, EngineConfig, build_components
from kvpage.engine.params import CompletionOutput, RequestOutput, SamplingParams
from kvpage.engine.prompts import parse_prompt
from kvpage.engine.queue_policy import check_priority
from kvpage.engine.request import Request
from kvpage.engine.request_extras import (
    prompt_logprob_spans,
    record_logprobs,
    record_prompt_logprobs,
    row_context,
    stop_reason,
)
from kvpage.engine.sampler import Sampler, make_generator
from kvpage.engine.scheduler import SchedulerOutput
from kvpage.errors import RequestRejected

#: names of the engine metrics (the server exports the same; Prometheus style)
METRIC_NAMES = (
    "kvpage:kv_cache_usage_perc",
    "kvpage:num_requests_running",
    "kvpage:num_requests_waiting",
    "kvpage:prefix_cache_queries_total",
    "kvpage:prefix_cache_hits_total",
    "kvpage:num_preemptions_total",
    "kvpage:block_allocation_failures_total",
    "kvpage:evictions_total",
    "kvpage:prompt_tokens_total",
    "kvpage:generation_tokens_total",
    "kvpage:requests_rejected_total",
    "kvpage:kv_retained_blocks",
)
#: the labelled counter of first admissions by cache-miss reason: ``get_metrics`` keys
#: are ``f'{CACHE_MISS_METRIC}{{reason="{r}"}}'`` for every r in ``kvpage.cache.MISS_REASONS``
CACHE_MISS_METRIC = "kvpage:cache_miss_reasons_total"
#: the ``get_metrics`` keys of :data:`CACHE_MISS_METRIC`, after :data:`METRIC_NAMES`
CACHE_MISS_KEYS = tuple(f'{CACHE_MISS_METRIC}{{reason="{r}"}}' for r in MISS_REASONS)

#: per-tier metric name templates (``{tier}`` = ``host`` or ``disk``), present in
#: ``get_metrics`` for each configured KV tier (``EngineConfig.kv_*_tier_bytes``)
TIER_METRIC_TEMPLATES = (
    "kvpage:kv_tier_{tier}_usage_bytes",
    "kvpage:kv_tier_{tier}_capacity_bytes",
    "kvpage:kv_tier_{tier}_blocks",
    "kvpage:kv_tier_{tier}_hit_tokens_total",
    "kvpage:kv_tier_{tier}_promotions_total",
    "kvpage:kv_tier_{tier}_demotions_total",
    "kvpage:kv_tier_{tier}_drops_total",
    "kvpage:kv_tier_{tier}_corrupt_total",
    "kvpage:kv_tier_{tier}_write_errors_total",
    "kvpage:kv_tier_{tier}_bytes_in_total",
    "kvpage:kv_tier_{tier}_bytes_out_total",
    "kvpage:kv_tier_{tier}_transfer_seconds_total",
)


@dataclass
class StepStats:
    """Cumulative timing and token counts of ``LLMEngine.step`` (wall seconds from
    ``time.perf_counter``).

    Attributes:
        schedule_s: in ``Scheduler.schedule`` (admission, allocation, preemption).
        model_s: in ``ModelRunner.execute`` (metadata tensors, plan, forward).
        sample_s: in the sampler.
        update_s: in ``Scheduler.update`` (commit, append, stop checks, fork, free).
        output_s: building the RequestOutputs (timings, stop strings, text).
        prefill_tokens / decode_tokens: tokens computed as prompt (or recompute) chunks
            and as single decode tokens.
    """

    num_steps: int = 0
    num_seqs: int = 0
    schedule_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    output_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_batch_size: int = 0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.model_s + self.sample_s + self.update_s + self.output_s

    @property
    def bookkeeping_share(self) -> float:
        """Share of step time in scheduling and block bookkeeping: ``Scheduler.schedule``
        (admission, allocation, preemption) plus ``Scheduler.update`` (commit, append,
        free), over all step time."""
        t = self.total_s
        return (self.schedule_s + self.update_s) / t if t > 0 else 0.0


@dataclass
class _ParentRequest:
    """Engine-side state of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    arrival_order: int
    generators: dict[int, torch.Generator | None] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    first_token_time: float | None = None
    finish_time: float | None = None
    first_scheduled_time: float | None = None
    #: per sample: the PositionLogprobs of each generated token (params.logprobs)
    logprobs: dict[int, list[Any]] = field(default_factory=dict)
    cumulative: dict[int, float] = field(default_factory=dict)
    #: per prompt position (params.prompt_logprobs); position 0 stays None
    prompt_logprobs: list[Any] | None = None
    stop_reasons: dict[int, int | str] = field(default_factory=dict)


class LLMEngine:
    """The engine (see the module docstring). Build with :meth:`from_config`.

    Attributes:
        config: the resolved EngineConfig.
        tokenizer: the model's tokenizer (None for a model without one).
        cache_spec: the KV cache layout in use.
        backend_name: the attention backend's name.
        kv_cache_manager, scheduler, runner: the components (read-only use).
        stream_text: when True, unfinished outputs carry decoded text too (costs a
            decode per token); finished outputs always do.
    """

    def __init__(self, config: EngineConfig, components: EngineComponents) -> None:
        self.config = config
        self.model = components.model
        self.tokenizer = getattr(self.model, "tokenizer", None)
        self.cache_spec = components.cache_spec
        self.backend = components.backend
        self.backend_name: str = str(getattr(self.backend, "name", type(self.backend).__name__))
        self.kv_cache_manager = components.kv_cache_manager
        self.scheduler = components.scheduler
        self.runner = components.runner
        #: the KV tiers below the pool (None = none configured)
        self.tiers = components.tiers
        self.sampler = Sampler()
        self.vocab_size = int(self.model.config.get("vocab_size", 0))
        self.eos_token_id = getattr(self.tokenizer, "eos_id", None)
        if self.eos_token_id is None:
            eos = self.model.config.get("eos_token_id")
            self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.stream_text = False
        self.step_stats = StepStats()
        self._parents: dict[str, _ParentRequest] = {}
        self._arrivals = 0
        self._unique_salts = 0
        #: unfinished requests with prompt_logprobs (0: the step skips looking for them)
        self._num_prompt_lp = 0
        self._counters = {"prompt": 0, "generation": 0, "rejected": 0}
        #: ids of user requests dropped by failed steps (oldest first)
        self.failed_request_ids: deque[str] = deque(maxlen=1024)

    @classmethod
    def from_config(cls, **kwargs: Any) -> LLMEngine:
        """Build an engine from the ``LLM`` keyword arguments (see EngineConfig)."""
        config = EngineConfig(**kwargs)
        return cls(config, build_components(config))

    # ---- requests -----------------------------------------------------------------------
    def _parse_prompt(self, prompt: Any) -> tuple[str | None, list[int], str | None]:
        return parse_prompt(prompt, self.tokenizer, self.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
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
                "duplicate_request_id". No state changes (apart from the rejected-requests
                counter).
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
                stop_token_set=frozenset(params.stop_token_ids or ()),
                priority=priority,
            )
            self.scheduler.add_request(req)
        except RequestRejected as e:
            e.request_id = request_id
            self._counters["rejected"] += 1
            raise
        now = time.monotonic() if arrival_time is None else arrival_time
        preq = _ParentRequest(request_id, text, list(ids), params, now, req.arrival_order)
        if params.prompt_logprobs is not None:
            preq.prompt_logprobs = [None] * len(ids)
            self._num_prompt_lp += 1
        self._parents[request_id] = preq
        self._counters["prompt"] += len(ids)

    def abort_request(self, request_id: str) -> None:
        """Abort a request: every sample stops and its blocks are freed at once.
        Unknown or finished ids are ignored."""
        if request_id not in self._parents:
            return
        self.scheduler.abort(request_id)
        self.scheduler.release(request_id)
        self._forget(request_id)

    def _forget(self, parent_id: str) -> None:
        """Drop a user request's engine-side state (finished, aborted or failed)."""
        preq = self._parents.pop(parent_id, None)
        if preq is not None and preq.prompt_logprobs is not None:
            self._num_prompt_lp -= 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- one step -----------------------------------------------------------------------
    def _generator(self, preq: _ParentRequest, index: int) -> torch.Generator | None:
        if preq.params.greedy:
            return None
        g = preq.generators.get(index)
        if g is None:
            g = make_generator(preq.params, self.config.seed, preq.arrival_order, index)
            preq.generators[index] = g
        return g

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step and the model.

        Args:
            finished_only: return only the requests that finished this step (skips
                building outputs of running requests; for offline batch use).

        Returns:
            One RequestOutput per user request that progressed this step (got a token
            or finished), ``finished=True`` on the step it completes.

        Raises:
            Exception: whatever the model, sampler or scheduler raised. The requests
                scheduled in the failed step (every running one if scheduling itself
                failed) are aborted, their blocks freed and their ids forgotten (and
                appended to ``failed_request_ids``); every other request is untouched,
                so the engine stays usable.
        """
        t0 = time.perf_counter()
        try:
            out = self.scheduler.schedule()
        except BaseException:
            # the plan may be half-built: drop every running request (frees its blocks)
            self._fail_requests({r.parent_id for r in self.scheduler.running})
            raise
        if out.is_empty:
            if self.tiers is not None:
                self.tiers.flush()  # demote this step's evictions (nothing runs)
            return []
        try:
            if self.tiers is not None:
                # one batched copy-out of the blocks evicted while scheduling, before
                # the forward (and its copy-on-write copies) writes into them
                self.tiers.flush()
            return self._run_step(out, t0, finished_only)
        except BaseException:
            # a model, sampler or bookkeeping failure: the requests of this step are
            # dropped (blocks freed, ids forgotten) so the engine stays usable
            self._fail_requests({s.request.parent_id for s in out.scheduled})
            raise

    def _fail_requests(self, parent_ids: set[str]) -> None:
        """Abort and forget the user requests ``parent_ids`` after a failed step."""
        for pid in sorted(parent_ids):
            self.scheduler.abort(pid)
            self.scheduler.release(pid)
            self._forget(pid)
        self.failed_request_ids.extend(sorted(parent_ids))

    def _run_step(
        self, out: SchedulerOutput, t0: float, finished_only: bool
    ) -> list[RequestOutput]:
        st = self.step_stats
        parents = self._parents
        step_start = time.monotonic()
        t1 = time.perf_counter()
        spans = prompt_logprob_spans(out) if self._num_prompt_lp else []
        logits = self.runner.execute(out, spans) if spans else self.runner.execute(out)
        t2 = time.perf_counter()
        if self.scheduler.swapper is not None:  # the measured prefill rate of swap's cost model
            self.scheduler.swapper.cost.observe(out.num_batched_tokens, t2 - t1)
        if spans:
            n_extra = sum(b for _, _, b in spans)
            extra = logits[logits.shape[0] - n_extra :]
            record_prompt_logprobs(parents, out, spans, extra, self.tokenizer)
            logits = logits[: logits.shape[0] - n_extra]
        rows: list[int] = []
        params: list[SamplingParams] = []
        gens: list[torch.Generator | None] = []
        owners: list[str] = []
        row_reqs: list[tuple[Request, int]] = []
        r = 0
        for s in out.scheduled:
            req = s.request
            preq = parents[req.parent_id]
            if preq.first_scheduled_time is None:
                preq.first_scheduled_time = step_start
            if not s.samples:
                continue
            k = 1 + req.num_pending_samples
            for j in range(k):
                rows.append(r)
                params.append(preq.params)
                gens.append(
                    None if preq.params.greedy else self._generator(preq, j or req.sample_index)
                )
                owners.append(req.request_id)
                row_reqs.append((req, j or req.sample_index))
            r += 1
        if len(rows) != int(logits.shape[0]):
            rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits = logits.index_select(0, rows_t)
        if all(p.plain for p in params):
            tokens = self.sampler(logits, params, gens)
        else:
            ctx = None
            if any(p.needs_processing for p in params):
                ctx = [row_context(q, self.eos_token_id) for q, _ in row_reqs]
            tokens = self.sampler(logits, params, gens, ctx)
            record_logprobs(parents, logits, params, tokens, row_reqs, self.tokenizer)
        t3 = time.perf_counter()
        sampled: dict[str, list[int]] = {}
        for rid, tok in zip(owners, tokens):
            got = sampled.get(rid)
            if got is None:
                sampled[rid] = [tok]
            else:
                got.append(tok)
        progressed, _ = self.scheduler.update(out, sampled)
        t4 = time.perf_counter()
        now = time.monotonic()
        touched: dict[str, _ParentRequest] = {}
        for seq in progressed:
            preq = parents[seq.parent_id]
            touched[seq.parent_id] = preq
            if preq.first_token_time is None:
                preq.first_token_time = now
            if (
                preq.params.stop
                and not seq.is_finished
                and seq.num_output_tokens >= preq.params.min_tokens
            ):
                self._check_stop_strings(seq, preq)
        self._counters["generation"] += len(progressed)
        results = []
        for pid, preq in touched.items():
            done = self.scheduler.samples_finished(pid)
            if done:
                preq.finish_time = now
            elif finished_only:
                continue
            results.append(self._make_output(preq, done))
            if done:
                self.scheduler.release(pid)
                self._forget(pid)
        t5 = time.perf_counter()
        st.num_steps += 1
        st.schedule_s += t1 - t0
        st.model_s += t2 - t1
        st.sample_s += t3 - t2
        st.update_s += t4 - t3
        st.output_s += t5 - t4
        st.num_seqs += len(out.scheduled)
        for s in out.scheduled:
            if s.num_tokens == 1 and s.start >= s.request.num_prompt_tokens:
                st.decode_tokens += 1
            else:
                st.prefill_tokens += s.num_tokens
        st.last_batch_size = len(out.scheduled)
        return results

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids))

    def _check_stop_strings(self, seq: Request, preq: _ParentRequest) -> None:
        text = self._decode(seq.output_token_ids)
        mt = preq.params.min_tokens
        # with min_tokens, a stop string must end in the min_tokens-th token or later
        floor = len(self._decode(seq.output_token_ids[: mt - 1])) if mt > 1 else 0
        for stop in preq.params.stop or ():
            k = text.find(stop, max(0, floor - len(stop) + 1))
            if k >= 0:
                keep = k + len(stop) if preq.params.include_stop_str_in_output else k
                preq.texts[seq.sample_index] = text[:keep]
                preq.stop_reasons[seq.sample_index] = stop
                self.scheduler.finish(seq, "stop")
                return

    def _make_output(self, preq: _ParentRequest, finished: bool) -> RequestOutput:
        seqs = self.scheduler.samples[preq.request_id]  # sample-index order (forks append)
        outs = []
        want_lp = preq.params.logprobs is not None
        for q in seqs:
            i = q.sample_index
            text = preq.texts.get(i)
            if text is None and (finished or self.stream_text):
                text = self._decode(q.output_token_ids)
            reason = q.finish_reason if q.is_finished else None
            outs.append(
                CompletionOutput(
                    index=i,
                    token_ids=q.output_token_ids,
                    text=text or "",
                    finish_reason=reason,
                    stop_reason=stop_reason(preq, q, self.eos_token_id)
                    if reason == "stop"
                    else None,
                    logprobs=list(preq.logprobs.get(i, ())) if want_lp else None,
                    cumulative_logprob=preq.cumulative.get(i, 0.0) if want_lp else None,
                )
            )
        cached = max(0, seqs[0].num_cached_tokens)
        return RequestOutput(
            request_id=preq.request_id,
            prompt=preq.prompt,
            prompt_token_ids=preq.prompt_token_ids,
            num_cached_tokens=cached,
            cache_miss=seqs[0].cache_miss,
            outputs=outs,
            finished=finished,
            arrival_time=preq.arrival_time,
            first_token_time=preq.first_token_time,
            finish_time=preq.finish_time,
            first_scheduled_time=preq.first_scheduled_time,
            num_preemptions=sum(q.num_preemptions for q in seqs),
            prompt_logprobs=None if preq.prompt_logprobs is None else list(preq.prompt_logprobs),
            num_cached_tokens_by_tier={
                "device": 0,
                **{k: v for k, v in (seqs[0].num_cached_tokens_by_tier or {}).items() if v},
            }
            if seqs[0].num_cached_tokens >= 0
            else {},
        )

    # ---- metrics ------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        """Current values of :data:`METRIC_NAMES`: KV usage as a fraction in [0, 1]
        (cached-but-unreferenced blocks count as free), running/waiting sequences, and
        counters since the engine started (prefix cache queries/hits in tokens), the
        free blocks held at a raised retention priority, and first admissions by
        cache-miss reason (:data:`CACHE_MISS_METRIC`, one key per reason); plus, per
        configured KV tier, :data:`TIER_METRIC_TEMPLATES` (bytes, blocks, tokens,
        seconds), and with swap preemption ``kvpage:swap_*`` (space in use, swap-outs,
        swap-ins, victims recomputed instead, bytes moved, transfer seconds)."""
        kv = self.kv_cache_manager
        st = kv.stats
        reasons = self.scheduler.miss_reasons
        misses = {k: float(reasons.get(r, 0)) for k, r in zip(CACHE_MISS_KEYS, MISS_REASONS)}
        out = {
            "kvpage:kv_cache_usage_perc": float(kv.usage),
            "kvpage:num_requests_running": float(self.scheduler.num_running),
            "kvpage:num_requests_waiting": float(self.scheduler.num_waiting),
            "kvpage:prefix_cache_queries_total": float(st.prefix_queries_tokens),
            "kvpage:prefix_cache_hits_total": float(st.prefix_hits_tokens),
            "kvpage:num_preemptions_total": float(self.scheduler.num_preemptions),
            "kvpage:block_allocation_failures_total": float(st.allocation_failures),
            "kvpage:evictions_total": float(st.evictions),
            "kvpage:prompt_tokens_total": float(self._counters["prompt"]),
            "kvpage:generation_tokens_total": float(self._counters["generation"]),
            "kvpage:requests_rejected_total": float(self._counters["rejected"]),
            "kvpage:kv_retained_blocks": float(kv.num_retained_blocks),
            **misses,
        }
        sw = self.scheduler.swapper
        if sw is not None:
            ss = sw.stats
            out["kvpage:swap_space_usage_bytes"] = float(sw.used_bytes)
            out["kvpage:swap_outs_total"] = float(ss.swap_outs)
            out["kvpage:swap_ins_total"] = float(ss.swap_ins)
            out["kvpage:swap_recomputed_total"] = float(ss.recomputed)
            out["kvpage:swap_bytes_total"] = float(ss.bytes_out + ss.bytes_in)
            out["kvpage:swap_transfer_seconds_total"] = float(ss.transfer_s)
        if self.tiers is not None:
            for t in self.tiers.tiers:
                ts = t.stats
                vals = (
                    t.used_bytes,
                    t.capacity_bytes,
                    len(t),
                    ts.hits_tokens,
                    ts.promotions,
                    ts.demotions,
                    ts.drops,
                    ts.corrupt,
                    ts.write_errors,
                    ts.bytes_in,
                    ts.bytes_out,
                    ts.transfer_s,
                )
                for tpl, v in zip(TIER_METRIC_TEMPLATES, vals):
                    out[tpl.format(tier=t.name)] = float(v)
        return out


__all__ = [
    "CACHE_MISS_KEYS",
    "CACHE_MISS_METRIC",
    "METRIC_NAMES",
    "TIER_METRIC_TEMPLATES",
    "LLMEngine",
    "StepStats",
]
