"""Workload profiling of a request trace: lengths, arrival rate, burstiness, prefix reuse.

Definitions (percentiles use numpy's default linear interpolation, as the statistics in
``/work/shared/traces/README.md`` do, so the numbers can be checked against them):

* ``interarrival_cv``: standard deviation / mean of the gaps between consecutive
  arrivals (1 for a Poisson process; > 1 = bursty).
* ``peak_1min_rate``: the most requests in any 60 s window starting at an arrival,
  divided by 60 (req/s); ``peak_to_mean`` = that over the mean rate. The table and the
  arrivals plot both take it from :func:`window_counts`, so they show the same number.
* Prefix statistics (traces with hash ids only), walking requests in file order:
  ``first_k_shared_pct``: requests whose first k block ids equal the first k of another
  request (anywhere in the trace), % of all requests; ``causal_ge_k_pct``: requests
  whose first k leading blocks were all already seen in earlier requests (infinite
  cache, no eviction); ``causal_block_hit_pct``: hit blocks / all blocks, where a
  request's hit is its leading run of already-seen blocks; ``causal_token_hit_pct``:
  ``min(hit_blocks * 512, input_length)`` / input tokens.
* ``multi_turn_pct``: requests whose first two blocks were seen before (a continuation
  of an earlier conversation, past a shared system-prompt block) — ``causal_ge_2_pct``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from kvpage.report import render_table
from kvpage.stats import summarize
from kvpage.workload.traces import Trace


def window_counts(arrivals: np.ndarray, window_s: float = 60.0) -> np.ndarray:
    """``[n]`` int64: for each arrival ``t_i``, the arrivals in ``[t_i, t_i + window_s)``
    (``arrivals`` in seconds, non-decreasing). Its maximum is the peak of
    :func:`arrival_stats`; :func:`plot_profile` draws it."""
    n = len(arrivals)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.searchsorted(arrivals, arrivals + window_s, side="left")
    return (ends - np.arange(n)).astype(np.int64)


def arrival_stats(arrivals: np.ndarray, window_s: float = 60.0) -> dict[str, Any]:
    """Rate and burstiness of arrival times ``[n]`` (seconds, non-decreasing);
    ``requests`` is an int, the rest floats."""
    n = len(arrivals)
    span = float(arrivals[-1] - arrivals[0]) if n > 1 else 0.0
    gaps = np.diff(arrivals)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else 0.0
    peak = int(window_counts(arrivals, window_s).max()) if n else 0
    return {
        "requests": n,
        "span_s": span,
        "mean_rate_rps": n / span if span > 0 else 0.0,
        "interarrival_cv": cv,
        "peak_1min_rate_rps": peak / window_s,
        "peak_to_mean": (peak / window_s) / (n / span) if span > 0 else 0.0,
    }


def prefix_stats(trace: Trace) -> dict[str, Any]:
    """Prefix-sharing statistics from hash ids (empty dict when the trace has none);
    block counts are ints, percentages floats."""
    if not trace.has_hash_ids:
        return {}
    reqs = trace.requests
    n = len(reqs)
    hb = trace.hash_block_tokens
    ids = [r.hash_ids or () for r in reqs]
    out: dict[str, Any] = {}
    for k in (1, 2, 4):
        c = Counter(h[:k] for h in ids if len(h) >= k)
        shared = sum(1 for h in ids if len(h) >= k and c[h[:k]] > 1)
        out[f"first_{k}_shared_pct"] = 100.0 * shared / n
    seen: set[int] = set()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    ge1 = ge2 = 0
    for r, h in zip(reqs, ids):
        run = 0
        for b in h:
            if b not in seen:
                break
            run += 1
        ge1 += run >= 1
        ge2 += run >= 2
        hit_blocks += run
        total_blocks += len(h)
        hit_tokens += min(run * hb, r.prompt_tokens)
        total_tokens += r.prompt_tokens
        seen.update(h)
    uniq = len({b for h in ids for b in h})
    out.update(
        {
            "blocks_per_request_p50": summarize([len(h) for h in ids])["p50"],
            "unique_blocks": uniq,
            "block_references": total_blocks,
            "causal_ge_1_pct": 100.0 * ge1 / n,
            "causal_ge_2_pct": 100.0 * ge2 / n,
            "causal_block_hit_pct": 100.0 * hit_blocks / max(total_blocks, 1),
            "causal_token_hit_pct": 100.0 * hit_tokens / max(total_tokens, 1),
            "multi_turn_pct": 100.0 * ge2 / n,
        }
    )
    return out


def profile_trace(trace: Trace) -> dict[str, Any]:
    """All statistics of a trace as a JSON-serialisable dict (see the module docstring)."""
    return {
        "trace": trace.name,
        "format": trace.format,
        "prompt_tokens": summarize(trace.prompt_lens()),
        "output_tokens": summarize(trace.output_lens()),
        "arrivals": arrival_stats(trace.arrivals()),
        "prefix": prefix_stats(trace),
    }


def _number(v: Any, digits: int) -> str:
    """A count (int) with thousands separators and no decimals; a float with ``digits``."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return f"{int(v):,}"
    return f"{float(v):,.{digits}f}"


