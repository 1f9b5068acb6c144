"""Token sampling: greedy, temperature, top-k and top-p, seeded per sequence.

Greedy rows take ``argmax`` (lowest index on ties, as ``torch.argmax`` and HF
``generate``). Random rows are sampled by inverse CDF: the row's logits are divided by
the temperature, sorted descending, cut to the top ``k`` and to the smallest prefix
whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019), and one
uniform number from the sequence's own ``torch.Generator`` picks the token. Every
sequence owns its generator, so its samples do not depend on the batch it ran in.

Before that, rows that ask for them get the ``min_tokens`` mask and the penalties
(:func:`kvpage.engine.processing.apply_penalties`), and after the temperature,
``min_p`` drops tokens whose probability is below ``min_p`` times the best token's
(vLLM's order: penalties, temperature, min-p, top-k, top-p). Rows without any of these
take the unchanged fast path.

Rows with a ``structured_outputs`` grammar first get its token bitmask: forbidden
tokens' logits become ``-inf`` (:func:`kvpage.engine.structured.apply_token_bitmask`, on
those rows only; the logprobs then describe the masked distribution, as vLLM's). A
constrained row with no allowed token left after the mask, the penalties and the
``min_tokens`` mask is a dead end: its sampled id is :data:`DEAD_END_TOKEN`.

The one entry point is :meth:`Sampler.sample` (logits + :class:`SamplingRows`, the
batch's per-row parameters) returning :class:`SamplerOutput` (ids and, for rows that
ask, logprobs). A batch of plain greedy rows skips the per-row work (``argmax`` only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpage.attention.protocol import GreedyOps
from kvpage.engine.params import SamplingParams
from kvpage.engine.processing import RowContext, apply_penalties, compute_logprobs
from kvpage.engine.request import Request
from kvpage.engine.structured import apply_token_bitmask

#: the "token id" of a constrained row whose grammar allows no token (a dead end):
#: ``Scheduler.update`` finishes such a sequence with
#: ``kvpage.engine.structured.DEAD_END_FINISH_REASON`` instead of appending it
DEAD_END_TOKEN = -1


def derive_seed(engine_seed: int, arrival_order: int, sample_index: int) -> int:
    """Seed of a sequence whose request has no seed: a 63-bit value derived from the
    engine seed, the request's arrival order and the sample index
    (``numpy.random.SeedSequence``), so runs of one engine are reproducible."""
    ss = np.random.SeedSequence([engine_seed, arrival_order, sample_index])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def make_generator(
    params: SamplingParams, engine_seed: int, arrival_order: int, index: int
) -> torch.Generator:
    """The ``torch.Generator`` (CPU) of sample ``index``: seeded with ``params.seed +
    index`` when the request has a seed, else with :func:`derive_seed`."""
    g = torch.Generator(device="cpu")
    if params.seed is not None:
        g.manual_seed(params.seed + index)
    else:
        g.manual_seed(derive_seed(engine_seed, arrival_order, index))
    return g


@dataclass(slots=True)
class SamplingRows:
    """The per-row inputs of one step's sampling: one row per token to sample (a
    sequence that forks this step has one row per sample).

    Attributes:
        params: each row's sampling parameters.
        generators: each row's ``torch.Generator`` (None for greedy rows).
        requests: each row's sequence (read-only; its ids feed the penalties).
        sample_indices: each row's sample index within its user request.
        logit_rows: the row of the runner's logits each row samples from (forked samples
            repeat their parent's row); None when row ``i`` is logits row ``i``.
        contexts: each row's prompt/output ids for penalties and ``min_tokens``; None
            unless some row's ``params.needs_processing``.
        all_greedy: every row is plain greedy (argmax of the raw logits: no penalties,
            no logprobs, no grammar), so :meth:`Sampler.sample` takes its fast path.
        grammar_rows: the rows with a ``structured_outputs`` grammar (None = none).
        bitmask: int32 CPU ``[len(grammar_rows), ceil(vocab / 32)]``, row ``i`` the allowed
            tokens of row ``grammar_rows[i]`` (bit ``t % 32`` of word ``t // 32``).
    """

    params: list[SamplingParams] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    logit_rows: list[int] | None = None
    contexts: list[RowContext] | None = None
    all_greedy: bool = True
    grammar_rows: list[int] | None = None
    bitmask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.params)

    def by_request(self, token_ids: Sequence[int]) -> dict[str, list[int]]:
        """``{sequence id: its rows' token ids}`` (sample order), as
        ``Scheduler.update`` takes them."""
        out: dict[str, list[int]] = {}
        for req, tok in zip(self.requests, token_ids):
            got = out.get(req.request_id)
            if got is None:
                out[req.request_id] = [tok]
            else:
                got.append(tok)
        return out


#: one row's logprob entry: ``(logprob, rank, top_ids, top_logprobs)``
#: (:func:`kvpage.engine.processing.compute_logprobs`)
LogprobEntry = tuple[float, int, list[int], list[float]]


@dataclass(slots=True)
class SamplerOutput:
    """What :meth:`Sampler.sample` returns.

    Attributes:
        token_ids: one sampled id per row (:data:`DEAD_END_TOKEN` for a constrained row
            with no allowed token).
        logprobs: per row, the sampled token's logprob entry (of the raw logits, before
            penalties) when the row's ``params.logprobs`` is set, else None; the whole
            list is None when no row asks.
    """

    token_ids: list[int]
    logprobs: list[LogprobEntry | None] | None = None


def greedy_ops(backend: object, dtype: torch.dtype, device: torch.device | str) -> GreedyOps | None:
    """The attention backend's greedy argmax kernel for logits of ``dtype`` on
    ``device``: its ``layer_ops(dtype, device)`` object when that implements
    ``kvpage.attention.protocol.GreedyOps``, else None (torch ops)."""
    get = getattr(backend, "layer_ops", None)
    ops = get(dtype, torch.device(device)) if get is not None else None
    return ops if isinstance(ops, GreedyOps) else None


class Sampler:
    """Samples one token per row (see the module docstring for the method).

    Stateless: the per-sequence random state is the rows' generators.

    Args:
        greedy: a backend's argmax kernel (:func:`greedy_ops`) for all-greedy batches
            whose logits have its dtype and are on the CPU; None = ``torch`` ops.
    """

    def __init__(self, greedy: GreedyOps | None = None) -> None:
        self._greedy = greedy

    def sample(self, logits: torch.Tensor, rows: SamplingRows) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[num_logit_rows, vocab_size]`` float32, or bfloat16 as the model
                computed them (any device); not mutated. bfloat16 rows are cast to
                float32 (exactly) before any float math: only the all-greedy argmax
                reads them as they are, which gives the same ids as on the cast.
            rows: the per-row inputs (``rows.logit_rows`` maps rows to logits rows).

        Returns:
            The ``len(rows)`` token ids and, for rows that ask, their logprobs.
            All-greedy batches take ``argmax`` of the raw logits directly (the same ids
            as the general path, tested), through the backend's kernel when there is
            one for the logits' dtype.
        """
        if rows.logit_rows is not None:
            sel = torch.tensor(rows.logit_rows, dtype=torch.int64, device=logits.device)
            logits = logits.index_select(0, sel)
        if not rows.params:
            return SamplerOutput([])
        if rows.bitmask is not None and rows.grammar_rows:
            if rows.logit_rows is None:
                logits = logits.clone()  # the caller's logits are not mutated
            apply_token_bitmask(logits, rows.bitmask, rows.grammar_rows)
        if rows.all_greedy:
            g = self._greedy
            if g is not None and logits.dtype == g.dtype and logits.device.type == "cpu":
                return SamplerOutput(g.argmax_rows(logits).tolist())
            # max's indices = argmax's (first max, NaN first), 2.8x faster
            return SamplerOutput(logits.max(dim=-1).indices.tolist())
        return self._sample_general(logits.float(), rows)

    def _sample_general(self, logits: torch.Tensor, rows: SamplingRows) -> SamplerOutput:
        params = rows.params
        raw = logits
        if rows.contexts is not None:
            logits = apply_penalties(logits, params, rows.contexts)
        n = len(params)
        dead: list[int] = []
        if rows.grammar_rows and rows.bitmask is not None:
            # an empty bitmask row is a dead end; with penalties / min_tokens (contexts),
            # the masks may also have removed every token the grammar allowed
            empty = (rows.bitmask == 0).all(dim=1).tolist()
            dead = [r for r, e in zip(rows.grammar_rows, empty) if e]
            if rows.contexts is not None:
                g = torch.tensor(rows.grammar_rows, dtype=torch.int64, device=logits.device)
                best = logits.index_select(0, g).amax(dim=1).tolist()
                dead = [r for r, b in zip(rows.grammar_rows, best) if b == float("-inf")]
            if dead:  # sample something harmless; the rows' ids are replaced below
                logits = logits.clone()
                logits[dead] = 0.0
        out = [0] * n
        greedy = [i for i in range(n) if params[i].greedy]
        rand = [i for i in range(n) if not params[i].greedy]
        if len(greedy) == n:
            out = torch.argmax(logits, dim=-1).tolist()
        elif greedy:
            for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
                out[i] = int(t)
        if rand:
            gens = rows.generators
            ids = self._sample(
                logits[rand].float().cpu(), [params[i] for i in rand], [gens[i] for i in rand]
            )
            for i, t in zip(rand, ids):
                out[i] = t
        for i in dead:
            out[i] = DEAD_END_TOKEN
        return SamplerOutput(out, _logprob_rows(raw, params, out))

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        m, vocab = logits.shape
        probs, idx = Sampler.sorted_probs(logits, params)
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.empty(m, dtype=torch.float32)
        for r, g in enumerate(generators):
            u[r] = torch.rand((), generator=g)
        target = (u * cdf[:, -1]).unsqueeze(1)
        pos = torch.searchsorted(cdf, target, right=True).squeeze(1)
        # a zero-probability tail has the same cdf as the last kept token: step back to it
        pos = pos.clamp(max=vocab - 1)
        kept = (probs > 0).sum(dim=-1) - 1
        pos = torch.minimum(pos, kept)
        return idx.gather(1, pos.unsqueeze(1)).squeeze(1).tolist()

    @staticmethod
    def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution each random row samples from (temperature, min-p, top-k,
        top-p as :meth:`sample`; no penalties), in vocabulary order.

        Args:
            logits: ``[m, vocab]`` float CPU rows; params: their ``m`` (non-greedy)
                sampling parameters.

        Returns:
            ``[m, vocab]`` float32 probabilities, each row summing to 1.
        """
        probs, idx = Sampler.sorted_probs(logits, params)
        full = torch.zeros_like(probs).scatter_(1, idx, probs)
        return full / full.sum(dim=-1, keepdim=True)

    @staticmethod
    def sorted_probs(
        logits: torch.Tensor, params: Sequence[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, ids)``: each row's kept probabilities sorted descending (not
        renormalised after the top-p cut) and the token id of each entry (the module
        docstring's method, up to the uniform draw)."""
        m, vocab = logits.shape
        temps = [p.temperature for p in params]
        scaled = logits / torch.tensor(temps, dtype=torch.float32)[:, None]
        bad = ~torch.isfinite(scaled).all(dim=1)
        if bool(bad.any()):
            # a tiny temperature overflows float32 (or underflows to 0): divide the
            # max-shifted logits in float64 instead, so the best token gets 0 and the
            # others -inf or a finite negative value (the limit is greedy, not noise)
            rows = bad.nonzero().squeeze(1)
            sub = logits.index_select(0, rows).double()
            sub = sub - sub.max(dim=1, keepdim=True).values
            t64 = torch.tensor(temps, dtype=torch.float64).index_select(0, rows)
            scaled[rows] = (sub / t64[:, None]).float()
        min_p = [p.min_p for p in params]
        if any(min_p):
            # min-p (vLLM): drop tokens with prob < min_p * max prob, after temperature
            pr = torch.softmax(scaled, dim=-1)
            thr = pr.max(dim=-1, keepdim=True).values * torch.tensor(min_p)[:, None]
            scaled = scaled.masked_fill(pr < thr, float("-inf"))
        vals, idx = torch.sort(scaled, dim=-1, descending=True)
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
        ranks = torch.arange(vocab)[None, :]
        vals = vals.masked_fill(ranks >= ks[:, None], float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        probs = probs.masked_fill(before >= top_p[:, None], 0.0)
        probs[:, 0] = torch.where(probs[:, 0] > 0, probs[:, 0], torch.ones(m))
        return probs, idx


def _logprob_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[LogprobEntry | None] | None:
    """The logprob entries of the rows whose params ask for logprobs (None if none do)."""
    idx = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] >= 0]
    if not idx:
        return None
    sub = logits[idx] if len(idx) != len(params) else logits
    ents = compute_logprobs(sub, [tokens[i] for i in idx], [params[i].logprobs or 0 for i in idx])
    out: list[LogprobEntry | None] = [None] * len(params)
    for i, ent in zip(idx, ents):
        out[i] = ent
    return out


__all__ = [
    "greedy_ops",
    "DEAD_END_TOKEN",
    "LogprobEntry",
    "Sampler",
    "SamplerOutput",
    "SamplingRows",
    "derive_seed",
    "make_generator",
]
