"""This machine's roofline (memory bandwidth, matmul peak) and the engine's decode step
against it (issue 28).

Measured with torch on the CPU, at each ``--threads`` count (``torch.set_num_threads``):

* **read bandwidth**: ``x.sum()`` over a ``--mb`` MB float32 tensor (bytes read / time);
  **copy bandwidth**: ``dst.copy_(src)`` of the same size (bytes read + written / time).
* **matmul peak**: ``a @ b`` of ``--n`` x ``--n`` float32 and bfloat16 matrices
  (``2 n^3`` FLOP / time; bfloat16 goes through oneDNN, AMX where the CPU has it).

Each is the best (least time) of ``--reps`` runs after a warm-up: the peak the machine
reaches, the right denominator for "fraction of bound" on a box shared with other jobs.

Then for each model (``stories260K``, the bundled 0.26M-parameter llama2.c model, and
``llama125m``, the random-weight Llama of ``benches/bench_peers.py``: hidden 768, 12
layers, 12/4 heads, vocab 32000, untied) and batch size (``--batches``), the engine
decodes ``B`` sequences (5-token prompts, greedy, ``ignore_eos``) and reports the
median wall time of ``--steps`` pure decode steps (``LLMEngine.step``) next to:

* **bandwidth bound** = (weight bytes + KV bytes) / read bandwidth: weight bytes = every
  parameter tensor the step reads in full (all linears and norms, the lm_head; the
  input embedding only when it is tied to the lm_head, since a step reads just B rows
  of it); KV bytes = the sequences' context tokens x ``CacheSpec.bytes_per_token``;
* **compute bound** = step FLOP / matmul peak of the model's dtype: ``2 x`` (linear
  parameters incl. the lm_head) ``x B`` plus attention ``4 x context x num_heads x
  head_dim x layers`` per sequence (QK^T and PV);
* ``bound / step`` for each (1.0 = at the limit) and the **fixed cost** = step time minus
  the matmul time inside the step (self CPU time of ``aten::mm`` / ``aten::addmm`` /
  ``aten::bmm`` / ``mkldnn::_linear_pointwise`` under ``torch.profiler`` over the same
  steps, so the profiler's own per-op overhead is not in the step time it is
  subtracted from).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benches/roofline.py [--threads 1,2]
[--batches 1,8] [--models stories260K,llama125m] [--dtypes float32,bfloat16]
[--out out/roofline.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import kvpage  # noqa: F401  (sets OMP_WAIT_POLICY before torch starts its threads)

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")


def _best(fn: Any, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def machine_limits(mb: int, n: int, reps: int) -> dict[str, float]:
    """Read / copy bandwidth (GB/s) and fp32 / bf16 matmul peak (GFLOP/s) at the
    current torch thread count (see the module docstring)."""
    numel = mb * 2**20 // 4
    x = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(x)
    nbytes = x.numel() * 4
    read = nbytes / _best(lambda: x.sum(), reps) / 1e9
    copy = 2 * nbytes / _best(lambda: dst.copy_(x), reps) / 1e9
    out: dict[str, float] = {"read_gb_s": read, "copy_gb_s": copy}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        out[f"matmul_{name}_gflop_s"] = 2 * n**3 / _best(lambda a=a, b=b: a @ b, reps) / 1e9
    return out


def _model_folder(name: str) -> str:
    """``stories260K`` or the folder of ``bench_peers.py``'s random ``llama125m``."""
    if name == "stories260K":
        return name
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_peers import prepare_model

    work = Path(os.environ.get("KVPAGE_ROOFLINE_DIR", Path(tempfile.gettempdir()) / "kvpage_rf"))
    return str(prepare_model(name, work))


