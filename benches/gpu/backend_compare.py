"""Backend comparison: paged decode and prefill of every runnable kvpage backend against
``scaled_dot_product_attention`` on a contiguous cache, with the device copy bandwidth.

GPU (default): Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128, block_size
16); batch 1/16/64/256; context 512/4096/32768; bfloat16 and fp8 (e4m3) KV; decode and
chunked prefill (the last ``min(256, context)`` tokens of each sequence). Cases over the
memory cap, over the FLOP cap, or predicted to exceed the per-case limit are skipped
(recorded with the reason); so is everything once the time budget is spent.

``--dry-run``: the same driver on CPU with tiny shapes, the torch backend and the
others where they run on CPU (numba under ``NUMBA_ENABLE_CUDASIM=1``, triton under
``TRITON_INTERPRET=1``), so that one GPU run suffices.

Writes ``OUT/backend_compare.json`` and ``OUT/backend_compare.md``; prints progress.
Usage: ``python benches/gpu/backend_compare.py --out OUT [--dry-run]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cases import (  # noqa: E402
    LLAMA3_8B,
    TINY,
    Case,
    case_bytes,
    case_flops,
    copy_bandwidth,
    make_case,
    sdpa_baseline,
    timed,
)

from kvpage.backends import backend_reasons, get_backend  # noqa: E402
from kvpage.specs import make_cache_spec  # noqa: E402

BACKENDS = ("torch", "triton", "cupy", "numba")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    if args.dry_run:
        return dict(
            device=torch.device("cpu"), shape=TINY, batches=(1, 2), contexts=(8, 20),
            kv_dtypes=("auto", "fp8_e4m3"), copy_bytes=8 << 20, iters=2,
        )  # fmt: skip
    return dict(
        device=torch.device("cuda"), shape=LLAMA3_8B, batches=(1, 16, 64, 256),
        contexts=(512, 4096, 32768), kv_dtypes=("auto", "fp8_e4m3"), copy_bytes=2 << 30,
        iters=args.iters,
    )  # fmt: skip


def device_info(device: torch.device) -> dict[str, Any]:
    """Name, memory and versions of the device the run used."""
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            name=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
        )  # fmt: skip
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())  # fmt: skip
    return info


def _runner(backend: Any, case: Case):  # type: ignore[no-untyped-def]
    spec = case.shape.spec()
    out = torch.empty_like(case.query)
    plan = backend.plan(case.meta)  # once per step in the engine, shared by all layers

    def run() -> torch.Tensor:
        return backend.forward(case.query, case.cache, plan, spec, out=out)  # type: ignore[no-any-return]

    return run


def _row(case: Case, who: str, seconds: float | None, copy_gbps: float, **extra: Any) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = dict(
        mode=case.mode, kv=("bf16" if case.kv_dtype == "auto" else case.kv_dtype),
        batch=case.batch, context=case.context, query_len=case.query_len, backend=who,
        seconds=seconds, kv_bytes=case.kv_bytes,
    )  # fmt: skip
    if seconds:
        gbps = case.kv_bytes / seconds / 1e9
        row.update(kv_gbps=gbps, pct_copy_bw=100.0 * gbps / copy_gbps)
    row.update(extra)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    dev: torch.device = cfg["device"]
    shape = cfg["shape"]
    t_start = time.monotonic()
    info = device_info(dev)
    print(f"[compare] device: {info}", flush=True)
    bw = copy_bandwidth(dev, cfg["copy_bytes"])
    print(f"[compare] copy bandwidth: {bw['gbps']:.1f} GB/s (read+write)", flush=True)
    probe = make_cache_spec(
        num_layers=1, block_size=shape.block_size, num_blocks=16, dtype="bfloat16",
        layers=[dict(num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)],
    )  # fmt: skip
    names = [b for b in (args.backends.split(",") if args.backends else BACKENDS) if b]
    backends: dict[str, Any] = {}
    refused: dict[str, list[str]] = {}
    for name in names:
        why: list[str] = []
        for kv in cfg["kv_dtypes"]:
            why += backend_reasons(name, probe.model_copy(update={"kv_dtype": kv}), dev)
        if why:
            refused[name] = sorted(set(why))
            print(f"[compare] skip backend {name}: {'; '.join(refused[name])}", flush=True)
        else:
            backends[name] = get_backend(name)
    rows: list[dict[str, Any]] = []
    last: dict[tuple[str, str, str], tuple[float, float]] = {}  # (who, mode, kv) -> (flops, s)
    cap_bytes = args.mem_cap_gib * 2**30
    for mode in ("decode", "prefill"):
        for kv in cfg["kv_dtypes"]:
            for batch in cfg["batches"]:
                for ctx in cfg["contexts"]:
                    key = f"{mode} kv={kv} batch={batch} ctx={ctx}"
                    flops = case_flops(shape, mode, batch, ctx)
                    need = case_bytes(shape, batch, ctx, kv)
                    skip = None
                    if time.monotonic() - t_start > args.budget_s:
                        skip = f"time budget {args.budget_s:.0f}s spent"
                    elif need > cap_bytes:
                        skip = f"needs {need / 2**30:.1f} GiB > cap {args.mem_cap_gib} GiB"
                    elif flops > args.flop_cap:
                        skip = f"{flops:.2e} FLOPs > cap {args.flop_cap:.0e}"
                    if skip:
                        print(f"[compare] skip {key}: {skip}", flush=True)
                        rows.append(dict(mode=mode, kv=kv, batch=batch, context=ctx, skipped=skip))
                        continue
                    rows += _run_case(mode, kv, batch, ctx, cfg, backends, bw["gbps"], last, args, flops)  # fmt: skip
                    print(f"[compare] done {key} at {time.monotonic() - t_start:.0f}s", flush=True)
    return dict(
        date=time.strftime("%Y-%m-%d"), info=info, copy_bandwidth=bw, shape=shape.__dict__,
        refused=refused, rows=rows, dry_run=bool(args.dry_run),
        wall_seconds=time.monotonic() - t_start,
    )  # fmt: skip


def _run_case(mode, kv, batch, ctx, cfg, backends, copy_gbps, last, args, flops):  # type: ignore[no-untyped-def]
    dev = cfg["device"]
    case = make_case(mode, kv, batch, ctx, cfg["shape"], dev)
    rows = []
    base_t, _ = timed(sdpa_baseline(case), dev, cfg["iters"])
    ref = sdpa_baseline(case)().float()
    rows.append(_row(case, "sdpa_contiguous", base_t, copy_gbps))
    for who, be in backends.items():
        prev = last.get((who, mode, kv))
        if prev and prev[1] * flops / prev[0] > args.case_limit_s:
            why = f"predicted {prev[1] * flops / prev[0]:.1f}s > {args.case_limit_s}s per call"
            rows.append(_row(case, who, None, copy_gbps, skipped=why))
            continue
        try:
            fn = _runner(be, case)
            t0 = time.perf_counter()
            out = fn()  # warm-up (compiles)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            first = time.perf_counter() - t0
            iters = 1 if first > args.case_limit_s / 2 else cfg["iters"]
            t, _ = timed(fn, dev, iters, warmup=0)
            err = float((out.float() - ref).abs().max())
            last[(who, mode, kv)] = (flops, t)
            rows.append(_row(case, who, t, copy_gbps, vs_sdpa=t / base_t, max_abs_err=err))
        except Exception as e:  # one backend failing must not end the run
            rows.append(_row(case, who, None, copy_gbps, error=f"{type(e).__name__}: {e}"[:300]))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    del case
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown report (one table per mode and KV dtype)."""
    info, bw = result["info"], result["copy_bandwidth"]
    lines = [
        f"# Backend comparison ({result['date']}, {info.get('name')}, {info['device']})",
        "",
        f"Copy bandwidth (device to device, read+write): **{bw['gbps']:.1f} GB/s**. "
        f"Shape: {result['shape']}. Time = median of CUDA-event (GPU) or wall (CPU) "
        "timings; GB/s = stored K/V bytes read / time; vs SDPA = time / SDPA time on a "
        "contiguous bfloat16 cache (for fp8 rows the baseline reads the dequantized cache).",
        "",
    ]
    for name, why in result["refused"].items():
        lines.append(f"- `{name}` not run: {'; '.join(why)}")
    header = "| batch | context | backend | time (ms) | KV GB/s | % copy BW | vs SDPA | max abs err | note |"  # fmt: skip
    for mode in ("decode", "prefill"):
        for kv in ("bf16", "fp8_e4m3", "auto"):
            rows = [r for r in result["rows"] if r["mode"] == mode and r["kv"] == kv]
            if not rows:
                continue
            lines += ["", f"## {mode}, KV {'bf16' if kv == 'auto' else kv}", "", header, "|" + "---|" * 9]  # fmt: skip
            for r in rows:
                s = r.get("seconds")
                cells = [
                    r["batch"], r["context"], r.get("backend", "-"),
                    f"{s * 1e3:.4g}" if s else "-", _fmt(r.get("kv_gbps"), ".4g"),
                    _fmt(r.get("pct_copy_bw"), ".3g"), _fmt(r.get("vs_sdpa"), ".2f"),
                    _fmt(r.get("max_abs_err"), ".2e"), r.get("skipped") or r.get("error") or "",
                ]  # fmt: skip
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    return "\n".join(lines)


