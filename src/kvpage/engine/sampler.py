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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvpage.engine.params import SamplingParams
from kvpage.engine.processing import RowContext, apply_penalties


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


class Sampler:
    """Samples one token per logits row."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        contexts: Sequence[RowContext] | None = None,
    ) -> list[int]:
        """Sample.

        Args:
            logits: ``[num_rows, vocab_size]`` float (any device); not mutated.
            params: the sampling parameters of each row.
            generators: each row's generator (None allowed for greedy rows).
            contexts: each row's prompt/output ids, required when a row's
                ``params.needs_processing`` (penalties, min_tokens).

        Returns:
            ``num_rows`` token ids.
        """
        n = int(logits.shape[0])
        out = [0] * n
        if n == 0:
            return out
        if contexts is not None:
            logits = apply_penalties(logits, params, contexts)
        greedy = [i for i in range(n) if params[i].greedy]
        rand = [i for i in range(n) if not params[i].greedy]
        if greedy:
            if len(greedy) == n:
                return torch.argmax(logits, dim=-1).tolist()
            ids = torch.argmax(logits[greedy], dim=-1).tolist()
            for i, t in zip(greedy, ids):
                out[i] = int(t)
        if rand:
            ids = self._sample(
                logits[rand].float().cpu(), [params[i] for i in rand], [generators[i] for i in rand]
            )
            for i, t in zip(rand, ids):
                out[i] = t
        return out

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
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


__all__ = ["Sampler", "derive_seed", "make_generator"]
