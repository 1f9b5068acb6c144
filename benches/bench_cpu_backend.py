# ruff: noqa: I001  (kvpage is imported before torch on purpose)
"""CPU attention backends (``--backends``, default torch, numba-cpu and native-cpu) vs
the first one: one layer's attention call, same cache and step, alternating calls,
process CPU time and wall time per call.

Shapes (block_size 16, blocks a random permutation of the pool):
``hd32`` = stories260K-hd32 (8 query heads, 4 KV heads, head_dim 32) and ``125m`` =
the random ~125M Llama of ``bench_peers.py`` (12 query heads, 4 KV heads, head_dim 64);
decode = ``--seqs`` sequences, one new token each, contexts uniform in
[``--min-ctx``, ``--max-ctx``]; prefill = 8 prompts of 64-256 tokens, half of them with
a cached prefix of the same length.

    .venv/bin/python benches/bench_cpu_backend.py [--threads 1] [--dtype float32] \
        [--backends torch,numba-cpu,native-cpu] [--block-size 16]

``--engine MODEL_DIR``: instead, the whole engine with each backend in one process,
alternating (the first two of ``--backends``; the ``bench_peers.py`` workload file ``--workload``, first ``--seqs``
requests, outputs capped at ``--max-tokens``): tokens per CPU-second and where the
engine thread's CPU goes (attention ``forward``, ``write_kv``, ``plan``, the rest),
plus token-id equality of the two backends' outputs.
"""

from __future__ import annotations

import argparse
import os
import time

import kvpage  # noqa: F401  (before torch: sets OMP_WAIT_POLICY=PASSIVE for libgomp)
import torch

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.backends import get_backend
from kvpage.specs import make_attention_spec

SHAPES = {"hd32": (8, 4, 32), "125m": (12, 4, 64)}
BS = 16


def make_step(shape: str, dtype: torch.dtype, qlens: list[int], seqlens: list[int], seed: int):  # type: ignore[no-untyped-def]
    hq, hkv, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // BS) for s in seqlens]
    num_blocks = sum(nblk) + 1
    cache = allocate_kv_cache(num_blocks, BS, hkv, d, dtype=dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, at = [], 0
    for n in nblk:
        tables.append(perm[at : at + n])
        at += n
    meta = AttentionMetadata.build(
        query_lens=qlens, seq_lens=seqlens, block_tables=tables, block_size=BS
    )
    q = torch.randn(sum(qlens), hq, d, generator=g).to(dtype)
    spec = make_attention_spec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    return cache, meta, q, spec


def time_calls(backend, cache, meta, q, spec, reps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    plan = backend.plan(meta)
    out = torch.empty_like(q)
    backend.forward(q, cache, plan, spec, out)
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        plan = backend.plan(meta)
        backend.forward(q, cache, plan, spec, out)
    return (time.process_time() - c0) / reps, (time.perf_counter() - w0) / reps


def engine_ab(args: argparse.Namespace) -> None:
    import json

    from kvpage.engine import LLMEngine, SamplingParams

    with open(args.workload) as f:
        work = json.load(f)[: args.seqs]
    engines, spent = {}, {}
    names = args.backends.split(",")[:2]
    for name in names:
        eng = LLMEngine.from_config(
            model=args.engine, dtype=args.dtype, num_threads=args.threads, max_num_seqs=256,
            max_num_batched_tokens=2048, max_model_len=512, enable_prefix_caching=True,
            backend=name,
        )  # fmt: skip
        spent[name] = {"forward": 0.0, "write_kv": 0.0, "plan": 0.0}
        for method in spent[name]:
            orig = getattr(eng.backend, method)

            def timed(*a, _o=orig, _d=spent[name], _m=method, **k):  # type: ignore[no-untyped-def]
                t = time.thread_time()
                try:
                    return _o(*a, **k)
                finally:
                    _d[_m] += time.thread_time() - t

            setattr(eng.backend, method, timed)
        engines[name] = eng

    def run(eng):  # type: ignore[no-untyped-def]
        for i, (p, m) in enumerate(work):
            sp = SamplingParams(
                max_tokens=min(m, args.max_tokens), ignore_eos=True, temperature=0.0
            )
            eng.add_request(f"r{i}-{time.perf_counter_ns()}", p, sp)
        ids = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    ids[o.request_id.split("-")[0]] = list(o.outputs[0].token_ids)
        return ids

    outs = {n: run(e) for n, e in engines.items()}  # warm-up (and any compile)
    same = sum(outs[names[0]][k] == outs[names[1]][k] for k in outs[names[0]])
    print(
        f"engine {args.engine} {args.dtype} threads={args.threads}: equal outputs {same}/{len(work)}"
    )
    for r in range(args.rounds):
        for name, eng in engines.items():
            for k in spent[name]:
                spent[name][k] = 0.0
            c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            ids = run(eng)
            cpu, thr, wall = (
                time.process_time() - c0,
                time.thread_time() - t0,
                time.perf_counter() - w0,
            )
            toks = sum(len(v) for v in ids.values())
            sh = {k: v / thr * 100 for k, v in spent[name].items()}
            print(
                f"round {r} {name:10s}: {toks / cpu:6.0f} tok/CPU-s {toks / wall:6.0f} tok/s; engine "
                f"thread CPU {thr:.2f} s: attention {sh['forward']:.0f} %, write_kv "
                f"{sh['write_kv']:.0f} %, plan {sh['plan']:.0f} %, rest "
                f"{100 - sum(sh.values()):.0f} %; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seqs", type=int, default=200)
    p.add_argument("--min-ctx", type=int, default=32)
    p.add_argument("--max-ctx", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--engine", default=None, help="model folder: engine A/B instead")
    p.add_argument("--workload", default="out/peers/workload-200-0.json")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--backends", default="torch,numba-cpu,native-cpu", help="first = baseline")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    global BS
    BS = args.block_size
    if args.engine:
        return engine_ab(args)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(args.min_ctx, args.max_ctx + 1, (args.seqs,), generator=g).tolist()
    plens = torch.randint(64, 257, (8,), generator=g).tolist()
    steps = {
        "decode": ([1] * args.seqs, ctx),
        "prefill": (plens, [p * (1 + i % 2) for i, p in enumerate(plens)]),
    }
    backends = {n: get_backend(n) for n in args.backends.split(",")}
    base = next(iter(backends))
    print(
        f"threads={args.threads} dtype={args.dtype} block_size={BS} load={os.getloadavg()}; "
        f"ms of CPU (wall) per call, ratio = {base} CPU / backend CPU"
    )
    for shape in args.shapes.split(","):
        for kind, (ql, sl) in steps.items():
            cache, meta, q, spec = make_step(shape, dtype, ql, sl, 0)
            outs = {n: b.forward(q, cache, b.plan(meta), spec) for n, b in backends.items()}
            err = {n: (outs[base].float() - o.float()).abs().max().item() for n, o in outs.items()}
            for r in range(args.rounds):
                res = {
                    n: time_calls(b, cache, meta, q, spec, args.reps) for n, b in backends.items()
                }
                cols = "  ".join(
                    f"{n} {c * 1e3:7.2f} ({w * 1e3:7.2f}) {res[base][0] / c:5.2f}x "
                    f"|diff| {err[n]:.0e}"
                    for n, (c, w) in res.items()
                )
                print(f"{shape:5s} {kind:8s} round {r}: {cols}", flush=True)


if __name__ == "__main__":
    main()
