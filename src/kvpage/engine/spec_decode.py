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

How many drafts a sequence gets is :class:`DraftPolicy`'s: ``disable_by_batch_size``
(vLLM's key) turns drafting off above a batch size, and the ``"adaptive"`` policy sets
each sequence's draft length from its acceptance and turns drafting off at batch sizes
where steps with drafts measured slower per emitted token than steps without.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvpage.engine.params import SamplingParams
from kvpage.errors import RequestRejected
from kvpage.specs.speculative import SpeculativeConfig

__all__ = [
    "DraftPolicy",
    "NgramProposer",
    "Proposer",
    "SpecDecodeStats",
    "accept_greedy",
    "accept_sampled",
    "check_spec_request",
    "make_draft_policy",
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


def make_draft_policy(config: SpeculativeConfig) -> DraftPolicy:
    """The :class:`DraftPolicy` of ``config`` (``disable_by_batch_size``,
    ``draft_policy``)."""
    return DraftPolicy(
        config.num_speculative_tokens,
        config.disable_by_batch_size,
        config.draft_policy == "adaptive",
    )


@dataclass
class _Arm:
    """Measured cost of one mode at one batch-size bucket: a winsorised exponential
    moving average of step seconds per emitted token over pure decode steps, seeded by
    the second (the first runs new shapes: kernel set-up, first-touch memory). Each
    later observation is capped at :data:`_CAP` times the current estimate, so one step
    stalled by another process on a shared machine moves it by at most
    ``weight * (_CAP - 1)`` of itself. ``steps``: how many steps it has seen."""

    cost: float = 0.0
    steps: int = 0

    def observe(self, sec_per_token: float, weight: float) -> None:
        if self.steps <= 1:  # the first step of a mode is not counted (first-run shapes)
            self.cost = sec_per_token
        else:
            x = min(sec_per_token, _CAP * self.cost)
            self.cost += weight * (x - self.cost)
        self.steps += 1


#: the winsorising cap of :class:`_Arm` observations (times the current estimate)
_CAP = 1.5


#: the adaptive policy's modes, in warm-up order: ``"full"`` drafts up to k per
#: sequence, ``"short"`` up to the sequence's own draft length, ``"off"`` none
MODES: tuple[str, ...] = ("full", "short", "off")


@dataclass
class _Bucket:
    """The arms (one per mode of :data:`MODES`) of one batch-size bucket, its decision
    counter and the next probe's index."""

    arms: dict[str, _Arm] = field(default_factory=lambda: {m: _Arm() for m in MODES})
    decisions: int = 0
    probes: int = 0


class DraftPolicy:
    """How many drafts each decoding sequence gets in a step.

    Rules, applied in order each step (``batch`` = the running sequences):

    1. ``batch > disable_by_batch_size``: no drafts (vLLM's ``disable_by_batch_size``).
    2. ``"fixed"``: every sequence gets up to ``k`` drafts (vLLM's behaviour).
    3. ``"adaptive"``, per batch-size bucket ``b = batch.bit_length()`` (1, 2-3, 4-7,
       8-15, ...): three modes compete, ``"full"`` (up to ``k`` drafts per sequence),
       ``"short"`` (up to the sequence's own length ``k_r``, rule 4) and ``"off"``
       (none). The policy keeps per mode an exponential moving average (weight
       :attr:`EMA_WEIGHT`; each observation capped at 1.5 times the estimate, so a
       step stalled by another process barely moves it) of the step's wall seconds per
       emitted token (process CPU seconds on a CPU device, ``LLMEngine._observe_policy``;
       the first step of each mode is not counted) over steps that only decode (a prefill chunk in the step makes it incomparable, so it is not
       recorded). Each mode is first run for :attr:`WARMUP_STEPS` steps (in
       :data:`MODES` order); then the step takes the mode of least cost, except that
       every :attr:`PROBE_EVERY`-th decision of a bucket takes one of the other two
       (alternately), so every estimate follows the load. Exploration costs at most
       1 / PROBE_EVERY of the steps at a worse mode's rate. Why measure: whether a
       draft row pays depends on whether the step is bound by its fixed cost and
       weight reads (small batch: extra query rows are nearly free) or by compute
       (large batch: every row costs), which differs by model, machine and load.
    4. per sequence, ``k_r`` starts at ``k``; after a verification that accepted every
       draft it grows by 2 (to at most ``k``), after one that rejected any it shrinks
       by 1 (to at least 1): the "heuristic" schedule of Hugging Face transformers'
       assisted generation (``num_assistant_tokens_schedule``); the rows past a
       sequence's first rejection are the wasted compute.

    Greedy outputs and the sampled distribution do not depend on the policy (it only
    changes which drafts are verified). State: the buckets' arms, the current mode and
    ``k_r`` per sequence id (pruned to the live ids by :meth:`prune`).

    Args:
        k: ``num_speculative_tokens`` (>= 1).
        disable_by_batch_size: rule 1's limit (None = none).
        adaptive: rules 3 and 4 on (``draft_policy="adaptive"``).
    """

    EMA_WEIGHT = 0.2
    WARMUP_STEPS = 3
    PROBE_EVERY = 16

    def __init__(self, k: int, disable_by_batch_size: int | None, adaptive: bool) -> None:
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self.buckets: dict[int, _Bucket] = {}
        self.draft_len: dict[str, int] = {}
        #: the mode of the current step (``"full"`` under the fixed policy)
        self.mode = "full"
        #: the bucket of the last :meth:`drafting` decision, for :meth:`observe_step`
        self._last: int | None = None

    def drafting(self, batch: int) -> bool:
        """Whether this step drafts at all, with ``batch`` running sequences (rules
        1-3); sets :attr:`mode` and remembers the decision for :meth:`observe_step`."""
        self._last = None
        self.mode = "full"
        if batch < 1:
            return False
        if self.disable_by_batch_size is not None and batch > self.disable_by_batch_size:
            return False
        if not self.adaptive:
            return True
        b = batch.bit_length()
        bk = self.buckets.get(b)
        if bk is None:
            bk = self.buckets[b] = _Bucket()
        arms = bk.arms
        mode = next((m for m in MODES if arms[m].steps < self.WARMUP_STEPS), None)
        if mode is None:
            bk.decisions += 1
            mode = min(MODES, key=lambda m: arms[m].cost)
            if bk.decisions % self.PROBE_EVERY == 0:
                others = [m for m in MODES if m != mode]
                mode = others[bk.probes % len(others)]
                bk.probes += 1
        self.mode = mode
        self._last = b
        return mode != "off"

    def limit(self, request_id: str) -> int:
        """Most drafts sequence ``request_id`` gets in this drafting step (``k``, or
        its ``k_r`` in mode ``"short"``)."""
        if self.mode != "short":
            return self.k
        return self.draft_len.get(request_id, self.k)

    def observe_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Rule 4's update after a verification of ``num_drafts`` drafts of which the
        first ``num_accepted`` were accepted."""
        if not self.adaptive or num_drafts < 1:
            return
        cur = self.draft_len.get(request_id, self.k)
        if num_accepted >= num_drafts:
            self.draft_len[request_id] = min(self.k, cur + 2)
        else:
            self.draft_len[request_id] = max(1, cur - 1)

    def observe_step(self, seconds: float, num_emitted: int, pure_decode: bool) -> None:
        """Rule 3's measurement of the step decided by the last :meth:`drafting` call:
        ``seconds`` of wall time that emitted ``num_emitted`` tokens; recorded only when
        ``pure_decode`` (no prefill chunk ran in it)."""
        b, self._last = self._last, None
        if b is None or not pure_decode or num_emitted < 1:
            return
        self.buckets[b].arms[self.mode].observe(seconds / num_emitted, self.EMA_WEIGHT)

    def prune(self, live: Iterable[str]) -> None:
        """Forget the draft lengths of sequences not in ``live``."""
        keep = set(live)
        self.draft_len = {r: v for r, v in self.draft_len.items() if r in keep}


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
    """Refuse, by field, what speculative decoding does not serve exactly. Served:
    greedy (:func:`accept_greedy`) and sampled with temperature, top-k and top-p
    (:func:`accept_sampled`), ``n > 1`` (each sample speculates on its own after the
    fork), ``logprobs`` (each emitted token scored on its verification row) and
    ``prompt_logprobs`` (prefill only). Refused: penalties, ``min_tokens`` and
    ``min_p`` (the logits would need processing per draft position with the context
    up to it: each draft position's penalties see the drafts before it, which
    ``Sampler.target_probs`` does not model) and grammars (the matcher would need to
    advance through the drafts and roll back on rejection).

    Raises:
        RequestRejected: reason ``"invalid_sampling_params"``, naming the field.
    """
    bad: tuple[str, str, object] | None = None
    if params.structured_outputs is not None:
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
