"""Workload side of capacity planning: length samples and what a pool of blocks holds.

Used by :func:`kvpage.capacity.plan_capacity`; re-exported there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpage.errors import SpecError
from kvpage.specs import CacheSpec
from kvpage.stats import summarize


def _p50_p95_p99(values: np.ndarray) -> list[float]:
    """``[p50, p95, p99]`` of ``values`` (kvpage.stats.summarize), rounded to 0.1."""
    s = summarize(values)
    return [round(s[k], 1) for k in ("p50", "p95", "p99")]


def blocks_per_sequence(spec: CacheSpec, seq_len: np.ndarray | int) -> np.ndarray:
    """Blocks one sequence of ``seq_len`` tokens holds in the pool during its decode
    (``CacheSpec.sequence_blocks``: a unified pool sums its KV groups, per-group pools
    take the most demanding group; a sliding group of window W holds only the blocks
    from ``max(0, L - W) // block_size`` on)."""
    L = np.asarray(seq_len, dtype=np.int64)
    return np.asarray(spec.sequence_blocks(L), dtype=np.int64)


def max_sequence_tokens(spec: CacheSpec, blocks: int) -> int | None:
    """Tokens that fit: the longest sequence whose decode never holds more than
    ``blocks`` blocks (:func:`blocks_per_sequence` at every length up to it; a sliding
    group's count oscillates within a block, so the running maximum is what counts).
    Only full-attention groups: ``(blocks // num_groups) * block_size`` (per-group
    pools: ``blocks * block_size``). None when no full-attention group exists and the
    sliding groups' most never exceeds ``blocks`` (any length fits).
    """
    bs = spec.block_size
    groups = spec.kv_groups
    nfull = sum(1 for g in groups if g.sliding_window is None)
    per_pool = spec.kv_pool == "unified"
    if nfull == len(groups):
        return (blocks // len(groups) if per_pool else blocks) * bs
    wmax = max(g.sliding_window or 0 for g in groups)
    # past the largest window + a block the count only grows (full groups) or repeats
    # with period block_size (sliding ones): scan up to there, or to the full bound
    hi = wmax + 2 * bs if nfull == 0 else ((blocks // nfull if per_pool else blocks) + 1) * bs
    lens = np.arange(1, hi + 1, dtype=np.int64)
    run = np.maximum.accumulate(blocks_per_sequence(spec, lens))
    over = np.nonzero(run > blocks)[0]
    if len(over) == 0:
        return None if nfull == 0 else int(hi)
    return int(over[0])  # lens[i] = i + 1 is the first too long: i tokens fit


@dataclass
class Workload:
    """Prompt and output lengths (tokens) of a workload, as samples.

    Built from a trace (:meth:`from_trace`) or from percentiles (:meth:`from_percentiles`).
    """

    prompt: np.ndarray
    output: np.ndarray
    source: str = ""

    @classmethod
    def from_trace(cls, trace: Any) -> Workload:
        """From a ``kvpage.workload.traces.Trace``."""
        return cls(trace.prompt_lens(), trace.output_lens(), f"trace {trace.name}")

    @classmethod
    def from_percentiles(
        cls, prompt: tuple[float, float, float], output: tuple[float, float, float], n: int = 2000
    ) -> Workload:
        """From (p50, p95, p99) of prompt and output lengths.

        The quantile function is a lognormal fitted to p50 and p95
        (``sigma = ln(p95/p50) / 1.6449``) up to the 95th percentile, linear from p95 to
        p99, and constant (= p99) above: ``n`` samples at levels ``(i + 0.5) / n``. The
        truncation at p99 understates the extreme tail; pass a trace when you have one.

        Raises:
            SpecError: percentiles not finite, positive and non-decreasing.
        """
        return cls(_quantile_samples(prompt, n), _quantile_samples(output, n), "percentiles")


def _quantile_samples(p: tuple[float, float, float], n: int) -> np.ndarray:
    p50, p95, p99 = (float(x) for x in p)
    if not (0 < p50 <= p95 <= p99 and math.isfinite(p99)):
        raise SpecError(f"percentiles: expected finite 0 < p50 <= p95 <= p99, got {p}")
    from statistics import NormalDist

    u = (np.arange(n) + 0.5) / n
    sigma = math.log(p95 / p50) / NormalDist().inv_cdf(0.95)
    z = np.array([NormalDist().inv_cdf(float(x)) for x in u])
    out = p50 * np.exp(sigma * z)
    hi = u > 0.95
    out[hi] = p95 + (np.minimum(u[hi], 0.99) - 0.95) / 0.04 * (p99 - p95)
    return np.maximum(np.rint(out), 1).astype(np.int64)


def analyze_workload(
    spec: CacheSpec,
    usable_blocks: int,
    wl: Workload,
    max_model_len: int,
    num_seqs: int | None = None,
) -> dict[str, Any]:
    """Workload answers for a pool of ``usable_blocks`` (see :func:`plan_capacity`).

    A sequence with prompt P and output O holds ``blocks(P + t)`` blocks at decode step
    t = 0..O (``blocks_per_sequence``); its time-averaged footprint is the mean over t.
    Padding is ``blocks * block_size - live tokens`` for full-attention groups.
    """
    bs = spec.block_size
    plen, olen = wl.prompt.astype(np.int64), np.maximum(wl.output.astype(np.int64), 1)
    n = len(plen)
    if n == 0:
        raise SpecError("workload: expected at least one request, got 0")
    # time average over t = 0..olen-1 of blocks(plen + t + 1), vectorised by sampling 16 points
    steps = np.linspace(0.0, 1.0, 17)[None, :]
    lens = plen[:, None] + np.maximum(1, np.rint(steps * olen[:, None])).astype(np.int64)
    held_blocks = blocks_per_sequence(spec, lens).astype(np.float64)
    live = np.minimum(lens, held_blocks * bs)
    avg_blocks = held_blocks.mean(axis=1)
    pad_slots = (held_blocks * bs - live).mean(axis=1)
    final_blocks = blocks_per_sequence(spec, plen + olen).astype(np.float64)
    mml = int(max_model_len) if max_model_len else int((plen + olen).max())
    bpb = spec.bytes_per_block
    out: dict[str, Any] = {
        "source": wl.source,
        "requests": n,
        "prompt_p50_p95_p99": _p50_p95_p99(plen),
        "output_p50_p95_p99": _p50_p95_p99(olen),
        "concurrent_seqs_paged_avg": float(usable_blocks / avg_blocks.mean()),
        "concurrent_seqs_paged_final_len": float(usable_blocks / final_blocks.mean()),
        "concurrent_seqs_contiguous_max_model_len": int(
            usable_blocks // int(blocks_per_sequence(spec, mml))
        ),
        "fragmentation_slots_per_seq": float(pad_slots.mean()),
        "fragmentation_bytes_per_seq": float(pad_slots.mean() * bpb / bs),
        "fragmentation_pct_of_held": float(100 * pad_slots.sum() / (avg_blocks.sum() * bs)),
        "requests_too_long_for_pool": int((final_blocks > usable_blocks).sum()),
        "requests_over_max_model_len": int((plen + olen > mml).sum()),
    }
    if num_seqs is not None:
        out.update(max_len_for_num_seqs(spec, usable_blocks, num_seqs, mml))
    return out


def max_len_for_num_seqs(
    spec: CacheSpec, usable_blocks: int, num_seqs: int, model_max_len: int | None = None
) -> dict[str, Any]:
    """The largest max_model_len at which ``num_seqs`` sequences, all at full length, fit
    in ``usable_blocks``: :func:`max_sequence_tokens` of ``usable_blocks // num_seqs``
    blocks (dense: ``(usable_blocks // num_seqs) * block_size`` tokens), capped at
    the model's context ``model_max_len`` when given; None when the model slides on every
    layer and one sequence's worst case already fits (any length does, up to the context).

    Returns:
        ``{"num_seqs": num_seqs, "max_model_len_for_num_seqs": int | None,
        "limited_by": "kv_memory" | "model_context" | "too_many_seqs"}``: ``too_many_seqs``
        (with length 0) when ``num_seqs`` exceeds ``usable_blocks``, so not even one block
        per sequence fits.

    Raises:
        SpecError: ``num_seqs < 1``.
    """
    if num_seqs < 1:
        raise SpecError(f"num_seqs: expected >= 1, got {num_seqs}")
    per = usable_blocks // num_seqs
    # the longest sequence whose blocks stay within its share (None = any length: a
    # sliding-only model whose window blocks fit)
    length: int | None = max_sequence_tokens(spec, per) if per else 0
    limited_by = "kv_memory"
    if per == 0:
        limited_by = "too_many_seqs"
    elif model_max_len is not None and (length is None or length >= model_max_len):
        length, limited_by = int(model_max_len), "model_context"
    return {
        "num_seqs": num_seqs,
        "max_model_len_for_num_seqs": length,
        "limited_by": limited_by,
    }


__all__ = [
    "Workload",
    "analyze_workload",
    "blocks_per_sequence",
    "max_len_for_num_seqs",
    "max_sequence_tokens",
]
