"""The serving core: validation, admission, and turning engine outputs into responses.

:class:`ServingState` is framework-free (no FastAPI import) apart from the types it is
handed; ``kvpage.server.app`` wires it to HTTP routes. All methods run on the event loop.

Request life: :meth:`ServingState.prepare` validates and tokenizes (400/404 on bad input,
no state touched) -> :meth:`ServingState.admitted` charges the tenant bucket, reserves
KV budget and, when degraded, takes a long-context slot (429 + Retry-After when refused;
everything taken is given back on the way out) -> :meth:`ServingState.generate` adds the
request to the engine and yields per-choice text deltas, applying stop strings; if the
consumer goes away (client disconnect) the request is aborted at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvpage.errors import RequestRejected
from kvpage.server.admission import Decision, KVBudget, PrioritySlots, TenantLimiter
from kvpage.server.auth import Authenticator
from kvpage.server.config import ServerConfig
from kvpage.server.degradation import DegradationController
from kvpage.server.engine_loop import AsyncEngine, EngineFailure, StepStats
from kvpage.server.metrics import ServerMetrics
from kvpage.server.protocol import APIError, GenerationRequest
from kvpage.server.validation import max_token_bytes

__all__ = ["APIError", "Delta", "ServingState", "Usage", "rejection_error"]

#: engine RequestRejected reasons answered with 429 (transient); all others get 400.
_TRANSIENT_REASONS = frozenset({"queue_full", "too_many_requests", "overloaded"})


def _rate_limited(d: Decision) -> APIError:
    headers = {"Retry-After": str(d.retry_after_s)} if d.retry_after_s is not None else {}
    return APIError(
        429, d.message, type="rate_limit_exceeded", code=d.reason, headers=headers, reason=d.reason
    )


@dataclass
class Delta:
    """New text for one choice. ``finish_reason`` (and ``stop_reason``, vLLM's: the stop
    string or stop token id) are set on the choice's last delta. ``token_ids`` are the
    tokens generated since the previous delta and ``logprobs`` their
    ``PositionLogprobs`` (when the request asked for logprobs)."""

    index: int
    text: str
    finish_reason: str | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    stop_reason: int | str | None = None


@dataclass
class Usage:
    """Token counts of one request, filled in by :meth:`ServingState.generate`.

    Attributes:
        completion_tokens: generated tokens, summed over choices.
        cached_tokens: prompt tokens served from the prefix cache.
        prompt_logprobs: the engine's prompt logprobs (``prompt_logprobs`` requests).
        cache_info: ``{"cached_tokens_by_tier", "miss"}`` of the request: the tenant's
            view of the cache-miss explanation (``CacheMissExplanation.public``: a hit
            held under another tenant's key is reported as ``never_seen``).
    """

    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None
    cache_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Choice:
    text: str = ""  # text accepted so far (after stop-string truncation)
    sent: int = 0  # characters of ``text`` already yielded
    num_tokens: int = 0
    tok_sent: int = 0  # tokens already yielded
    finish: str | None = None
    stop_reason: int | str | None = None
    stop_floor: int | None = None  # stop strings may not end before this text offset


class ServingState:
    """Everything one server instance holds.

    Args:
        config: the server configuration.
        engine: an engine with the Engine contract (``tokenizer``, ``cache_spec``,
            ``backend_name`` and the request methods).
        sampling_params_cls: ``SamplingParams`` class of that engine.
        clock: monotonic clock in seconds; must agree with ``time.monotonic`` (request
            arrival times are taken with it).
    """

    #: export the engine loop's metric snapshot as the ``kvpage:*`` engine metrics of
    #: /metrics (a scaled-out ingress exports each replica's instead, with labels)
    export_engine_snapshot = True

    def __init__(
        self,
        config: ServerConfig,
        engine: Any,
        sampling_params_cls: Callable[..., Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = engine.tokenizer
        #: bytes of text one token covers at most (None: unknown), for the pre-encode check
        self.max_bytes_per_token = max_token_bytes(self.tokenizer)
        #: validation + tokenization run here, off the event loop (encode can be slow)
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kvpage-tokenize"
        )
        self.params_cls = sampling_params_cls
        self.clock = clock
        spec = engine.cache_spec
        sched = getattr(engine, "scheduler", None)
        self.max_model_len = int(
            getattr(sched, "max_model_len", None) or config.engine.max_model_len or 1 << 30
        )
        #: the engine loop: a thread here, or the pipe to an engine process
        make_loop = getattr(engine, "make_async_engine", None)
        self.loop: Any = (
            make_loop(on_step=self._on_step)
            if make_loop is not None
            else AsyncEngine(engine, on_step=self._on_step)
        )
        total = getattr(spec, "total_bytes", 0)
        self.metrics = ServerMetrics(
            lambda: self.loop.metrics_snapshot if self.export_engine_snapshot else {},
            float(total() if callable(total) else total),
            model_name=config.model_name,
        )
        self.metrics.cache_config.info(
            {
                "block_size": str(spec.block_size),
                "num_blocks": str(spec.num_blocks),
                "kv_dtype": str(getattr(spec, "kv_dtype", "auto")),
                "backend": str(getattr(engine, "backend_name", "unknown")),
                "model": config.model_name,
            }
        )
        #: the engine's scheduling policy (``fcfs`` | ``priority``)
        self.scheduling_policy = str(
            getattr(sched, "policy", None) or config.engine.scheduling_policy
        )
        #: API keys -> tenants (raises SpecError on a bad keys file)
        self.auth = Authenticator(config.security)
        self.auth.check_policy(self.scheduling_policy)
        cap = config.security.max_unauthenticated_tenants
        self.limiter = TenantLimiter(
            config.admission,
            self.auth.limits(),
            max_tenants=max(cap, len(self.auth.tenants)) if self.auth.enabled else cap,
        )
        #: engine steps that ran out of device or host memory
        self.num_oom = 0
        self.kv_budget = KVBudget(
            max(1, spec.num_blocks - 1), spec.block_size, config.admission, self.scheduling_policy
        )
        self.degradation = DegradationController(
            config.degradation, clock(), on_change=lambda d, _r: self.metrics.set_degraded(d)
        )
        self.long_slots = PrioritySlots(
            config.degradation.long_context_concurrency, self.scheduling_policy
        )
        self.num_long_waiting = 0
        self.num_active = 0
        self._prev_snapshot: dict[str, float] = dict(self.loop.metrics_snapshot)

    # ------------------------------------------------------------ engine thread hook
    def _on_step(self, st: StepStats) -> None:
        if st.failed:
            self.metrics.step_failures.inc()
        if st.oom:
            self.num_oom += 1
            self.metrics.oom.inc()
        prev, cur = self._prev_snapshot, st.metrics
        self._prev_snapshot = dict(cur)
        self.metrics.step_running.observe(cur.get("kvpage:num_requests_running", 0.0))
        self.metrics.step_waiting.observe(cur.get("kvpage:num_requests_waiting", 0.0))
        if st.duration_s <= 0:
            return
        dp = cur.get("kvpage:prompt_tokens_total", 0.0) - prev.get(
            "kvpage:prompt_tokens_total", 0.0
        )
        dg = cur.get("kvpage:generation_tokens_total", 0.0) - prev.get(
            "kvpage:generation_tokens_total", 0.0
        )
        if dp > 0:
            self.metrics.prefill_tps.observe(dp / st.duration_s)
        if dg > 0:
            self.metrics.decode_tps.observe(dg / st.duration_s)

    def health(self) -> tuple[int, dict[str, Any]]:
        """``GET /health``: 200 while the engine loop runs, else 503, with the
        degradation state. Reads two flags: never waits on the engine or a pool."""
        ok = self.loop.running
        body = {
            "status": "ok" if ok else "engine loop not running",
            "degraded": self.degradation.degraded,
        }
        return (200 if ok else 503), body

    # ------------------------------------------------------------ periodic control
    def tick(self) -> None:
        """Evaluate degradation and refresh gauges (called every ``eval_interval_s``)."""
        now = self.clock()
        snap = self.loop.metrics_snapshot
        # An out-of-memory step weighs as much as enter_alloc_failures allocation
        # failures: one OOM is enough to enter degraded mode.
        oom_weight = self.num_oom * self.config.degradation.enter_alloc_failures
        self.degradation.record_alloc_failures_total(
            snap.get("kvpage:block_allocation_failures_total", 0.0) + oom_weight, now
        )
        self.degradation.evaluate(now)
        self.tick_gauges()

    def tick_gauges(self) -> None:
        """Refresh the gauges derived from the engine snapshot and the admission state."""
        snap = self.loop.metrics_snapshot
        m = self.metrics
        m.update_from_engine(snap)
        m.queue_length.labels(queue="kv_pressure").set(self.kv_budget.num_queued)
        m.queue_length.labels(queue="long_context").set(self.num_long_waiting)
        m.kv_util.labels(kind="projected").set(self.kv_budget.projected_usage())
        m.active.set(self.num_active)

    # ------------------------------------------------------------ admission
    @contextlib.asynccontextmanager
    async def admitted(self, req: GenerationRequest) -> AsyncIterator[None]:
        """Admit ``req`` for the duration of the ``async with`` block.

        Caps ``req.max_tokens`` when degraded, charges the tenant, reserves KV budget and
        (degraded, long context) a long-context slot; gives back the reservation and slot
        on exit, and refunds the tenant if the engine refuses the request.

        Raises:
            APIError: 429 with ``Retry-After`` when refused.
        """
        capped = self.degradation.cap_max_tokens(req.max_tokens)
        if capped != req.max_tokens:
            req.requested_max_tokens = req.max_tokens
            req.max_tokens = capped
            self.metrics.max_tokens_capped.inc()
        now = self.clock()
        d = self.limiter.try_take(req.tenant, req.cost, now)
        if not d.ok:
            raise _rate_limited(d)
        n_prompt = len(req.prompt_token_ids)
        blocks = self.kv_budget.blocks_for(n_prompt, req.max_tokens, req.n)
        try:
            d = await self.kv_budget.acquire(n_prompt, blocks, req.priority)
        except BaseException:
            self.limiter.refund(req.tenant, req.cost, self.clock())
            raise
        if not d.ok:
            self.limiter.refund(req.tenant, req.cost, self.clock())
            raise _rate_limited(d)
        slot = False
        try:
            if self.degradation.degraded and self.kv_budget.is_long(n_prompt):
                self.num_long_waiting += 1
                try:
                    await asyncio.wait_for(
                        self.long_slots.acquire(req.priority), self.config.admission.queue_timeout_s
                    )
                    slot = True
                except asyncio.TimeoutError:
                    raise _rate_limited(
                        Decision(
                            False,
                            "long_context_queue",
                            self.config.admission.retry_after_s,
                            "long-context queue (degraded mode): expected a free slot within "
                            f"{self.config.admission.queue_timeout_s:g}s, got none",
                        )
                    ) from None
                finally:
                    self.num_long_waiting -= 1
            self.num_active += 1
            try:
                yield
            finally:
                self.num_active -= 1
        except APIError as e:
            if e.status != 429 or e.reason == "long_context_queue" or e.code == "engine_rejected":
                self.limiter.refund(req.tenant, req.cost, self.clock())
            raise
        finally:
            if slot:
                self.long_slots.release()
            self.kv_budget.release(blocks)

    # ------------------------------------------------------------ generation
    async def generate(self, req: GenerationRequest, usage: Usage) -> AsyncGenerator[Delta, None]:
        """Run ``req`` on the engine; yield text deltas per choice as tokens arrive.

        ``usage.completion_tokens`` is updated as tokens arrive (summed over choices).

        Stop strings are applied here (the text is cut before the stop string, which is
        not returned, and the choice finishes with ``"stop"``); streamed text holds back
        the last ``len(longest stop) - 1`` characters until they cannot start a stop string.
        Closing the iterator early aborts the request in the engine at once.

        Raises:
            APIError: 400/429 when the engine refuses the request, 500 on engine failure.
        """
        arrival = req.arrival_s
        try:
            params = self.params_cls(
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                n=req.n,
                seed=req.seed,
                ignore_eos=req.ignore_eos,
                stop=req.stop or None,
                stop_token_ids=req.stop_token_ids or None,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                min_p=req.min_p,
                min_tokens=min(req.min_tokens, req.max_tokens),
                logprobs=req.logprobs,
                prompt_logprobs=req.prompt_logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                **({} if req.kv_retention is None else {"kv_retention": req.kv_retention}),
            )
            prompt: Any = list(req.prompt_token_ids)
            if req.cache_salt is not None:
                prompt = {"prompt_token_ids": prompt, "cache_salt": req.cache_salt}
            q = await self.loop.add(
                req.request_id, prompt, params, arrival_time=arrival, priority=req.priority
            )
        except RequestRejected as exc:
            raise rejection_error(exc) from None
        choices = [_Choice() for _ in range(req.n)]
        hold = max((len(s) for s in req.stop), default=1) - 1
        first_token_at: float | None = None
        done = False
        last: Any = None
        try:
            while not done:
                out = last = await q.get()
                if isinstance(out, EngineFailure):
                    done = True
                    if out.oom:
                        raise APIError(
                            503,
                            f"engine: out of memory in the step running this request ({out})",
                            type="server_error",
                            code="out_of_memory",
                            headers={"Retry-After": str(self.config.admission.retry_after_s)},
                            reason="out_of_memory",
                        )
                    raise APIError(
                        500,
                        f"engine: step failed ({out})",
                        type="server_error",
                        reason="engine_error",
                    )
                done = bool(out.finished)
                usage.cached_tokens = int(out.num_cached_tokens)
                if not usage.cache_info:
                    why = getattr(out, "cache_miss", None)
                    usage.cache_info = {
                        "cached_tokens_by_tier": dict(
                            getattr(out, "num_cached_tokens_by_tier", None)
                            or {"device": usage.cached_tokens}
                        ),
                        "miss": None if why is None else why.public().to_dict(),
                    }
                if out.prompt_logprobs is not None:
                    usage.prompt_logprobs = out.prompt_logprobs
                for comp in out.outputs:
                    c = choices[comp.index]
                    if c.finish is not None:
                        continue
                    usage.completion_tokens += len(comp.token_ids) - c.num_tokens
                    c.num_tokens = len(comp.token_ids)
                    if first_token_at is None and c.num_tokens > 0:
                        first_token_at = self.clock()
                        self.metrics.ttft.observe(first_token_at - arrival)
                        self.degradation.record_ttft(first_token_at - arrival, first_token_at)
                    if comp.finish_reason is None and not req.stream:
                        continue  # not streamed: only the final text matters
                    # Only the request's final output carries the engine's text (stop
                    # strings already cut). A choice that ends before its siblings (n > 1,
                    # e.g. after a preemption) arrives with finish_reason set but text ""
                    # on a not-yet-finished output, so decode its token ids here (stop
                    # strings are re-applied below).
                    full = (
                        comp.text
                        if out.finished
                        else str(self.tokenizer.decode(list(comp.token_ids)))
                    )
                    hit = None
                    if req.stop and c.num_tokens >= req.min_tokens:
                        if c.stop_floor is None:  # min_tokens: earlier text never stops
                            k = req.min_tokens - 1
                            c.stop_floor = (
                                len(self.tokenizer.decode(list(comp.token_ids[:k]))) if k else 0
                            )
                        hit = _find_stop(full, req.stop, c.text, c.stop_floor)
                    if hit is not None:
                        cut, s = hit
                        keep = cut + len(s) if req.include_stop_str_in_output else cut
                        c.text, c.finish, c.stop_reason = full[:keep], "stop", s
                    else:
                        c.text = full
                        if comp.finish_reason is not None or out.finished:
                            c.finish = comp.finish_reason or "length"
                            c.stop_reason = comp.stop_reason
                    end = len(c.text) if c.finish else _safe_end(c.text, hold)
                    if end > c.sent or c.finish:
                        lps = comp.logprobs[c.tok_sent :] if comp.logprobs is not None else None
                        yield Delta(
                            comp.index,
                            c.text[c.sent : end],
                            c.finish,
                            list(comp.token_ids[c.tok_sent :]),
                            lps,
                            c.stop_reason,
                        )
                        c.sent = max(c.sent, end)
                        c.tok_sent = len(comp.token_ids)
                if not done and all(c.finish is not None for c in choices):
                    await self.loop.abort(req.request_id)  # every choice hit a stop string
                    done = True
        finally:
            if not done:
                self.loop.abort_nowait(req.request_id)
                self.metrics.cancellations.labels(cause="client_disconnect").inc()
            else:
                self._finished(arrival, first_token_at, choices, last)
        for c in choices:  # choices the engine ended without a final output (defensive)
            if c.finish is None:
                c.finish = "length"
                yield Delta(choices.index(c), c.text[c.sent :], "length")

    def _finished(
        self, arrival: float, first: float | None, choices: list[_Choice], out: Any
    ) -> None:
        now = self.clock()
        m = self.metrics
        m.e2e.observe(now - arrival)
        longest = max((c.num_tokens for c in choices), default=0)
        if first is not None and longest > 1:
            m.tpot.observe((now - first) / (longest - 1))
        for c in choices:
            m.request_success.labels(
                finished_reason=c.finish or "length", model_name=m.model_name
            ).inc()
        # phases from the engine's own (monotonic) timestamps of the last output
        sched = getattr(out, "first_scheduled_time", None)
        tok = getattr(out, "first_token_time", None)
        end = getattr(out, "finish_time", None) or now
        if sched is not None:
            m.phase["queue"].observe(max(0.0, sched - arrival))
            m.phase["inference"].observe(max(0.0, end - sched))
            if tok is not None:
                m.phase["prefill"].observe(max(0.0, tok - sched))
                m.phase["decode"].observe(max(0.0, end - tok))


def rejection_error(exc: RequestRejected) -> APIError:
    """The API error for an engine refusal: 429 for transient reasons, else 400.

    ``param`` is the field the message names (``"seed: expected ..."`` -> ``"seed"``),
    mapped to the OpenAI field name where they differ, or None.
    """
    status = 429 if exc.reason in _TRANSIENT_REASONS else 400
    head, sep, _ = str(exc).partition(":")
    param = head.strip() if sep and head.strip().isidentifier() else None
    if param in ("prompt_token_ids", "request_id"):
        param = "prompt" if param == "prompt_token_ids" else None
    return APIError(
        status,
        str(exc),
        type="rate_limit_exceeded" if status == 429 else "invalid_request_error",
        code="engine_rejected",
        param=param,
        reason=exc.reason,
    )


def _find_stop(full: str, stops: list[str], prev: str, floor: int = 0) -> tuple[int, str] | None:
    """``(index, stop string)`` of the earliest stop string in ``full``, searching new
    text only (and only matches ending after ``floor``, the text of the first
    ``min_tokens - 1`` tokens)."""
    if not stops:
        return None
    best: tuple[int, str] | None = None
    for s in stops:
        k = full.find(s, max(0, len(prev) - len(s) + 1, floor - len(s) + 1))
        if k >= 0 and (best is None or k < best[0]):
            best = (k, s)
    return best


def _safe_end(text: str, hold: int) -> int:
    """How much of ``text`` may be streamed: hold back ``hold`` chars and trailing U+FFFD."""
    end = len(text) - hold
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return max(0, end)