def merge(parts: list[Path]) -> dict[str, Any]:
    """One result from per-backend runs (each run in its own process, so that a crash or
    a CUDA error of one backend cannot spoil the others): device, bandwidth and the SDPA
    rows come from the first part that has them; refusals and rows are united."""
    results = [json.loads((p / "backend_compare.json").read_text()) for p in parts if (p / "backend_compare.json").is_file()]  # fmt: skip
    if not results:
        raise SystemExit(f"--merge: expected backend_compare.json in {parts}, found none")
    merged = dict(results[0])
    merged["refused"] = {}
    merged["rows"] = []
    seen: set[tuple[Any, ...]] = set()
    for r in results:
        merged["refused"].update(r["refused"])
        for row in r["rows"]:
            k = (row["mode"], row["kv"], row["batch"], row["context"], row.get("backend"))
            if k not in seen:
                seen.add(k)
                merged["rows"].append(row)
    order = {"decode": 0, "prefill": 1}
    merged["rows"].sort(key=lambda r: (order[r["mode"]], r["kv"], r["batch"], r["context"]))
    merged["wall_seconds"] = sum(r["wall_seconds"] for r in results)
    merged["parts"] = [str(p) for p in parts]
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--backends", default="", help="comma list (default torch,triton,cupy,numba)")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting cases after")
    p.add_argument("--case-limit-s", type=float, default=2.0, help="skip calls predicted slower")
    p.add_argument("--mem-cap-gib", type=float, default=90.0, help="device memory cap per case")
    p.add_argument("--flop-cap", type=float, default=2e14, help="skip bigger prefill steps")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per call (GPU)")
    p.add_argument("--merge", nargs="+", default=None, help="combine these output folders")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.merge:
        result = merge([Path(m) for m in args.merge])
        out.mkdir(parents=True, exist_ok=True)
        (out / "backend_compare.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "backend_compare.md").write_text(markdown(result))
        print(f"[compare] merged {len(args.merge)} runs into {out}/backend_compare.json and .md")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("[compare] no CUDA device: use --dry-run for the CPU check", flush=True)
        return 2
    result = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backend_compare.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "backend_compare.md").write_text(markdown(result))
    print(f"[compare] wrote {out}/backend_compare.json and .md in {result['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