def model_bytes_flops(model: Any) -> tuple[int, int]:
    """``(weight bytes read per step, linear parameters)`` of a ``ModelRunnerModel``
    (see the module docstring: the untied input embedding is not counted)."""
    emb = model.model.embed_tokens.weight
    tied = model.lm_head is None
    seen: set[int] = set()
    nbytes = 0
    linear = 0
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            if p is emb and not tied:
                continue
            nbytes += p.numel() * p.element_size()
            if p.dim() == 2:
                linear += p.numel()
    return nbytes, linear


def decode_steps(
    llm: Any, batch: int, steps: int, profile: bool
) -> tuple[list[float], int, float | None]:
    """Run ``batch`` sequences into decode, then ``steps`` decode steps: ``(step
    seconds, mean context tokens over the steps, matmul seconds per step or None)``."""
    from kvpage.engine import SamplingParams

    eng = llm.llm_engine
    p = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"s{i}", [1, 5 + i % 50, 6, 7, 8], p)
    eng.step()  # prefill
    eng.step()
    ctx = []
    times = []
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    for _ in range(steps):
        ctx.append(sum(r.num_computed_tokens + 1 for r in eng.scheduler.running))
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    mm = None
    if prof is not None:
        prof.__exit__(None, None, None)
        tot = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS)
        mm = tot / 1e6 / steps
    while eng.has_unfinished_requests():
        eng.step()
    return times, int(statistics.mean(ctx)), mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--models", default="stories260K,llama125m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out/roofline.json")
    a = ap.parse_args()
    from kvpage.engine import LLM

    rows: list[dict[str, Any]] = []
    limits: dict[int, dict[str, float]] = {}
    for th in [int(t) for t in a.threads.split(",")]:
        torch.set_num_threads(th)
        lim = machine_limits(a.mb, a.n, a.reps)
        limits[th] = lim
        print(json.dumps({"threads": th, **{k: round(v, 1) for k, v in lim.items()}}), flush=True)
        for name in a.models.split(","):
            folder = _model_folder(name)
            for dtype in a.dtypes.split(","):
                llm = LLM(model=folder, dtype=dtype, enable_prefix_caching=False, num_threads=th)
                torch.set_num_threads(th)
                eng = llm.llm_engine
                wbytes, linear = model_bytes_flops(eng.model)
                spec = eng.cache_spec
                heads = int(eng.model.arch.num_q_heads)
                hd = int(eng.model.arch.head_dim)
                layers = int(eng.model.arch.num_layers)
                peak = lim["matmul_bf16_gflop_s" if dtype == "bfloat16" else "matmul_fp32_gflop_s"]
                for batch in [int(b) for b in a.batches.split(",")]:
                    times, ctx, _ = decode_steps(llm, batch, a.steps, profile=False)
                    _, _, mm = decode_steps(llm, batch, a.steps, profile=True)
                    step = statistics.median(times)
                    kv = ctx * spec.bytes_per_token
                    bw_s = (wbytes + kv) / (lim["read_gb_s"] * 1e9)
                    flop = 2 * linear * batch + 4 * ctx * heads * hd * layers
                    fl_s = flop / (peak * 1e9)
                    row = {
                        "threads": th,
                        "model": name,
                        "dtype": dtype,
                        "batch": batch,
                        "step_ms": round(1e3 * step, 3),
                        "tok_s": round(batch / step, 1),
                        "weight_mb": round(wbytes / 1e6, 2),
                        "kv_mb": round(kv / 1e6, 3),
                        "bandwidth_bound_ms": round(1e3 * bw_s, 3),
                        "compute_bound_ms": round(1e3 * fl_s, 3),
                        "frac_of_bandwidth_bound": round(bw_s / step, 3),
                        "frac_of_compute_bound": round(fl_s / step, 3),
                        "matmul_ms": None if mm is None else round(1e3 * mm, 3),
                        "fixed_ms": None if mm is None else round(1e3 * (step - mm), 3),
                        "load": round(os.getloadavg()[0], 1),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del llm
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mb": a.mb,
        "n": a.n,
        "reps": a.reps,
        "steps": a.steps,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "limits": limits, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
