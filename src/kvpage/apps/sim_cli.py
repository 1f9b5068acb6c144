"""``kvpage plan``, ``kvpage profile`` and ``kvpage simulate`` subcommands.

Each ``add_<name>_parser(subparsers)`` registers one subcommand on an argparse
sub-parsers object and sets ``func`` to its handler (``handler(args) -> int`` exit code).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from kvpage.apps.cli_util import Subparsers, prepare_output, trace_limit, write_output
from kvpage.errors import KVPageError
from kvpage.jsonout import dumps
from kvpage.report import render_table


def _table(title: str, rows: list[tuple[str, str]]) -> str:
    return render_table(title, rows, columns=("quantity", "value"))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


# ---- plan -----------------------------------------------------------------------------
def add_plan_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``kvpage plan``."""
    p = subparsers.add_parser("plan", help="size a KV cache for a model on a device")
    p.add_argument(
        "--model", required=True, help="preset (llama-3-8b, stories260K, ...) or config.json"
    )
    p.add_argument("--memory", required=True, help="device memory: bytes, 80GiB, 80GB ...")
    p.add_argument(
        "--utilization", type=float, default=0.9, help="fraction of memory kvpage may use"
    )
    p.add_argument(
        "--weight-bytes", default=None, help="weights per replica (default params x dtype)"
    )
    p.add_argument("--weight-dtype", default=None, help="float16/bfloat16/float32/int8/fp8/int4")
    p.add_argument("--overhead", default="0", help="activations etc. to set aside per rank")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (shards KV heads)")
    p.add_argument("--replicate-kv-heads", action="store_true", help="allow tp > num_kv_heads")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-pool",
        default="unified",
        choices=["unified", "per_group"],
        help="one block pool for every KV group (default) or one per group (comparison)",
    )
    p.add_argument("--trace", default=None, help="workload: bundled trace name or file")
    p.add_argument(
        "--limit", type=int, default=None, help="first N requests of the trace (0 or omitted = all)"
    )
    p.add_argument("--prompt-pct", default=None, help="workload: prompt p50,p95,p99")
    p.add_argument("--output-pct", default=None, help="workload: output p50,p95,p99")
    p.add_argument(
        "--num-seqs", type=int, default=None, help="N (>= 1) for the largest max_model_len"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="hybrid models: live recurrent-state slots (the engine's max_num_seqs)",
    )
    p.add_argument(
        "--state-snapshot-share",
        type=float,
        default=0.1,
        help="hybrid models: share of the memory after the live states for state snapshots",
    )
    p.add_argument(
        "--kv-host-tier-bytes",
        default="0",
        help="host KV tier size (bytes, 64GiB, ...; 0 = none); hybrid models: its "
        "state_snapshot_share sizes the host snapshot rows",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_plan)
    return p


def _triple(text: str, name: str) -> tuple[float, float, float]:
    try:
        a, b, c = (float(x) for x in text.split(","))
    except ValueError:
        raise KVPageError(f"{name}: expected p50,p95,p99, got {text!r}") from None
    return a, b, c


