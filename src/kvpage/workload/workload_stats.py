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
    """Blocks one sequence of ``seq_len`` tokens holds in the most demanding KV group:
    ``ceil(L / block_size)`` for full attention; for a sliding group of window W, with
    sliding-window freeing, at most ``ceil((W - 1) / block_size) + 1`` blocks."""
    L = np.asarray(seq_len, dtype=np.int64)
    bs = spec.block_size
    full = -(-L // bs)
    worst = np.zeros_like(full)
    for g in spec.kv_groups:
        if g.sliding_window is None:
            worst = np.maximum(worst, full)
        else:
            cap = -(-(g.sliding_window - 1) // bs) + 1
            worst = np.maximum(worst, np.minimum(full, cap))
    return worst


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
    in ``usable_blocks``: ``(usable_blocks // num_seqs) * block_size`` tokens, capped at
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
    # a sliding-only model holds at most blocks_per_sequence(inf) blocks per sequence:
    # if that fits, any length fits (None = unbounded by KV memory)
    cap = int(blocks_per_sequence(spec, 1 << 40))
    length: int | None = None if per >= cap else int(per * spec.block_size)
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


__all__ = ["Workload", "analyze_workload", "blocks_per_sequence", "max_len_for_num_seqs"]
