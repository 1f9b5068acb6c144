"""Delta encoding of ``RequestOutput`` between the engine process and the server.

An engine ``RequestOutput`` is cumulative: every step repeats the prompt's token ids and
every token generated so far. Sent as is, a step of 64 streams with 128-token prompts
is ~36 KB of pickle (2 ms to dump, 3 ms to load on a loaded 2-core machine), a cost
that grows with the output length. :class:`OutputEncoder` (engine process) sends each
request's prompt token ids once and, per sample, only the token ids and logprobs that
are new since its previous output; :class:`OutputDecoder` (server) rebuilds the same
cumulative ``RequestOutput`` the engine made (fresh lists, so an output already handed
out never changes). Every other field travels unchanged. Anything that is not a
``RequestOutput`` (an ``EngineFailure``) passes through and ends the request's state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from kvpage.engine.params import CompletionOutput, PositionLogprobs, RequestOutput
from kvpage.server.engine_client import EngineFailure, EngineOutput

__all__ = ["OutputDecoder", "OutputEncoder", "WireOutput"]


#: field order of the wire tuples (the dataclasses' own order, all init fields)
_RO = tuple(f.name for f in dataclasses.fields(RequestOutput))
_CO = tuple(f.name for f in dataclasses.fields(CompletionOutput))
_RO_PROMPT, _RO_OUTPUTS = _RO.index("prompt_token_ids"), _RO.index("outputs")
_CO_TOKENS, _CO_LOGPROBS = _CO.index("token_ids"), _CO.index("logprobs")
_CO_INDEX = _CO.index("index")


@dataclasses.dataclass(frozen=True)
class _Delta:
    #: RequestOutput's field values in order (of several types: a dataclass's fields by
    #: position); prompt_token_ids empty after the first, outputs as tuples of
    #: CompletionOutput's field values holding only new items
    values: tuple[Any, ...]
    first: bool


#: what travels for one output: a delta, or the failure that ends the request
WireOutput = _Delta | EngineFailure


class OutputEncoder:
    """Engine-process side: what of each output is new (state per unfinished request)."""

    def __init__(self) -> None:
        #: request id -> {sample index: (token ids sent, logprobs sent)}
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}

    def encode(self, item: EngineOutput) -> WireOutput:
        """The wire form of ``item`` (a RequestOutput; a failure is returned as is)."""
        if not isinstance(item, RequestOutput):
            return item
        rid = item.request_id
        first = rid not in self._sent
        counts = self._sent.setdefault(rid, {})
        comps = []
        for c in item.outputs:
            nt, nl = counts.get(c.index, (0, 0))
            cv = [getattr(c, n) for n in _CO]
            lp = c.logprobs
            cv[_CO_TOKENS] = c.token_ids[nt:]
            cv[_CO_LOGPROBS] = None if lp is None else lp[nl:]
            comps.append(tuple(cv))
            counts[c.index] = (len(c.token_ids), 0 if lp is None else len(lp))
        if item.finished:
            del self._sent[rid]
        v = [getattr(item, n) for n in _RO]
        v[_RO_PROMPT] = item.prompt_token_ids if first else []
        v[_RO_OUTPUTS] = comps
        return _Delta(tuple(v), first)

    def __len__(self) -> int:
        return len(self._sent)

    def prune(self, live: Collection[str]) -> None:
        """Forget requests no longer in ``live`` (aborted, failed)."""
        for rid in [r for r in self._sent if r not in live]:
            del self._sent[rid]


class OutputDecoder:
    """Server side: rebuilds cumulative outputs from :class:`OutputEncoder`'s deltas."""

    def __init__(self) -> None:
        #: request id -> (prompt token ids, {sample index: (token ids, logprobs | None)})
        self._acc: dict[
            str, tuple[list[int], dict[int, tuple[list[int], list[PositionLogprobs] | None]]]
        ] = {}

    def decode(self, request_id: str, item: WireOutput) -> EngineOutput:
        """The engine's ``RequestOutput`` (or ``item`` itself when it is a failure).

        Raises:
            KeyError: a non-first delta of a request this decoder has no state for
                (the caller :meth:`forget` it while deltas were in flight).
        """
        if not isinstance(item, _Delta):
            self._acc.pop(request_id, None)
            return item
        v = list(item.values)
        if item.first:
            self._acc[request_id] = (list(v[_RO_PROMPT]), {})
        prompt, samples = self._acc[request_id]
        comps = []
        for cv in v[_RO_OUTPUTS]:
            c = list(cv)
            index = c[_CO_INDEX]
            toks, lps = samples.get(index, ([], None))
            toks = toks + c[_CO_TOKENS]
            if c[_CO_LOGPROBS] is not None:
                lps = (lps or []) + c[_CO_LOGPROBS]
            samples[index] = (toks, lps)
            c[_CO_TOKENS], c[_CO_LOGPROBS] = toks, lps
            comps.append(CompletionOutput(*c))
        out = RequestOutput(*v)
        out.prompt_token_ids, out.outputs = list(prompt), comps
        if out.finished:
            del self._acc[request_id]
        return out

    def forget(self, request_id: str) -> None:
        """Drop a request's state (its handler went away)."""
        self._acc.pop(request_id, None)
