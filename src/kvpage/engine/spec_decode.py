"""Speculative decoding: draft proposers and the greedy verification rule.

A step of a speculating sequence computes ``1 + d`` query positions in one forward
through the paged attention: its last known token and ``d <= k`` draft tokens. The
logits at position ``j`` (0-based) predict the token after draft ``j - 1``; drafts are
accepted left to right while each equals the target model's argmax at its position,
and the first mismatch is replaced by that argmax (at full acceptance the last row's
token is the bonus). So every step emits ``1 .. d + 1`` tokens, each the one greedy
non-speculative decoding would emit (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", the greedy case). Sampled requests use
rejection sampling instead (:func:`accept_sampled`), which keeps the distribution.

The scheduler asks its :class:`Proposer` for drafts (one batched call per step, so a
draft-model proposer can run one forward for all sequences), allocates KV slots for
them, and after the step rolls the KV cache back to the accepted length
(``KVCacheManager.truncate``); only accepted tokens are ever committed to the prefix
cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpage.engine.params import SamplingParams
from kvpage.errors import RequestRejected
from kvpage.specs.speculative import SpeculativeConfig

__all__ = [
    "NgramProposer",
    "Proposer",
    "SpecDecodeStats",
    "accept_greedy",
    "accept_sampled",
    "check_spec_request",
    "make_proposer",
]


class Proposer(Protocol):
    """Proposes draft tokens for sequences about to decode."""

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int]) -> list[list[int]]:
        """Draft tokens per sequence.

        Args:
            contexts: each sequence's token ids (prompt then generated), read only.
            limits: most drafts wanted per sequence (>= 1).

        Returns:
            Per sequence, 0 .. ``limits[i]`` draft token ids.
        """
        ...


class NgramProposer:
    """Prompt lookup (n-gram) drafts: find the sequence's last ``n`` tokens earlier in
    the sequence, longest ``n`` in ``[min_n, max_n]`` first, at its latest earlier
    occurrence, and propose the tokens that followed it (Saxena 2023, "Prompt Lookup
    Decoding"; vLLM's ``method="ngram"``). Costs O(len(context) * (max_n - min_n + 1))
    per sequence, no model.

    Args:
        k: most drafts per sequence.
        min_n / max_n: shortest / longest n-gram matched (1 <= min_n <= max_n).
    """

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose_one(self, ctx: Sequence[int], limit: int) -> list[int]:
        """Drafts of one sequence (``min(k, limit)`` at most; [] when no n-gram
        matches)."""
        want = min(self.k, limit)
        size = len(ctx)
        if want <= 0 or size <= self.min_n:
            return []
        toks = list(ctx)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = toks[size - n :]
            first = suffix[0]
            # latest occurrence starting before size - n (the suffix itself excluded)
            i = size - n - 1
            while i >= 0:
                if toks[i] == first and toks[i : i + n] == suffix:
                    return toks[i + n : i + n + want]
                i -= 1
        return []

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int]) -> list[list[int]]:
        """See :meth:`Proposer.propose`."""
        return [self.propose_one(c, m) for c, m in zip(contexts, limits)]


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of ``config.method`` (``"ngram"`` only)."""
    return NgramProposer(
        config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    )


def accept_greedy(drafts: Sequence[int], targets: Sequence[int], bonus: int) -> list[int]:
    """The tokens a verified step emits (see the module docstring).

    Args:
        drafts: the ``d`` draft ids.
        targets: the target model's argmax at positions ``0 .. d-1`` (``d`` ids).
        bonus: its token at position ``d`` (after every draft).

    Returns:
        ``drafts[:a] + [targets[a]]`` for the first mismatch ``a``, else
        ``list(drafts) + [bonus]`` (1 .. d + 1 ids).
    """
    for a, (d, t) in enumerate(zip(drafts, targets)):
        if d != t:
            return [*drafts[:a], t]
    return [*drafts, bonus]


def accept_sampled(
    drafts: Sequence[int], probs: torch.Tensor, bonus: int, generator: torch.Generator
) -> list[int]:
    """The tokens a verified step of a sampled request emits: speculative (rejection)
    sampling with a point-mass draft (Leviathan et al. 2023, Algorithm 1; Chen et al.
    2023): draft ``j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j)) =
    p_j(d_j)`` (the n-gram proposal puts all its mass on ``d_j``); at the first
    rejection the token is drawn from the residual ``max(0, p_j - q_j)``, renormalised
    (``p_j`` without ``d_j``), and the step ends; after full acceptance ``bonus`` (drawn
    from the last position's ``p``) follows. Every emitted token then has the target
    distribution.

    Args:
        drafts: the ``d`` draft ids.
        probs: ``[d, vocab]`` float CPU target probabilities at positions ``0 .. d-1``
            (``Sampler.target_probs``).
        bonus: the token sampled at position ``d``.
        generator: the sequence's generator (one or two uniforms per verified draft).

    Returns:
        1 .. d + 1 token ids.
    """
    for j, d in enumerate(drafts):
        p = probs[j]
        u = float(torch.rand((), generator=generator))
        if u < float(p[d]):
            continue
        res = p.clone()
        res[d] = 0.0
        cdf = torch.cumsum(res, dim=0)
        v = torch.rand(1, generator=generator) * cdf[-1]
        t = int(torch.searchsorted(cdf, v, right=True).clamp(max=len(p) - 1))
        if float(res[t]) <= 0.0:  # float round-off at the top of the cdf
            t = int(torch.nonzero(res).max())
        return [*drafts[:j], t]
    return [*drafts, bonus]


@dataclass
class SpecDecodeStats:
    """Counters since the engine started (vLLM's ``spec_decode`` metrics).

    Attributes:
        num_drafts: sequence-steps that verified at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: of those, accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """``num_accepted_tokens / num_draft_tokens`` (0.0 before any draft)."""
        n = self.num_draft_tokens
        return self.num_accepted_tokens / n if n else 0.0


def check_spec_request(params: SamplingParams) -> None:
    """Refuse, by field, what speculative decoding does not serve exactly: single-sample
    requests, greedy (:func:`accept_greedy`) or sampled with temperature, top-k and
    top-p (:func:`accept_sampled`); penalties, ``min_tokens`` and ``min_p`` would need
    the logits processed per draft position, logprobs and grammars per accepted token.

    Raises:
        RequestRejected: reason ``"invalid_sampling_params"``, naming the field.
    """
    bad: tuple[str, str, object] | None = None
    if params.n != 1:
        bad = ("n", "1", params.n)
    elif params.logprobs is not None:
        bad = ("logprobs", "None", params.logprobs)
    elif params.prompt_logprobs is not None:
        bad = ("prompt_logprobs", "None", params.prompt_logprobs)
    elif params.structured_outputs is not None:
        bad = ("structured_outputs", "None", "a grammar")
    elif params.presence_penalty:
        bad = ("presence_penalty", "0", params.presence_penalty)
    elif params.frequency_penalty:
        bad = ("frequency_penalty", "0", params.frequency_penalty)
    elif params.repetition_penalty != 1.0:
        bad = ("repetition_penalty", "1", params.repetition_penalty)
    elif params.min_tokens:
        bad = ("min_tokens", "0", params.min_tokens)
    elif params.min_p:
        bad = ("min_p", "0", params.min_p)
    if bad is not None:
        name, want, got = bad
        raise RequestRejected(
            f"{name}: expected {want} with speculative decoding (the engine's "
            f"speculative_config does not implement it, docs/user-guide.md), got {got!r}",
            reason="invalid_sampling_params",
        )