def run_plan(args: argparse.Namespace) -> int:
    """Handler of ``kvpage plan``."""
    from kvpage.capacity import Workload, plan_capacity
    from kvpage.workload.traces import load_trace

    try:
        wl = None
        if args.trace and (args.prompt_pct or args.output_pct):
            raise KVPageError(
                "--prompt-pct/--output-pct: expected none with --trace (the trace gives the "
                f"lengths), got {args.prompt_pct or args.output_pct!r}"
            )
        if args.trace:
            wl = Workload.from_trace(load_trace(args.trace, limit=trace_limit(args.limit)))
        elif args.prompt_pct or args.output_pct:
            if not (args.prompt_pct and args.output_pct):
                raise KVPageError("--prompt-pct/--output-pct: expected both, got one")
            wl = Workload.from_percentiles(
                _triple(args.prompt_pct, "--prompt-pct"), _triple(args.output_pct, "--output-pct")
            )
        plan = plan_capacity(
            args.model,
            device_bytes=args.memory,
            utilization=args.utilization,
            weight_bytes=args.weight_bytes,
            weight_dtype=args.weight_dtype,
            overhead_bytes=args.overhead,
            tp=args.tp,
            replicate_kv_heads=args.replicate_kv_heads,
            kv_dtype=args.kv_dtype,
            dtype=args.dtype,
            block_size=args.block_size,
            workload=wl,
            num_seqs=args.num_seqs,
            max_model_len=args.max_model_len,
            kv_pool=args.kv_pool,
            max_num_seqs=args.max_num_seqs,
            state_snapshot_share=args.state_snapshot_share,
            kv_host_tier_bytes=args.kv_host_tier_bytes,
        )
    except KVPageError as e:
        print(f"kvpage plan: {e}", file=sys.stderr)
        return 2
    d = plan.to_dict()
    if args.json:
        print(dumps(d))
        return 0
    gib = 1 << 30
    rows = [
        (
            "model / tp / block_size / kv dtype",
            f"{d['model']} / {d['tp']} / {d['block_size']} / {d['kv_dtype']}",
        ),
        ("device memory", f"{d['device_bytes'] / gib:,.2f} GiB x {d['utilization']}"),
        ("weights per rank", f"{d['weight_bytes'] / d['tp'] / gib:,.2f} GiB"),
        ("KV budget per rank", f"{d['kv_budget_bytes'] / gib:,.2f} GiB"),
        (
            "bytes per token (exact / simple formula)",
            f"{d['bytes_per_token']:,} / {d['simple_bytes_per_token']:,}",
        ),
        ("bytes per block", f"{d['bytes_per_block']:,}"),
        ("KV pool / KV groups", f"{d['kv_pool']} / {d['num_kv_groups']}"),
        ("KV blocks (incl. null block)", f"{d['num_blocks']:,}"),
        (
            "tokens that fit (one sequence)",
            "any length (no KV: recurrent layers only)"
            if d["num_kv_groups"] == 0
            else f"{d['tokens']:,}"
            + (" (any length: windows only)" if d["tokens_unbounded"] else ""),
        ),
    ]
    if d["num_state_layers"]:
        rows += [
            (
                "recurrent state layers / bytes per sequence",
                f"{d['num_state_layers']} / {d['state_bytes_per_sequence']:,}",
            ),
            (
                "live state slots / snapshot slots (share)",
                f"{d['state_live_slots']:,} / {d['state_snapshot_slots']:,} "
                f"({d['state_snapshot_share']})",
            ),
            ("snapshot memory", f"{d['state_snapshot_bytes'] / gib:,.2f} GiB"),
        ]
        if d["kv_host_tier_bytes"]:
            rows.append(
                (
                    "host snapshot rows / host memory (beside the host KV tier)",
                    f"{d['state_host_snapshot_rows']:,} / "
                    f"{d['state_host_snapshot_bytes'] / gib:,.2f} GiB",
                )
            )
        rows += [
            (
                "sequences that fit at max_model_len (KV + state)",
                f"{d['state_seqs_that_fit']:,} x {d['model_max_len']:,} tokens",
            ),
        ]
    rows += [(k, _fmt(v)) for k, v in d["workload"].items()]
    print(_table("kvpage plan", rows))
    return 0


# ---- profile --------------------------------------------------------------------------
def add_profile_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``kvpage profile``."""
    p = subparsers.add_parser("profile", help="statistics and plots of a request trace")
    p.add_argument("--trace", required=True, help="azure-conv, azure-code, mooncake-conv or a file")
    p.add_argument("--limit", type=int, default=None, help="first N requests (0 or omitted = all)")
    p.add_argument(
        "--json", default=None, help="write the statistics as JSON to this file ('-' = stdout)"
    )
    p.add_argument(
        "--plots",
        default=None,
        metavar="DIR",
        help="write PNG plots into this folder (created if missing): "
        "<trace>_lengths.png, <trace>_arrivals.png",
    )
    p.set_defaults(func=run_profile)
    return p


def run_profile(args: argparse.Namespace) -> int:
    """Handler of ``kvpage profile``."""
    from kvpage.sim.profile import plot_profile, profile_trace, render_profile
    from kvpage.workload.traces import load_trace

    try:
        json_path = prepare_output(args.json, "--json") if args.json not in (None, "-") else None
        if args.plots:  # a folder: DIR/<trace>_lengths.png, DIR/<trace>_arrivals.png
            if Path(args.plots).exists() and not Path(args.plots).is_dir():
                raise KVPageError(f"--plots: expected a folder, got the file {args.plots!r}")
            prepare_output(str(Path(args.plots) / "lengths.png"), "--plots")
            if importlib.util.find_spec("matplotlib") is None:  # e.g. scripts/run.sh's venv
                raise KVPageError(
                    "--plots: needs matplotlib, which is not installed (pip install "
                    "'kvpage[cli]', or `bash scripts/bootstrap.sh` for everything)"
                )
        trace = load_trace(args.trace, limit=trace_limit(args.limit))
    except KVPageError as e:
        print(f"kvpage profile: {e}", file=sys.stderr)
        return 2
    prof = profile_trace(trace)
    if args.json == "-":
        print(dumps(prof))
    else:
        print(render_profile(prof))
        if json_path is not None:
            write_output(json_path, dumps(prof) + "\n")  # atomic
    if args.plots:
        for path in plot_profile(trace, str(Path(args.plots) / trace.name)):
            print(f"wrote {path}", file=sys.stderr)
    return 0
