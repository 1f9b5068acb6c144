# ruff: noqa: I001  (kvpage is imported before torch on purpose)
"""numba-cpu vs the torch backend on CPU: one layer's attention call, same cache and
step, alternating calls, process CPU time and wall time per call.

Shapes (block_size 16, blocks a random permutation of the pool):
``hd32`` = stories260K-hd32 (8 query heads, 4 KV heads, head_dim 32) and ``125m`` =
the random ~125M Llama of ``bench_peers.py`` (12 query heads, 4 KV heads, head_dim 64);
decode = ``--seqs`` sequences, one new token each, contexts uniform in
[``--min-ctx``, ``--max-ctx``]; prefill = 8 prompts of 64-256 tokens, half of them with
a cached prefix of the same length.

    .venv/bin/python benches/bench_cpu_backend.py [--threads 1] [--dtype float32]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seqs", type=int, default=200)
    p.add_argument("--min-ctx", type=int, default=32)
    p.add_argument("--max-ctx", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(args.min_ctx, args.max_ctx + 1, (args.seqs,), generator=g).tolist()
    plens = torch.randint(64, 257, (8,), generator=g).tolist()
    steps = {
        "decode": ([1] * args.seqs, ctx),
        "prefill": (plens, [p * (1 + i % 2) for i, p in enumerate(plens)]),
    }
    backends = {n: get_backend(n) for n in ("torch", "numba-cpu")}
    print(f"threads={args.threads} dtype={args.dtype} load={os.getloadavg()}")
    for shape in SHAPES:
        for kind, (ql, sl) in steps.items():
            cache, meta, q, spec = make_step(shape, dtype, ql, sl, 0)
            ref = backends["torch"].forward(q, cache, backends["torch"].plan(meta), spec)
            got = backends["numba-cpu"].forward(q, cache, backends["numba-cpu"].plan(meta), spec)
            err = (ref.float() - got.float()).abs().max().item()
            for r in range(args.rounds):
                res = {
                    n: time_calls(b, cache, meta, q, spec, args.reps) for n, b in backends.items()
                }
                t, n = res["torch"], res["numba-cpu"]
                print(
                    f"{shape:5s} {kind:8s} round {r}: torch {t[0] * 1e3:8.2f} ms CPU "
                    f"({t[1] * 1e3:8.2f} wall)  numba-cpu {n[0] * 1e3:8.2f} ms CPU "
                    f"({n[1] * 1e3:8.2f} wall)  torch/numba CPU {t[0] / n[0]:5.2f}x "
                    f"wall {t[1] / n[1]:5.2f}x  max|diff| {err:.1e}"
                )


if __name__ == "__main__":
    main()