def render_profile(prof: dict[str, Any]) -> str:
    """The profile as a text table (rich when installed, plain otherwise)."""
    rows: list[tuple[str, str]] = []
    for key in ("prompt_tokens", "output_tokens"):
        d = prof[key]
        rows.append(
            (
                f"{key} p50/p95/p99",
                f"{d['p50']:,.1f} / {d['p95']:,.1f} / {d['p99']:,.1f}",
            )
        )
        rows.append(
            (f"{key} mean/min/max", f"{d['mean']:,.1f} / {d['min']:,.0f} / {d['max']:,.0f}")
        )
    for k, v in prof["arrivals"].items():
        rows.append((k, _number(v, 3)))
    for k, v in prof["prefix"].items():
        rows.append((k, _number(v, 2)))
    title = f"profile of {prof['trace']} ({prof['format']})"
    return render_table(title, rows, columns=("statistic", "value"), width=100)


def plot_profile(trace: Trace, out_prefix: str, window_s: float = 60.0) -> list[str]:
    """Write PNG plots: length histograms and the arrival rate.

    Args:
        trace: the trace.
        out_prefix: path prefix; files ``<prefix>_lengths.png`` and ``<prefix>_arrivals.png``
            (``kvpage profile --plots DIR`` passes ``DIR/<trace name>``).
        window_s: the rate window (the table's ``peak_1min_rate_rps`` uses 60 s).

    The histograms' x-axes span the data (log scale, smallest to largest length). The
    arrival plot draws :func:`window_counts` / ``window_s`` at each arrival — the rate the
    table's peak is the maximum of — and marks that peak with its value.

    Returns:
        The written paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, data, label in (
        (axes[0], trace.prompt_lens(), "prompt tokens"),
        (axes[1], trace.output_lens(), "output tokens"),
    ):
        data = np.maximum(data, 1)
        lo, hi = int(data.min()), int(data.max())
        hi = max(hi, lo + 1)  # one distinct length: a narrow, non-empty range
        bins = np.logspace(np.log10(lo), np.log10(hi), 50)
        ax.hist(data, bins=bins, color="#4477aa")
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        pct = summarize(data)
        for q, ls in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            ax.axvline(pct[q], color="k", ls=ls, lw=1, label=q)
        ax.set_xlabel(f"{label} ({lo:,} to {int(data.max()):,})")
        ax.set_ylabel("requests")
        ax.legend(fontsize=8)
    fig.suptitle(f"{trace.name}: length distributions ({len(trace)} requests)")
    fig.tight_layout()
    paths.append(f"{out_prefix}_lengths.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    arr = trace.arrivals()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    if len(arr):
        rate = window_counts(arr, window_s) / window_s
        t = (arr - arr[0]) / 60.0
        ax.step(t, rate, where="post", color="#aa3377", lw=1)
        k = int(np.argmax(rate))
        ax.plot([t[k]], [rate[k]], "o", color="k", ms=4)
        ax.annotate(
            f"peak {rate[k]:.2f} req/s",
            (t[k], rate[k]),
            textcoords="offset points",
            xytext=(6, -10),
            fontsize=8,
        )
    ax.set_xlabel("minutes since the first arrival")
    ax.set_ylabel(f"req/s in the next {window_s:g} s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{trace.name}: arrival rate ({window_s:g} s window starting at each arrival)")
    fig.tight_layout()
    paths.append(f"{out_prefix}_arrivals.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


__all__ = [
    "arrival_stats",
    "plot_profile",
    "prefix_stats",
    "profile_trace",
    "render_profile",
    "window_counts",
]
