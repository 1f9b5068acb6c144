"""The engine's request table and output stage (:class:`OutputProcessor`): the
engine-side state of each user request (:class:`ParentRequest`), the sampling rows of
a step, logprobs, stop strings, and building each step's ``RequestOutput``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvpage.engine.params import (
    CompletionOutput,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
)
from kvpage.engine.processing import position_logprobs
from kvpage.engine.request import Request
from kvpage.engine.request_extras import (
    record_prompt_logprobs,
    row_context,
    stop_reason,
)
from kvpage.engine.sampler import LogprobEntry, SamplerOutput, SamplingRows, make_generator
from kvpage.engine.structured import (
    DEAD_END_FINISH_REASON,
    GrammarCompilerPool,
    GrammarState,
    bitmask_words,
)

if TYPE_CHECKING:
    from kvpage.engine.scheduler import Scheduler, SchedulerOutput

__all__ = ["OutputProcessor", "ParentRequest", "RequestCounters"]


@dataclass
class ParentRequest:
    """Engine-side state of one user request (its samples are the scheduler's)."""

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
    logprobs: dict[int, list[PositionLogprobs]] = field(default_factory=dict)
    cumulative: dict[int, float] = field(default_factory=dict)
    #: per prompt position (params.prompt_logprobs); position 0 stays None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stop_reasons: dict[int, int | str] = field(default_factory=dict)
    #: the compiled ``structured_outputs`` grammar (an ``xgrammar.CompiledGrammar``;
    #: None = unconstrained or not compiled yet)
    grammar: Any = None
    #: per sample index: its grammar matcher (created at its first sampled token; kept
    #: across preemption, since the generated tokens it accepted stay)
    grammar_states: dict[int, GrammarState] = field(default_factory=dict)


@dataclass
class RequestCounters:
    """Counters since the engine started (the ``*_total`` engine metrics)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    rejected: int = 0


class OutputProcessor:
    """Owns the unfinished user requests' engine-side state and turns a step's
    progress into ``RequestOutput``s.

    Args:
        scheduler: the engine's scheduler (read for the samples; ``finish`` and
            ``release`` are called on it).
        tokenizer: decodes text, stop strings and logprob tokens (None = no text).
        seed: the engine seed (generators of requests without a seed).

    Attributes:
        counters: prompt/generation tokens and rejected requests since the start.
        stream_text: when True, unfinished outputs carry decoded text too (costs a
            decode per token); finished outputs always do.
        grammars: the engine's grammar compiler pool (matcher states are made with it);
            None until a constrained request arrives.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Any, seed: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.seed = seed
        self.stream_text = False
        self.counters = RequestCounters()
        self._parents: dict[str, ParentRequest] = {}
        #: unfinished requests with prompt_logprobs (0: steps skip looking for them)
        self._num_prompt_lp = 0
        self.grammars: GrammarCompilerPool | None = None

    # ---- the request table ------------------------------------------------------------
    def add(self, preq: ParentRequest) -> None:
        """Track a queued user request (its id must be new)."""
        if preq.params.prompt_logprobs is not None:
            preq.prompt_logprobs = [None] * len(preq.prompt_token_ids)
            self._num_prompt_lp += 1
        self._parents[preq.request_id] = preq
        self.counters.prompt_tokens += len(preq.prompt_token_ids)

    def forget(self, parent_id: str) -> None:
        """Drop a user request's state (finished, aborted or failed); unknown ids are
        ignored."""
        preq = self._parents.pop(parent_id, None)
        if preq is not None and preq.prompt_logprobs is not None:
            self._num_prompt_lp -= 1

    def parent(self, parent_id: str) -> ParentRequest:
        """The engine-side state of an unfinished user request (KeyError if unknown)."""
        return self._parents[parent_id]

    def __contains__(self, parent_id: object) -> bool:
        return parent_id in self._parents

    def __len__(self) -> int:
        return len(self._parents)

    def __iter__(self) -> Iterator[str]:
        return iter(self._parents)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True when some unfinished request asked for prompt logprobs."""
        return self._num_prompt_lp > 0

    # ---- the sampling inputs ----------------------------------------------------------
    def sampling_rows(self, out: SchedulerOutput, now: float) -> SamplingRows:
        """The rows to sample for plan ``out`` (one per scheduled sequence that samples,
        ``n`` for one that forks now); stamps ``first_scheduled_time`` (``now``,
        monotonic seconds) on requests scheduled for the first time."""
        parents = self._parents
        rows = SamplingRows()
        logit_rows: list[int] = []
        processing = False
        states: list[GrammarState] = []
        grammar_rows: list[int] = []
        r = 0
        for s in out.scheduled:
            req = s.request
            preq = parents[req.parent_id]
            if preq.first_scheduled_time is None:
                preq.first_scheduled_time = now
            if not s.samples:
                continue
            p = preq.params
            if not p.plain or p.temperature != 0.0:
                rows.all_greedy = False
                processing = processing or p.needs_processing
            for j in range(1 + req.num_pending_samples):
                index = j or req.sample_index
                if preq.grammar is not None:
                    grammar_rows.append(len(rows.params))
                    states.append(self._grammar_state(preq, index))
                logit_rows.append(r)
                rows.params.append(p)
                rows.generators.append(None if p.greedy else self._generator(preq, index))
                rows.requests.append(req)
                rows.sample_indices.append(index)
            r += 1
        if len(logit_rows) != r:
            rows.logit_rows = logit_rows
        if processing:
            rows.contexts = [row_context(q) for q in rows.requests]
        if states:
            rows.grammar_rows = grammar_rows
            rows.bitmask = _grammar_bitmask(states)
        return rows

    def _grammar_state(self, preq: ParentRequest, index: int) -> GrammarState:
        st = preq.grammar_states.get(index)
        if st is None:
            assert self.grammars is not None  # set before a grammar is compiled
            st = self.grammars.new_state(preq.grammar)
            preq.grammar_states[index] = st
        return st

    def generator(self, parent_id: str, index: int) -> torch.Generator | None:
        """The generator of sample ``index`` of user request ``parent_id`` (made on
        first use; the one its sampled rows draw from)."""
        return self._generator(self._parents[parent_id], index)

    def _generator(self, preq: ParentRequest, index: int) -> torch.Generator | None:
        g = preq.generators.get(index)
        if g is None:
            g = make_generator(preq.params, self.seed, preq.arrival_order, index)
            preq.generators[index] = g
        return g

    # ---- logprobs ---------------------------------------------------------------------
    def record_prompt_logprobs(
        self, out: SchedulerOutput, spans: list[tuple[int, int, int]], logits: torch.Tensor
    ) -> None:
        """Fill prompt logprobs from the span rows of ``logits``
        (:func:`kvpage.engine.request_extras.record_prompt_logprobs`)."""
        record_prompt_logprobs(self._parents, out, spans, logits, self.tokenizer)

    def record_logprobs(
        self, rows: SamplingRows, res: SamplerOutput, defer: frozenset[str] = frozenset()
    ) -> dict[str, LogprobEntry]:
        """Append the sampled tokens' logprobs of the rows that asked for them, except
        rows of the sequence ids in ``defer`` (speculating sequences: their sampled
        token is the bonus after the drafts, which verification may drop), whose entries
        are returned by sequence id instead (for :meth:`record_sequence_logprobs`)."""
        held: dict[str, LogprobEntry] = {}
        if res.logprobs is None:
            return held
        for req, index, tok, ent in zip(
            rows.requests, rows.sample_indices, res.token_ids, res.logprobs
        ):
            if ent is None:
                continue
            if req.request_id in defer:
                held[req.request_id] = ent
                continue
            self._append_logprob(req.parent_id, index, tok, ent)
        return held

    def record_sequence_logprobs(
        self, seq: Request, token_ids: list[int], entries: list[LogprobEntry]
    ) -> None:
        """Append the logprobs of the first ``seq.num_new_tokens`` of ``token_ids`` (the
        tokens a speculative step emitted that the scheduler appended; ``entries`` one
        per emitted token, from the verification rows and the bonus row)."""
        for tok, ent in zip(token_ids[: seq.num_new_tokens], entries):
            self._append_logprob(seq.parent_id, seq.sample_index, tok, ent)

    def _append_logprob(self, parent_id: str, index: int, tok: int, ent: LogprobEntry) -> None:
        preq = self._parents[parent_id]
        preq.logprobs.setdefault(index, []).append(position_logprobs(tok, ent, self.tokenizer))
        preq.cumulative[index] = preq.cumulative.get(index, 0.0) + ent[0]

    # ---- outputs ----------------------------------------------------------------------
    def emit(
        self, progressed: list[Request], now: float, finished_only: bool
    ) -> list[RequestOutput]:
        """Apply stop strings to the sequences that got a token and build one output per
        user request among them (finished ones are released from the scheduler and
        forgotten). ``finished_only`` skips the outputs of unfinished requests."""
        touched = self._progress(progressed, now)
        n = 0
        for seq in progressed:
            n += seq.num_new_tokens
        self.counters.generation_tokens += n
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
                self.forget(pid)
        return results

    def _progress(self, progressed: list[Request], now: float) -> dict[str, ParentRequest]:
        """First-token times and stop strings of the progressed sequences; returns their
        user requests (first-progress order)."""
        parents = self._parents
        touched: dict[str, ParentRequest] = {}
        for seq in progressed:
            preq = parents[seq.parent_id]
            touched[seq.parent_id] = preq
            if preq.first_token_time is None:
                preq.first_token_time = now
            if preq.grammar is not None:
                self._advance_grammar(seq, preq)
            p = preq.params
            if p.stop and not seq.is_finished and seq.num_output_tokens >= p.min_tokens:
                self._check_stop_strings(seq, preq)
        return touched

    def _advance_grammar(self, seq: Request, preq: ParentRequest) -> None:
        """Feed the sequence's new token to its grammar matcher; a grammar that reached
        its end finishes the sequence with "stop"."""
        if seq.finish_reason == DEAD_END_FINISH_REASON:
            return  # nothing was appended
        st = preq.grammar_states[seq.sample_index]
        if not st.accept(seq.token_ids[-1]):
            # the mask allowed it, so only a grammar/vocabulary mismatch gets here
            self.scheduler.finish(seq, DEAD_END_FINISH_REASON)
        elif st.is_terminated and not seq.is_finished:
            self.scheduler.finish(seq, "stop")

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids))

    def _check_stop_strings(self, seq: Request, preq: ParentRequest) -> None:
        out = seq.output_token_ids
        m = seq.num_new_tokens
        if m <= 1:
            self._stop_at(seq, preq, out)
            return
        # several tokens this step (speculative decoding): stop at the first one that
        # completes a stop string, as one-token steps would, and drop those after it
        for cut in range(len(out) - m + 1, len(out) + 1):
            if self._stop_at(seq, preq, out[:cut]):
                del seq.token_ids[seq.num_prompt_tokens + cut :]
                seq.num_new_tokens -= len(out) - cut
                return

    def _stop_at(self, seq: Request, preq: ParentRequest, out: list[int]) -> bool:
        """Finish ``seq`` with "stop" if output ids ``out`` contain a stop string
        (after ``min_tokens``); True if so."""
        text = self._decode(out)
        mt = preq.params.min_tokens
        # with min_tokens, a stop string must end in the min_tokens-th token or later
        floor = len(self._decode(out[: mt - 1])) if mt > 1 else 0
        for stop in preq.params.stop or ():
            k = text.find(stop, max(0, floor - len(stop) + 1))
            if k >= 0:
                keep = k + len(stop) if preq.params.include_stop_str_in_output else k
                preq.texts[seq.sample_index] = text[:keep]
                preq.stop_reasons[seq.sample_index] = stop
                self.scheduler.finish(seq, "stop")
                return True
        return False

    def _make_output(self, preq: ParentRequest, finished: bool) -> RequestOutput:
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
                    stop_reason=stop_reason(preq, q) if reason == "stop" else None,
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


def _grammar_bitmask(states: list[GrammarState]) -> torch.Tensor:
    """The allowed-token bitmask of the constrained rows, ``[len(states),
    bitmask_words(vocab_size)]`` int32 (row ``i`` filled by ``states[i]``)."""
    width = bitmask_words(states[0].vocab_size)
    bitmask = torch.full((len(states), width), -1, dtype=torch.int32)
    for i, st in enumerate(states):
        st.fill_bitmask(bitmask, i)
    return bitmask
