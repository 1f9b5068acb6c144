"""LLMEngine: requests in, tokens out, one step at a time, on the paged KV cache.

``add_request`` validates and queues; ``step`` schedules, runs the model, samples and
returns the outputs of every request that progressed. See ``kvpage.engine.LLM`` for the
batch API and ``kvpage.engine.config`` for how the engine is built.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import torch

from kvpage.engine.config import EngineComponents, EngineConfig, build_components
from kvpage.engine.engine_metrics import (
    CACHE_MISS_KEYS,
    CACHE_MISS_METRIC,
    METRIC_NAMES,
    TIER_METRIC_TEMPLATES,
    EngineMetrics,
    StepStats,
)
from kvpage.engine.engine_output import EngineOutputs, _ParentRequest
from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.engine.prompts import parse_prompt
from kvpage.engine.queue_policy import check_priority
from kvpage.engine.request import Request
from kvpage.engine.request_extras import (
    prompt_logprob_spans,
    record_logprobs,
    record_prompt_logprobs,
    row_context,
)
from kvpage.engine.sampler import Sampler, make_generator
from kvpage.engine.scheduler import SchedulerOutput
from kvpage.errors import RequestRejected, got_repr


class LLMEngine(EngineMetrics, EngineOutputs):
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
        # one pass over the batch: rows to sample, and whether every row is the plain
        # greedy case (one sample, argmax, no logits processing: no per-row objects)
        simple = True
        decode_tokens = prefill_tokens = 0
        r = 0
        for s in out.scheduled:
            req = s.request
            if s.num_tokens == 1 and s.start >= req.num_prompt_tokens:
                decode_tokens += 1
            else:
                prefill_tokens += s.num_tokens
            preq = parents[req.parent_id]
            if preq.first_scheduled_time is None:
                preq.first_scheduled_time = step_start
            if not s.samples:
                continue
            p = preq.params
            k = 1 + req.num_pending_samples
            if k > 1 or not p.plain or p.temperature != 0.0:
                simple = False
            for j in range(k):
                rows.append(r)
                params.append(p)
                gens.append(None if p.greedy else self._generator(preq, j or req.sample_index))
                owners.append(req.request_id)
                row_reqs.append((req, j or req.sample_index))
            r += 1
        if len(rows) != int(logits.shape[0]):
            rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits = logits.index_select(0, rows_t)
        sampled: dict[str, list[int]] = {}
        if simple:  # the Sampler's greedy path (argmax, lowest index on ties)
            tokens: list[int] = torch.argmax(logits, dim=-1).tolist() if owners else []
            for rid, tok in zip(owners, tokens):
                sampled[rid] = [tok]
        else:
            if all(p.plain for p in params):
                tokens = self.sampler(logits, params, gens)
            else:
                ctx = None
                if any(p.needs_processing for p in params):
                    ctx = [row_context(q, self.eos_token_id) for q, _ in row_reqs]
                tokens = self.sampler(logits, params, gens, ctx)
                record_logprobs(parents, logits, params, tokens, row_reqs, self.tokenizer)
            for rid, tok in zip(owners, tokens):
                got = sampled.get(rid)
                if got is None:
                    sampled[rid] = [tok]
                else:
                    got.append(tok)
        t3 = time.perf_counter()
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
        st.decode_tokens += decode_tokens
        st.prefill_tokens += prefill_tokens
        st.last_batch_size = len(out.scheduled)
        return results


__all__ = [
    "CACHE_MISS_KEYS",
    "CACHE_MISS_METRIC",
    "METRIC_NAMES",
    "TIER_METRIC_TEMPLATES",
    "LLMEngine",
    "StepStats",
]
