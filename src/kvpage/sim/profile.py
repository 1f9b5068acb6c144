"""Workload profiling of a request trace: lengths, arrival rate, burstiness, prefix reuse.

Definitions (percentiles use numpy's default linear interpolation, as the statistics in
``/work/shared/traces/README.md`` do, so the numbers can be checked against them):

* ``interarrival_cv``: standard deviation / mean of the gaps between consecutive
  arrivals (1 for a Poisson process; > 1 = bursty).
* ``peak_1min_rate``: the most requests in any 60 s window starting at an arrival,
  divided by 60 (req/s); ``peak_to_mean`` = that over the mean rate.
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

from kvpage.stats import summarize
from kvpage.workload.traces import Trace


def arrival_stats(arrivals: np.ndarray, window_s: float = 60.0) -> dict[str, float]:
    """Rate and burstiness of arrival times ``[n]`` (seconds, non-decreasing)."""
    n = len(arrivals)
    span = float(arrivals[-1] - arrivals[0]) if n > 1 else 0.0
    gaps = np.diff(arrivals)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else 0.0
    ends = np.searchsorted(arrivals, arrivals + window_s, side="left")
    peak = int((ends - np.arange(n)).max()) if n else 0
    return {
        "requests": float(n),
        "span_s": span,
        "mean_rate_rps": n / span if span > 0 else 0.0,
        "interarrival_cv": cv,
        "peak_1min_rate_rps": peak / window_s,
        "peak_to_mean": (peak / window_s) / (n / span) if span > 0 else 0.0,
    }


def prefix_stats(trace: Trace) -> dict[str, float]:
    """Prefix-sharing statistics from hash ids (empty dict when the trace has none)."""
    if not trace.has_hash_ids:
        return {}
    reqs = trace.requests
    n = len(reqs)
    hb = trace.hash_block_tokens
    ids = [r.hash_ids or () for r in reqs]
    out: dict[str, float] = {}
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
            "blocks_per_request_p50": float(np.percentile([len(h) for h in ids], 50)),
            "unique_blocks": float(uniq),
            "block_references": float(total_blocks),
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
        rows.append((k, f"{v:,.3f}"))
    for k, v in prof["prefix"].items():
        rows.append((k, f"{v:,.2f}"))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is in the cli extra
        return "\n".join(f"{k:32s} {v}" for k, v in rows)
    table = Table(title=f"profile of {prof['trace']} ({prof['format']})")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    console = Console(width=100, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def plot_profile(trace: Trace, out_prefix: str) -> list[str]:
    """Write PNG plots: length histograms and arrivals per minute.

    Args:
        trace: the trace.
        out_prefix: path prefix; files ``<prefix>_lengths.png`` and ``<prefix>_arrivals.png``.

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
        bins = np.logspace(0, np.log10(max(int(data.max()), 2)), 50)
        ax.hist(data, bins=bins, color="#4477aa")
        ax.set_xscale("log")
        for q, ls in ((50, "-"), (95, "--"), (99, ":")):
            ax.axvline(np.percentile(data, q), color="k", ls=ls, lw=1, label=f"p{q}")
        ax.set_xlabel(label)
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
        edges = np.arange(0, arr[-1] + 60.0, 60.0)
        counts, _ = (
            np.histogram(arr, bins=edges) if len(edges) > 1 else (np.array([len(arr)]), None)
        )
        ax.step(edges[: len(counts)] / 60.0, counts / 60.0, where="post", color="#aa3377")
    ax.set_xlabel("minutes since trace start")
    ax.set_ylabel("arrivals (req/s, per minute)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{trace.name}: arrival rate over time")
    fig.tight_layout()
    paths.append(f"{out_prefix}_arrivals.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


__all__ = ["arrival_stats", "plot_profile", "prefix_stats", "profile_trace", "render_profile"]
