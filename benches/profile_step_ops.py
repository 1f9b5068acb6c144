"""Where a decode step's CPU time goes, by kind of op (``torch.profiler``), on
``benches/bench_peers.py``'s ``llama125m`` (issue 28).

The engine (``LLM``, prefix caching off, one thread) decodes ``--batch`` sequences
(5-token prompts, greedy, ``ignore_eos``); after 2 warm steps, ``--steps`` decode steps
are timed unprofiled (median wall ms) and ``--steps`` more are profiled. Each op's self
CPU time is put in one bucket: ``lm_head`` (a matmul whose weight has ``vocab_size``
rows), ``linears`` (every other ``aten::mm``/``addmm``/``mkldnn::_linear_pointwise``),
``logits`` (ops on ``[rows, vocab_size]`` tensors other than the lm_head: the float32
cast, the sampler's ``argmax``), ``casts`` (``aten::to``/``_to_copy``/``copy_``/
``empty_strided`` on other shapes: dtype round trips and copies), ``other ops`` (the
rest: norms, RoPE, SiLU, adds, attention's C calls appear under ``other ops`` as their
torch wrappers); ``outside ops`` = the unprofiled median step minus the profiled op
total per step (Python, scheduler, sampler bookkeeping; approximate, since profiled and
unprofiled steps run at different times). Milliseconds per step.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benches/profile_step_ops.py --dtype
bfloat16 --batch 64 [--steps 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MATMUL = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")
CASTS = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::empty_strided")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from roofline import _model_folder

    from kvpage.engine import LLM, SamplingParams

    llm = LLM(model=_model_folder("llama125m"), dtype=a.dtype, enable_prefix_caching=False)
    torch.set_num_threads(1)
    eng = llm.llm_engine
    vocab = int(eng.model.arch.vocab_size)
    p = SamplingParams(temperature=0.0, max_tokens=2 * a.steps + 6, ignore_eos=True)
    for i in range(a.batch):
        eng.add_request(f"s{i}", [1, 5 + i % 50, 6, 7, 8], p)
    eng.step()
    eng.step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(a.steps):
            eng.step()
    buckets = dict.fromkeys(("linears", "lm_head", "logits", "casts", "other ops"), 0.0)
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = [list(s) for s in e.input_shapes if isinstance(s, list)]
        wide = any(len(s) == 2 and s[-1] == vocab for s in shapes)
        if e.key in MATMUL:
            head = any(vocab in s for s in shapes[1:2])
            key = "lm_head" if head else "linears"
        elif wide:
            key = "logits"
        elif e.key in CASTS:
            key = "casts"
        else:
            key = "other ops"
        buckets[key] += e.self_cpu_time_total / 1e3 / a.steps
    step = 1e3 * statistics.median(times)
    row = {
        "dtype": a.dtype,
        "batch": a.batch,
        "step_ms": round(step, 2),
        **{k: round(v, 2) for k, v in buckets.items()},
        "outside ops": round(step - sum(buckets.values()), 2),
        "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
