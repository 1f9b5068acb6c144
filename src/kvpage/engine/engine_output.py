"""The outputs of :class:`~kvpage.engine.engine.LLMEngine`: the engine-side state of
one user request, stop strings, and building each step's ``RequestOutput``. A base class
split from engine.py to keep modules small; the state it uses is set up by
``LLMEngine.__init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvpage.engine.params import CompletionOutput, RequestOutput, SamplingParams
from kvpage.engine.request import Request
from kvpage.engine.request_extras import stop_reason

if TYPE_CHECKING:
    from kvpage.engine.scheduler import Scheduler


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


class EngineOutputs:
    """Stop strings and outputs of :class:`~kvpage.engine.engine.LLMEngine` (see there)."""

    # state owned by LLMEngine.__init__
    scheduler: Scheduler
    tokenizer: Any
    eos_token_id: Any
    stream_text: bool

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
        # runs for every request that progressed, every step: no generators or
        # comprehensions on the common path (one sample, no logprobs, no KV tiers)
        seqs = self.scheduler.samples[preq.request_id]  # sample-index order (forks append)
        outs = []
        want_lp = preq.params.logprobs is not None
        decode_text = finished or self.stream_text
        for q in seqs:
            i = q.sample_index
            text = preq.texts.get(i)
            if text is None and decode_text:
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
        first = seqs[0]
        if len(seqs) == 1:
            preemptions = first.num_preemptions
        else:
            preemptions = 0
            for q in seqs:
                preemptions += q.num_preemptions
        by_tier: dict[str, int] = {}
        if first.num_cached_tokens >= 0:
            by_tier["device"] = 0
            for k, v in (first.num_cached_tokens_by_tier or {}).items():
                if v:
                    by_tier[k] = v
        return RequestOutput(
            request_id=preq.request_id,
            prompt=preq.prompt,
            prompt_token_ids=preq.prompt_token_ids,
            num_cached_tokens=max(0, first.num_cached_tokens),
            cache_miss=first.cache_miss,
            outputs=outs,
            finished=finished,
            arrival_time=preq.arrival_time,
            first_token_time=preq.first_token_time,
            finish_time=preq.finish_time,
            first_scheduled_time=preq.first_scheduled_time,
            num_preemptions=preemptions,
            prompt_logprobs=None if preq.prompt_logprobs is None else list(preq.prompt_logprobs),
            num_cached_tokens_by_tier=by_tier,
        )


__all__ = ["EngineOutputs"]
