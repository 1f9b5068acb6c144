"""Generation for :class:`~kvpage.server.service.ServingState`: running one admitted
request on the engine and turning its outputs into per-choice text deltas (stop strings,
streamed hold-back, the finished request's metrics), and the API error of an engine
refusal. :class:`RequestGenerator` is the object that does it; ``ServingState`` holds
one (``state.generation``) and hands it the engine loop, metrics and degraded-mode
controller it shares.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvpage.engine.params import (
    CompletionOutput,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
)
from kvpage.errors import RequestRejected
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server.config import ServerConfig
from kvpage.server.degradation import DegradationController
from kvpage.server.engine_client import EngineClient, EngineFailure, EngineOutput, PromptInput
from kvpage.server.metrics import RequestSeries, ServerMetrics
from kvpage.server.protocol import APIError, GenerationRequest

__all__ = [
    "Delta",
    "RequestGenerator",
    "Usage",
    "current_placements",
    "merged_placement",
    "rejection_error",
    "track_placements",
]

#: the placements (``{"group", "replica"}``) of the engine requests started in this
#: context: set per HTTP request by :func:`track_placements`; every request that reaches
#: the engine loop appends its placement (a scaled-out ingress: the group and replica;
#: the single server: ``{}``)
_PLACEMENTS: ContextVar[list[dict[str, str]] | None] = ContextVar("kvpage_placements", default=None)


@contextlib.contextmanager
def track_placements() -> Iterator[list[dict[str, str]]]:
    """Collect the placements of the engine requests started inside the block (the
    prompts of one HTTP request; tasks it starts share the list)."""
    holder: list[dict[str, str]] = []
    token = _PLACEMENTS.set(holder)
    try:
        yield holder
    finally:
        _PLACEMENTS.reset(token)


def current_placements() -> list[dict[str, str]]:
    """The placements collected so far by the enclosing :func:`track_placements`."""
    return list(_PLACEMENTS.get() or ())


def merged_placement(placements: list[dict[str, str]]) -> dict[str, str]:
    """One placement for an HTTP request from its prompts' placements: each label's
    value when every prompt agrees, ``"mixed"`` when they differ, absent (``"none"`` in
    the metrics) when no prompt reached the engine loop."""
    out: dict[str, str] = {}
    for key in sorted({k for p in placements for k in p}):
        values = {p.get(key, "") for p in placements}
        out[key] = values.pop() if len(values) == 1 else "mixed"
    return out


#: engine RequestRejected reasons answered with 429 (transient); all others get 400.
_TRANSIENT_REASONS = frozenset({"queue_full", "too_many_requests", "overloaded"})


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
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: int | str | None = None


@dataclass
class Usage:
    """Token counts of one request, filled in by :meth:`RequestGenerator.generate`.

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
    prompt_logprobs: list[PositionLogprobs | None] | None = None
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


@dataclass
class _Run:
    """One request's progress in :meth:`RequestGenerator.generate`."""

    choices: list[_Choice]
    hold: int  # characters a streamed choice holds back (longest stop string - 1)
    first_token_at: float | None = None  # clock() at the request's first token


def _note_cache_usage(usage: Usage, out: RequestOutput) -> None:
    """Copy ``out``'s prompt-side results into ``usage``: cached tokens, the cache
    report (tiers, miss explanation; the first output's) and prompt logprobs."""
    usage.cached_tokens = int(out.num_cached_tokens)
    if not usage.cache_info:
        why = getattr(out, "cache_miss", None)
        usage.cache_info = {
            "cached_tokens_by_tier": dict(
                getattr(out, "num_cached_tokens_by_tier", None) or {"device": usage.cached_tokens}
            ),
            "miss": None if why is None else why.public().to_dict(),
        }
    if out.prompt_logprobs is not None:
        usage.prompt_logprobs = out.prompt_logprobs


def _engine_prompt(req: GenerationRequest) -> PromptInput:
    """``req``'s prompt as the engine takes it (token ids, with its cache salt)."""
    if req.cache_salt is None:
        return list(req.prompt_token_ids)
    return {"prompt_token_ids": list(req.prompt_token_ids), "cache_salt": req.cache_salt}


