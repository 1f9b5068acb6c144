"""Decode-step cost of two source trees, alternating, against this machine's roofline
(issue 28: bf16 at batch and the batch-1 step).

For each round and each configuration (``--dtypes`` x ``--batches`` x ``--threads``)
the trees of ``--trees`` (``name=path/to/src``, e.g. the base commit's ``src`` extracted
with ``git archive`` and this tree's) run one after the other, each in its own process
with ``PYTHONPATH=<src>:<this repo's backends>``: the engine (``LLM``, prefix caching off)
on ``benches/bench_peers.py``'s ``llama125m`` random-weight Llama decodes ``B``
sequences (5-token prompts, greedy, ``ignore_eos``) into decode, then times ``--steps``
pure decode steps (``LLMEngine.step``): median wall ms per step and tokens per process
CPU-second (``time.process_time`` over the steps). The bound beside each is
``benches/roofline.py``'s, from limits measured once per thread count in this process
at the start: bandwidth bound = (weight bytes + KV bytes) / read bandwidth, compute
bound = step FLOP / matmul peak of the dtype; fraction = max(bandwidth, compute bound) /
median step (1.0 = at the limit).

Each tree's ``backends`` folder beside its ``src`` is used when it has one (a ``git
archive`` of a commit does), else this repo's.

``--inproc``: instead, one process, one engine per dtype and thread count at batch ``B``
(``--batches``), a setting toggled every round between its old and current form
(``--toggle``):

* ``linears``: the linears' dispatch: the old rule (oneDNN from ``PACK_MIN_MACS``
  multiply-adds for both dtypes, no float32 row floor) vs the current one
  (``PACK_MIN_MACS_BF16``, ``PACK_MIN_ROWS_FP32``);
* ``layer_ops``: the bf16 layer ops and the logits path: old = the backend's C layer
  ops for float32 only (bf16 on the model's torch ops), no deferred residual adds
  (``DecoderLayer.forward_deferred``), float32 logits from the model and the sampler's
  torch argmax; new = the C ops in both dtypes, deferred adds, the runner's logits
  uncast and the backend's argmax (``GreedyOps``).

Per round: process CPU ms and median wall ms per decode step; printed: medians of
``--rounds``, the ratio new / old per round (CPU and wall), and the bound of the step
(as above, limits measured once per thread count at the start) with the fraction of
it by wall and by CPU time (bound / CPU ms per step).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benches/bench_dtype_step.py --trees
base=/tmp/base/src,new=src [--dtypes float32,bfloat16] [--batches 1,64] [--threads 1,2]
[--rounds 3] [--steps 16] [--out out/dtype_step.json]``; ``--inproc --toggle layer_ops``
with the same options.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child(dtype: str, batch: int, threads: int, steps: int) -> dict[str, Any]:
    """One measurement in this process (the ``--child`` mode)."""
    import torch

    sys.path.insert(0, str(HERE))
    from roofline import _model_folder, model_bytes_flops

    from kvpage.engine import LLM, SamplingParams

    llm = LLM(
        model=_model_folder("llama125m"),
        dtype=dtype,
        enable_prefix_caching=False,
        num_threads=threads,
    )
    torch.set_num_threads(threads)
    eng = llm.llm_engine
    p = SamplingParams(temperature=0.0, max_tokens=steps + 6, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"s{i}", [1, 5 + i % 50, 6, 7, 8], p)
    eng.step()  # prefill
    eng.step()
    eng.step()
    ctx, times = [], []
    c0 = time.process_time()
    for _ in range(steps):
        ctx.append(sum(r.num_computed_tokens + 1 for r in eng.scheduler.running))
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - c0
    wbytes, linear = model_bytes_flops(eng.model)
    arch = eng.model.arch
    return {
        "step_ms": 1e3 * statistics.median(times),
        "tok_per_cpu_s": batch * steps / cpu,
        "weight_bytes": wbytes,
        "kv_bytes": statistics.mean(ctx) * eng.cache_spec.bytes_per_token,
        "flop": 2 * linear * batch
        + 4 * statistics.mean(ctx) * arch.num_q_heads * arch.head_dim * arch.num_layers,
        "load": os.getloadavg()[0],
    }


def _toggle(eng: Any, which: str, name: str, keep: dict[str, Any]) -> None:
    """Put engine ``eng`` in the ``old`` or ``new`` form of setting ``which`` (the
    module docstring); ``keep`` holds the current forms, filled on the first call."""
    import torch

    from kvpage.models import linears as L

    if which == "linears":
        keep.setdefault("lin", (L.PACK_MIN_MACS_BF16, L.PACK_MIN_ROWS_FP32))
        old = (L.PACK_MIN_MACS, 0)
        L.PACK_MIN_MACS_BF16, L.PACK_MIN_ROWS_FP32 = old if name == "old" else keep["lin"]
        return
    model, be = eng.model, eng.backend
    keep.setdefault("defer", model._defer_residual)
    keep.setdefault("greedy", eng.sampler._greedy)
    for attr in ("layer_ops", "forward"):  # instance overrides of the old form
        for obj in (be, model):
            if attr in vars(obj):
                delattr(obj, attr)
    model._defer_residual, eng.sampler._greedy = keep["defer"], keep["greedy"]
    if name == "old":
        ops, fwd = be.layer_ops, model.forward

        def f32_ops(dtype: torch.dtype, device: torch.device) -> Any:
            return ops(dtype, device) if dtype == torch.float32 else None

        def float_forward(*a: Any, **kw: Any) -> Any:
            kw["float_logits"] = True
            return fwd(*a, **kw)

        be.layer_ops, model.forward = f32_ops, float_forward
        model._defer_residual, eng.sampler._greedy = False, None


def inproc(
    dtypes: list[str], batches: list[int], threads: list[int], rounds: int, steps: int, which: str
) -> list[dict[str, Any]]:
    """The ``--inproc`` mode (module docstring): one JSON line per configuration."""
    import torch

    sys.path.insert(0, str(HERE))
    from roofline import _model_folder, machine_limits, model_bytes_flops

    from kvpage.engine import LLM, SamplingParams

    rows_out: list[dict[str, Any]] = []
    for th in threads:
        torch.set_num_threads(th)
        lim = machine_limits(256, 2048, 3)
        print(json.dumps({"threads": th, **{k: round(v, 1) for k, v in lim.items()}}), flush=True)
        for dtype in dtypes:
            llm = LLM(
                model=_model_folder("llama125m"),
                dtype=dtype,
                enable_prefix_caching=False,
                num_threads=th,
            )
            torch.set_num_threads(th)
            eng = llm.llm_engine
            wbytes, linear = model_bytes_flops(eng.model)
            arch = eng.model.arch
            peak = lim["matmul_bf16_gflop_s" if dtype == "bfloat16" else "matmul_fp32_gflop_s"]
            keep: dict[str, Any] = {}
            for batch in batches:
                cpu: dict[str, list[float]] = {"old": [], "new": []}
                wall: dict[str, list[float]] = {"old": [], "new": []}
                ctx: list[float] = []
                loads = []
                for rnd in range(rounds):
                    for name in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
                        _toggle(eng, which, name, keep)
                        p = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
                        for i in range(batch):
                            eng.add_request(f"{name}{rnd}-{i}", [1, 5 + i % 50, 6, 7, 8], p)
                        eng.step()
                        eng.step()
                        times = []
                        c0 = time.process_time()
                        for _ in range(steps):
                            ctx.append(
                                sum(r.num_computed_tokens + 1 for r in eng.scheduler.running)
                            )
                            t0 = time.perf_counter()
                            eng.step()
                            times.append(time.perf_counter() - t0)
                        cpu[name].append(1e3 * (time.process_time() - c0) / steps)
                        wall[name].append(1e3 * statistics.median(times))
                        loads.append(os.getloadavg()[0])
                        while eng.has_unfinished_requests():
                            eng.step()
                _toggle(eng, which, "new", keep)
                c = statistics.mean(ctx)
                bw_ms = (
                    1e3 * (wbytes + c * eng.cache_spec.bytes_per_token) / (lim["read_gb_s"] * 1e9)
                )
                flop = (
                    2 * linear * batch + 4 * c * arch.num_q_heads * arch.head_dim * arch.num_layers
                )
                fl_ms = 1e3 * flop / (peak * 1e9)
                bound = max(bw_ms, fl_ms)
                med = {k: statistics.median(v) for k, v in (*cpu.items(), *(("w" + k, v) for k, v in wall.items()))}  # fmt: skip
                row = {
                    "toggle": which,
                    "threads": th,
                    "dtype": dtype,
                    "batch": batch,
                    "old_cpu_ms": round(med["old"], 2),
                    "new_cpu_ms": round(med["new"], 2),
                    "old_wall_ms": round(med["wold"], 2),
                    "new_wall_ms": round(med["wnew"], 2),
                    "ratio_cpu": [round(n / o, 3) for n, o in zip(cpu["new"], cpu["old"])],
                    "ratio_wall": [round(n / o, 3) for n, o in zip(wall["new"], wall["old"])],
                    "bandwidth_bound_ms": round(bw_ms, 2),
                    "compute_bound_ms": round(fl_ms, 2),
                    "frac_wall_old_new": [
                        round(bound / med["wold"], 3),
                        round(bound / med["wnew"], 3),
                    ],
                    "frac_cpu_old_new": [
                        round(bound / med["old"], 3),
                        round(bound / med["new"], 3),
                    ],
                    "load": [round(min(loads), 1), round(max(loads), 1)],
                }
                rows_out.append(row)
                print(json.dumps(row), flush=True)
            del llm, eng
    return rows_out


def run_child(src: str, dtype: str, batch: int, threads: int, steps: int) -> dict[str, Any]:
    env = dict(os.environ)
    own = Path(src).resolve().parent / "backends"
    env["PYTHONPATH"] = f"{Path(src).resolve()}:{own if own.is_dir() else ROOT / 'backends'}"
    env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, __file__, "--child", f"{dtype},{batch},{threads},{steps}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default="")
    ap.add_argument("--trees", default="")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="out/dtype_step.json")
    ap.add_argument("--inproc", action="store_true")
    ap.add_argument("--toggle", default="linears", choices=("linears", "layer_ops"))
    a = ap.parse_args()
    if a.inproc:
        batches = [int(b) for b in a.batches.split(",")]
        threads = [int(t) for t in a.threads.split(",")]
        rows = inproc(a.dtypes.split(","), batches, threads, a.rounds, a.steps, a.toggle)
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1)
        )
        return
    if a.child:
        d, b, t, s = a.child.split(",")
        print(json.dumps(child(d, int(b), int(t), int(s))))
        return
    import torch

    sys.path.insert(0, str(HERE))
    from roofline import machine_limits

    trees = dict(kv.split("=", 1) for kv in a.trees.split(","))
    threads = [int(t) for t in a.threads.split(",")]
    limits = {}
    for th in threads:
        torch.set_num_threads(th)
        limits[th] = machine_limits(256, 2048, 3)
        print(json.dumps({"threads": th, **{k: round(v, 1) for k, v in limits[th].items()}}))
    rows: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        for th in threads:
            for dtype in a.dtypes.split(","):
                for batch in [int(b) for b in a.batches.split(",")]:
                    names = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
                    for name in names:
                        r = run_child(trees[name], dtype, batch, th, a.steps)
                        lim = limits[th]
                        peak = lim[
                            "matmul_bf16_gflop_s" if dtype == "bfloat16" else "matmul_fp32_gflop_s"
                        ]
                        bw_ms = 1e3 * (r["weight_bytes"] + r["kv_bytes"]) / (lim["read_gb_s"] * 1e9)
                        fl_ms = 1e3 * r["flop"] / (peak * 1e9)
                        row = {
                            "round": rnd,
                            "tree": name,
                            "threads": th,
                            "dtype": dtype,
                            "batch": batch,
                            "step_ms": round(r["step_ms"], 2),
                            "tok_s": round(batch / r["step_ms"] * 1e3, 1),
                            "tok_per_cpu_s": round(r["tok_per_cpu_s"], 1),
                            "bandwidth_bound_ms": round(bw_ms, 2),
                            "compute_bound_ms": round(fl_ms, 2),
                            "frac_of_bound": round(max(bw_ms, fl_ms) / r["step_ms"], 3),
                            "load": round(r["load"], 1),
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "trees": trees,
        "steps": a.steps,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "limits": limits, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
