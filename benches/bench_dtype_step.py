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

``--inproc``: instead, one process, one engine per dtype at batch ``B`` (``--batches``),
the linears' dispatch settings toggled every round between the old rule (oneDNN
from ``PACK_MIN_MACS`` multiply-adds for both dtypes, no float32 row floor) and the
current one (``PACK_MIN_MACS_BF16``, ``PACK_MIN_ROWS_FP32``): process CPU ms per
decode step, median of ``--rounds``, and the ratio new / old per round.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benches/bench_dtype_step.py --trees
base=/tmp/base/src,new=src [--dtypes float32,bfloat16] [--batches 1,64] [--threads 1,2]
[--rounds 3] [--steps 16] [--out out/dtype_step.json]``.
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


def inproc(dtypes: list[str], batches: list[int], rounds: int, steps: int) -> None:
    """The ``--inproc`` mode (module docstring): prints one JSON line per dtype/batch."""
    import torch

    sys.path.insert(0, str(HERE))
    from roofline import _model_folder

    from kvpage.engine import LLM, SamplingParams
    from kvpage.models import linears as L

    new = (L.PACK_MIN_MACS_BF16, L.PACK_MIN_ROWS_FP32)
    old = (L.PACK_MIN_MACS, 0)
    for dtype in dtypes:
        llm = LLM(model=_model_folder("llama125m"), dtype=dtype, enable_prefix_caching=False)
        torch.set_num_threads(1)
        eng = llm.llm_engine
        for batch in batches:
            res: dict[str, list[float]] = {"old": [], "new": []}
            for rnd in range(rounds):
                for name in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
                    L.PACK_MIN_MACS_BF16, L.PACK_MIN_ROWS_FP32 = old if name == "old" else new
                    p = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
                    for i in range(batch):
                        eng.add_request(f"{name}{rnd}-{i}", [1, 5 + i % 50, 6, 7, 8], p)
                    eng.step()
                    eng.step()
                    c0 = time.process_time()
                    for _ in range(steps):
                        eng.step()
                    res[name].append(1e3 * (time.process_time() - c0) / steps)
                    while eng.has_unfinished_requests():
                        eng.step()
            ratios = [n / o for n, o in zip(res["new"], res["old"])]
            print(
                json.dumps(
                    {
                        "dtype": dtype,
                        "batch": batch,
                        "old_cpu_ms": round(statistics.median(res["old"]), 2),
                        "new_cpu_ms": round(statistics.median(res["new"]), 2),
                        "ratio_new_old": [round(r, 3) for r in ratios],
                        "ratio_median": round(statistics.median(ratios), 3),
                        "load": round(os.getloadavg()[0], 1),
                    }
                ),
                flush=True,
            )
        L.PACK_MIN_MACS_BF16, L.PACK_MIN_ROWS_FP32 = new
        del llm


def run_child(src: str, dtype: str, batch: int, threads: int, steps: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{Path(src).resolve()}:{ROOT / 'backends'}"
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
    a = ap.parse_args()
    if a.inproc:
        batches = [int(b) for b in a.batches.split(",")]
        inproc(a.dtypes.split(","), batches, a.rounds, a.steps)
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