class RequestGenerator:
    """Runs admitted requests on the engine loop and turns their outputs into text
    deltas (:meth:`generate`).

    Args:
        config: the server configuration (stop-string and streaming settings).
        tokenizer: decodes the engine's token ids.
        params_cls: the engine's ``SamplingParams`` class.
        clock: monotonic clock in seconds (the request's latency metrics).
        loop: the engine loop requests are added to and aborted on.
        metrics: the server's metrics (request series, finished-request metrics).
        degradation: degraded mode, told of each finished request.

    Owns :attr:`capped_running` (written by ``ServingState.cap_admitted``, read once
    when the request finishes) and :attr:`cancel_causes` (written by the routes that
    abort a sibling prompt, read once by the aborted request).
    """

    def __init__(
        self,
        config: ServerConfig,
        tokenizer: Tokenizer,
        params_cls: Callable[..., SamplingParams],
        clock: Callable[[], float],
        loop: EngineClient,
        metrics: ServerMetrics,
        degradation: DegradationController,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.params_cls = params_cls
        self.clock = clock
        self.loop = loop
        self.metrics = metrics
        self.degradation = degradation
        #: request id -> max_tokens lowered by degraded mode while it ran
        self.capped_running: dict[str, int] = {}
        #: request id -> why it is being aborted, when not its client leaving (e.g.
        #: ``"sibling_failed"``: another prompt of the same request failed); read once
        self.cancel_causes: dict[str, str] = {}

    # ------------------------------------------------------------ placement
    def placement_of(self, request_id: str) -> dict[str, str]:
        """Where ``request_id`` runs, taken once its ``add`` returned or raised (then it
        is final): the engine loop's ``take_placement(request_id)`` (the scaled-out
        ingress: ``{"group", "replica"}``, forgotten by the loop), ``{}`` for a local
        engine."""
        take = getattr(self.loop, "take_placement", None)
        return dict(take(request_id) or {}) if callable(take) else {}

    def _placed(self, request_id: str) -> dict[str, str]:
        placement = self.placement_of(request_id)
        holder = _PLACEMENTS.get()
        if holder is not None:
            holder.append(placement)
        return placement

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
        q, series = await self._start(req)
        run = _Run(
            [_Choice() for _ in range(req.n)], max((len(s) for s in req.stop), default=1) - 1
        )
        choices = run.choices
        done = False
        last: EngineOutput | None = None
        try:
            while not done:
                out = last = await q.get()
                if isinstance(out, EngineFailure):
                    done = True
                    series.error("out_of_memory" if out.oom else "engine_error")
                    raise self._failure_error(out)
                done = bool(out.finished)
                if done:
                    self._note_running_cap(req)
                _note_cache_usage(usage, out)
                for delta in self._output_deltas(req, out, run, usage, series):
                    yield delta
                if not done and all(c.finish is not None for c in choices):
                    await self.loop.abort(req.request_id)  # every choice hit a stop string
                    done = True
        finally:
            self.capped_running.pop(req.request_id, None)
            if not done:
                self.loop.abort_nowait(req.request_id)
                cause = self.cancel_causes.pop(req.request_id, "client_disconnect")
                series.cancellation(cause)
            else:
                self.cancel_causes.pop(req.request_id, None)
                self._finished(series, arrival, run.first_token_at, choices, last)
        for c in choices:  # choices the engine ended without a final output (defensive)
            if c.finish is None:
                c.finish = "length"
                yield Delta(choices.index(c), c.text[c.sent :], "length")

    def _output_deltas(
        self,
        req: GenerationRequest,
        out: RequestOutput,
        run: _Run,
        usage: Usage,
        series: RequestSeries,
    ) -> Iterator[Delta]:
        """The deltas of one engine output, choice by choice (lazily: a closed consumer
        stops the walk where it stood). Counts the new tokens into ``usage``, records
        the request's TTFT at its first token; a finished choice is skipped, and a
        non-streamed request yields only its choices' final deltas."""
        for comp in out.outputs:
            c = run.choices[comp.index]
            if c.finish is not None:
                continue
            usage.completion_tokens += len(comp.token_ids) - c.num_tokens
            c.num_tokens = len(comp.token_ids)
            if run.first_token_at is None and c.num_tokens > 0:
                run.first_token_at = now = self.clock()
                series.ttft.observe(now - req.arrival_s)
                self.degradation.record_ttft(now - req.arrival_s, now)
            if comp.finish_reason is None and not req.stream:
                continue  # not streamed: only the final text matters
            delta = self._choice_delta(req, out, comp, c, run.hold)
            if delta is not None:
                yield delta

    async def _start(
        self, req: GenerationRequest
    ) -> tuple[asyncio.Queue[EngineOutput], RequestSeries]:
        """Send ``req`` to the engine; return its output queue and its metric series
        (labelled with where it was placed).

        Raises:
            APIError: the engine refused it (400/429), or no replica could take it (503).
        """
        placement: dict[str, str] = {}
        try:
            params = self._sampling_params(req)
            prompt = _engine_prompt(req)
            try:
                q = await self.loop.add(
                    req.request_id,
                    prompt,
                    params,
                    arrival_time=req.arrival_s,
                    priority=req.priority,
                    # not streamed: nothing reaches the client before the end, so an
                    # ingress may run it again on another replica after a failure
                    replayable=not req.stream,
                )
            finally:
                placement = self._placed(req.request_id)
        except RequestRejected as exc:
            err = rejection_error(exc)
            self.metrics.series(placement).error("engine_rejected")
            raise err from None
        except APIError as exc:  # the ingress: no replica could take it (503)
            self.metrics.series(placement).error(exc.reason)
            raise
        return q, self.metrics.series(placement)

    def _sampling_params(self, req: GenerationRequest) -> SamplingParams:
        """The engine's sampling parameters of ``req`` (``params_cls``: the engine's
        ``SamplingParams``)."""
        return self.params_cls(
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
            **(
                {}
                if req.structured_outputs is None
                else {"structured_outputs": req.structured_outputs}
            ),
        )

    def _failure_error(self, out: EngineFailure) -> APIError:
        """The answer to an engine failure: 503 (``Retry-After``) out of memory, else 500."""
        if out.oom:
            return APIError(
                503,
                f"engine: out of memory in the step running this request ({out})",
                type="server_error",
                code="out_of_memory",
                headers={"Retry-After": str(self.config.admission.retry_after_s)},
                reason="out_of_memory",
            )
        return APIError(
            500, f"engine: step failed ({out})", type="server_error", reason="engine_error"
        )

    def _choice_delta(
        self,
        req: GenerationRequest,
        out: RequestOutput,
        comp: CompletionOutput,
        c: _Choice,
        hold: int,
    ) -> Delta | None:
        """Advance choice ``c`` to completion ``comp`` of output ``out`` (stop strings,
        finish); return the delta to send (text past what was sent, holding back ``hold``
        characters that may start a stop string), or None."""
        # Only the request's final output carries the engine's text (stop
        # strings already cut). A choice that ends before its siblings (n > 1,
        # e.g. after a preemption) arrives with finish_reason set but text ""
        # on a not-yet-finished output, so decode its token ids here (stop
        # strings are re-applied below).
        full = comp.text if out.finished else str(self.tokenizer.decode(list(comp.token_ids)))
        hit = None
        if req.stop and c.num_tokens >= req.min_tokens:
            if c.stop_floor is None:  # min_tokens: earlier text never stops
                k = req.min_tokens - 1
                c.stop_floor = len(self.tokenizer.decode(list(comp.token_ids[:k]))) if k else 0
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
        if not (end > c.sent or c.finish):
            return None
        lps = comp.logprobs[c.tok_sent :] if comp.logprobs is not None else None
        delta = Delta(
            comp.index,
            c.text[c.sent : end],
            c.finish,
            list(comp.token_ids[c.tok_sent :]),
            lps,
            c.stop_reason,
        )
        c.sent = max(c.sent, end)
        c.tok_sent = len(comp.token_ids)
        return delta

    def _note_running_cap(self, req: GenerationRequest) -> None:
        """A request capped while it ran (degraded mode, ``ServingState.cap_admitted``)
        says so: ``requested_max_tokens``/``max_tokens`` become the asked value and the
        cap, so its final chunk / body carries ``kvpage_max_tokens_capped``."""
        cap = self.capped_running.pop(req.request_id, None)
        if cap is None or cap >= req.max_tokens:
            return
        if req.requested_max_tokens is None:  # not yet counted (capped at admission)
            req.requested_max_tokens = req.max_tokens
            self.metrics.max_tokens_capped.inc()
        req.max_tokens = cap

    def _finished(
        self,
        m: RequestSeries,
        arrival: float,
        first: float | None,
        choices: list[_Choice],
        out: EngineOutput | None,
    ) -> None:
        now = self.clock()
        m.e2e.observe(now - arrival)
        longest = max((c.num_tokens for c in choices), default=0)
        if first is not None and longest > 1:
            m.tpot.observe((now - first) / (longest - 1))
        for c in choices:
            m.success(c.finish or "length")
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
