"""``kvpage simulate --instances N --router POLICY``: the router over N simulated instances.

Called by :func:`kvpage.apps.simulate_cli.run_simulate` when ``--instances`` is given:
every router of ``--router`` (comma list or ``all``) x block size of ``--block-sizes``
runs :func:`kvpage.sim.cluster.simulate_cluster` on the same trace, with the
``paged-prefix`` policy in every instance. The table has one row per run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvpage.errors import KVPageError

if TYPE_CHECKING:
    from kvpage.sim.config import SimConfig
    from kvpage.workload.traces import Trace, TraceRequest

#: columns of the cluster table: (header, key or (key, subkeys), format)
CLUSTER_COLUMNS: list[tuple[str, Any, str]] = [
    ("router", "router", "{}"),
    ("N", "instances", "{}"),
    ("done", "finished", "{}"),
    ("rejected", "rejected", "sum"),
    ("prefix hit % (blocks)", "prefix_hit_pct", "{:.1f}"),
    ("TTFT p50/p90/p99 s", ("ttft_s", ("p50", "p90", "p99")), "{:.2f}"),
    ("out tok/s", "throughput_tok_s", "{:,.0f}"),
    ("imbalance", "imbalance", "{:.2f}"),
    ("preempt", "preemptions", "{}"),
    ("resyncs", ("index", ("resyncs",)), "{}"),
]


def cluster_markdown(rows: list[dict[str, Any]]) -> str:
    """Cluster results (``ClusterResult.to_dict()``) as a GitHub markdown table."""
    head = [c[0] for c in CLUSTER_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in rows:
        cells = []
        for _, key, fmt in CLUSTER_COLUMNS:
            if isinstance(key, tuple):
                cells.append("/".join(fmt.format(d[key[0]][k]) for k in key[1]))
            elif fmt == "sum":
                cells.append(str(sum(d[key].values())))
            else:
                cells.append(fmt.format(d[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cap_outputs(trace: Any, cap: int | None) -> Any:
    """``trace`` with every output length capped at ``cap`` tokens (None = unchanged)."""
    if cap is None:
        return trace
    reqs = [replace(r, output_tokens=min(r.output_tokens, cap)) for r in trace.requests]
    return replace(trace, requests=reqs)


#: most simulated instances: each holds a full KVCacheManager of the planned pool (about
#: 2.4 MB for Llama-3-8B on an H100 at block 64), so 1,000 took 2.4 GB; 256 covers the
#: study's range (2-64) with room
MAX_INSTANCES = 256


def run_cluster(
    args: argparse.Namespace,
    trace: Trace | Sequence[TraceRequest],
    base: SimConfig,
    sizes: list[int],
) -> list[dict[str, Any]]:
    """Every router x block size on ``trace`` with ``args.instances`` instances.

    Raises:
        KVPageError: a bad ``--router`` / ``--instances`` / ``--event-delay``, or
            ``--policies`` other than ``all``/``paged-prefix``.
    """
    from kvpage.routing import POLICY_NAMES
    from kvpage.sim.cluster import simulate_cluster

    if not 1 <= args.instances <= MAX_INSTANCES:
        raise KVPageError(
            f"--instances: expected an int in [1, {MAX_INSTANCES}] (each instance holds a "
            f"whole simulated KV pool), got {args.instances}"
        )
    if args.policies not in ("all", "paged-prefix"):
        raise KVPageError(
            f"--policies: expected 'paged-prefix' (or the default) with --instances, "
            f"got {args.policies!r}"
        )
    routers = list(POLICY_NAMES) if args.router in (None, "all") else args.router.split(",")
    bad = [r for r in routers if r not in POLICY_NAMES]
    if bad:
        raise KVPageError(f"--router: expected 'all' or a comma list of {POLICY_NAMES}, got {bad}")
    if not args.event_delay >= 0:
        raise KVPageError(f"--event-delay: expected seconds >= 0, got {args.event_delay}")
    rows: list[dict[str, Any]] = []
    for bs in sizes:
        nb = None if args.num_blocks is None else (args.num_blocks - 1) * 16 // bs + 1
        if nb is not None and nb < 2:
            raise KVPageError(f"--num-blocks: {args.num_blocks} scales to {nb} at block {bs}")
        cfg = replace(base, policy="paged-prefix", block_size=bs, num_blocks=nb)
        for r in routers:
            row = simulate_cluster(
                trace,
                cfg,
                instances=args.instances,
                router=r,
                event_delay_s=args.event_delay,
            ).to_dict()
            row["block_size"] = bs
            rows.append(row)
            print(f"done {r} x{args.instances} block {bs}", file=sys.stderr)
            if row["rejected"]:
                why = ", ".join(f"{k}={v}" for k, v in sorted(row["rejected"].items()))
                print(f"  rejected {sum(row['rejected'].values())}: {why}", file=sys.stderr)
    return rows


__all__ = ["CLUSTER_COLUMNS", "cap_outputs", "cluster_markdown", "run_cluster"]
