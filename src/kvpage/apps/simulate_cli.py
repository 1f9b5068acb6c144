"""``kvpage simulate``: replay a trace under several allocation policies / block sizes.

``--limit N`` keeps the first N rows of the trace (default 1000; 0 = all, as
``kvpage replay --num-requests 0``). Requests the scheduler refuses (empty prompt, prompt
longer than ``--max-model-len``) are not simulated: the ``rejected`` column counts them
and their reasons are printed to stderr. ``--max-output-tokens N`` caps every request's
output length (the simulation cost grows with output tokens; prompts, arrivals and prefix
sharing are unchanged).

``--instances N --router POLICY`` (``kvpage.apps.cluster_cli``) routes the trace over N
simulated instances instead, with the router policies of ``kvpage.routing``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from kvpage.apps.cli_util import (
    Subparsers,
    miss_markdown,
    parse_int_list,
    prepare_output,
    trace_limit,
    write_output,
)
from kvpage.apps.cluster_cli import cap_outputs, cluster_markdown, run_cluster
from kvpage.errors import KVPageError
from kvpage.jsonout import dumps

#: columns of the result table: (header, key or (key, subkey), format)
COLUMNS: list[tuple[str, Any, str]] = [
    ("policy", "policy", "{}"),
    ("block", "block_size", "{}"),
    ("done", "finished", "{}"),
    ("rejected", "rejected", "sum"),
    ("eff. KV util %", "effective_kv_util_pct", "{:.1f}"),
    ("peak KV %", "peak_kv_usage_pct", "{:.1f}"),
    ("peak batch", "peak_batch", "{}"),
    ("out tok/s", "throughput_tok_s", "{:,.0f}"),
    ("TTFT p50/p95/p99 s", ("ttft_s", ("p50", "p95", "p99")), "{:.2f}"),
    ("TPOT p50/p95/p99 ms", ("tpot_s", ("p50", "p95", "p99")), "ms"),
    ("preempt", "preemptions", "{}"),
    ("alloc fail", "allocation_failures", "{}"),
    ("prefix hit %", "prefix_hit_pct", "{:.1f}"),
]


def format_row(d: dict[str, Any]) -> list[str]:
    """One result dict (``SimResult.to_dict()``) as table cells."""
    cells = []
    for _, key, fmt in COLUMNS:
        if isinstance(key, tuple):
            sub = d[key[0]]
            if fmt == "ms":
                cells.append("/".join(f"{1000 * sub[k]:.1f}" for k in key[1]))
            else:
                cells.append("/".join(fmt.format(sub[k]) for k in key[1]))
        elif fmt == "sum":
            cells.append(str(sum(d[key].values())))
        else:
            cells.append(fmt.format(d[key]))
    return cells


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Results as a GitHub markdown table."""
    head = [c[0] for c in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def add_simulate_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``kvpage simulate``."""
    from kvpage.sim.simulator import POLICIES

    p = subparsers.add_parser("simulate", help="trace-driven simulation without weights")
    p.add_argument("--trace", required=True, help="azure-conv, azure-code, mooncake-conv or a file")
    p.add_argument(
        "--limit", type=int, default=1000, help="first N requests (default 1000; 0 = all)"
    )
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--gpu", default="H100-80GB", help="A100-80GB, H100-80GB, H200, L4")
    p.add_argument("--policies", default="all", help=f"comma list of {', '.join(POLICIES)} or all")
    p.add_argument("--block-sizes", default="16", help="comma list, e.g. 1,8,16,32,64,128,256")
    p.add_argument(
        "--num-blocks", type=int, default=None, help="pool size (>= 2) at block 16 (scaled)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--time-scale", type=float, default=1.0, help="> 0; < 1 compresses arrivals")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument(
        "--kv-pool",
        default="unified",
        choices=["unified", "per_group"],
        help="one block pool for every KV group (default) or one per group (comparison)",
    )
    p.add_argument("--utilization", type=float, default=0.9, help="GPU memory fraction")
    p.add_argument(
        "--weight-bytes",
        default=None,
        help="the model's weights (all --tp ranks), e.g. 65GB (default: parameters x dtype bytes)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: simulate one rank (1/tp of the weights, KV heads "
        "sharded, an MLA latent whole; all-reduces not modelled)",
    )
    p.add_argument("--flops-efficiency", type=float, default=0.6, help="achieved/peak FLOP/s")
    p.add_argument("--bandwidth-efficiency", type=float, default=0.8, help="achieved/peak B/s")
    p.add_argument("--step-overhead", type=float, default=0.002, help="seconds per step")
    p.add_argument(
        "--max-output-tokens", type=int, default=None, help="cap each output length (>= 1)"
    )
    p.add_argument(
        "--instances",
        type=int,
        default=None,
        help="route over N simulated instances (paged-prefix each) instead of one",
    )
    p.add_argument(
        "--router",
        default=None,
        help="with --instances: comma list of round_robin, power_of_two, prefix_approx, "
        "kv_precise, oracle, or all (the default)",
    )
    p.add_argument(
        "--event-delay", type=float, default=0.0, help="with --instances: KV-event delay, s"
    )
    p.add_argument(
        "--kv-host-tier-bytes", type=int, default=0, help="host KV tier below the pool (bytes)"
    )
    p.add_argument(
        "--kv-disk-tier-bytes", type=int, default=0, help="disk KV tier (bytes; simulated)"
    )
    p.add_argument(
        "--transfer-preset",
        default="pcie5-nvme",
        help="tier/swap link speeds: pcie4-nvme, pcie5-nvme, nvlink-c2c-nvme",
    )
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--swap-space-bytes", type=int, default=4 << 30, help="host bytes for swap")
    p.add_argument("--json", default=None, help="write results as JSON here ('-' = stdout)")
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args: argparse.Namespace) -> int:
    """Handler of ``kvpage simulate``: every policy x block size on the same trace."""
    from kvpage.capacity import parse_bytes
    from kvpage.sim.simulator import POLICIES, SimConfig, simulate
    from kvpage.workload.traces import load_trace

    try:
        json_path = prepare_output(args.json, "--json") if args.json not in (None, "-") else None
        pols = list(POLICIES) if args.policies == "all" else args.policies.split(",")
        bad = [x for x in pols if x not in POLICIES]
        if bad:
            raise KVPageError(
                f"--policies: expected 'all' or a comma list of {POLICIES}, got {bad}"
            )
        sizes = parse_int_list(args.block_sizes, "--block-sizes")
        if args.num_blocks is not None and args.num_blocks < 2:
            raise KVPageError(
                f"--num-blocks: expected an int >= 2 (the null block + 1 usable), "
                f"got {args.num_blocks}"
            )
        if args.max_output_tokens is not None and args.max_output_tokens < 1:
            raise KVPageError(
                f"--max-output-tokens: expected an int >= 1, got {args.max_output_tokens}"
            )
        if args.instances is None and (args.router is not None or args.event_delay):
            raise KVPageError("--router/--event-delay: expected only with --instances, got none")
        trace = cap_outputs(
            load_trace(args.trace, limit=trace_limit(args.limit)), args.max_output_tokens
        )
        base = SimConfig(
            model=args.model,
            gpu=args.gpu,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            time_scale=args.time_scale,
            kv_dtype=args.kv_dtype,
            kv_pool=args.kv_pool,
            utilization=args.utilization,
            weight_bytes=None
            if args.weight_bytes is None
            else parse_bytes(args.weight_bytes, "--weight-bytes"),
            tp=args.tp,
            flops_efficiency=args.flops_efficiency,
            bandwidth_efficiency=args.bandwidth_efficiency,
            step_overhead_s=args.step_overhead,
            transfer_preset=args.transfer_preset,
            swap_space_bytes=args.swap_space_bytes,
        )
        tiers = dict(
            kv_host_tier_bytes=args.kv_host_tier_bytes, kv_disk_tier_bytes=args.kv_disk_tier_bytes
        )
        if any(tiers.values()) and "paged-prefix" not in pols:
            raise KVPageError(
                f"--kv-host-tier-bytes/--kv-disk-tier-bytes: expected --policies with "
                f"paged-prefix (tiers hold prefix-cache blocks), got {pols}"
            )
        if any(tiers.values()) or args.preemption_mode == "swap":
            print(
                "note: KV tiers apply to paged-prefix rows, swap to paged rows; "
                "other rows run without them",
                file=sys.stderr,
            )
        rows = []
        if args.instances is not None:
            # every instance is paged-prefix: the tiers and the preemption mode apply to all
            inst = replace(base, **tiers, preemption_mode=args.preemption_mode)
            rows = run_cluster(args, trace, inst, sizes)
            sizes = []
        for bs in sizes:
            nb = None if args.num_blocks is None else (args.num_blocks - 1) * 16 // bs + 1
            if nb is not None and nb < 2:
                raise KVPageError(
                    f"--num-blocks: {args.num_blocks} blocks of 16 tokens scale to {nb} block(s) "
                    f"of {bs}; expected >= 2, got {nb} (raise --num-blocks)"
                )
            for pol in pols:
                if pol.startswith("contiguous") and bs != sizes[0]:
                    continue  # block size does not apply
                cfg = replace(base, policy=pol, block_size=bs, num_blocks=nb)
                if pol == "paged-prefix":
                    cfg = replace(cfg, **tiers)
                if pol.startswith("paged"):
                    cfg = replace(cfg, preemption_mode=args.preemption_mode)
                row = simulate(trace, cfg).to_dict()
                rows.append(row)
                print(f"done {pol} block {bs}", file=sys.stderr)
                if row["rejected"]:
                    why = ", ".join(f"{k}={v}" for k, v in sorted(row["rejected"].items()))
                    print(f"  rejected {sum(row['rejected'].values())}: {why}", file=sys.stderr)
                if row["finished"] == 0:
                    print(f"  note: {pol} block {bs} finished no requests", file=sys.stderr)
    except (KVPageError, ValueError) as e:
        print(f"kvpage simulate: {e}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(dumps(rows))
        return 0
    print(f"trace {trace.name}: {len(trace)} requests, model {args.model}, GPU {args.gpu}")
    if args.instances is not None:
        print(cluster_markdown(rows))
    else:
        print(markdown_table(rows))
        misses = [([r["policy"], str(r["block_size"])], r["miss_reasons"]) for r in rows]
        if any(agg for _, agg in misses):
            print("\ncache misses by reason (prompt tokens computed instead of served from cache):")
            print(miss_markdown(misses, ["policy", "block"]))
    if json_path is not None:
        write_output(json_path, dumps(rows) + "\n")  # atomic: an old file stays whole
    return 0


__all__ = ["add_simulate_parser", "markdown_table", "run_simulate"]
