"""Paged attention (torch backend) vs SDPA over a contiguous cache, same tokens, same run.

Shapes: Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128), block_size 16,
physical blocks a random permutation of the pool (a fragmented cache, the worst case
for locality). Decode: batch 1/16/64 x context 512/2048/8192, float32 and bfloat16;
the baseline is ``torch.nn.functional.scaled_dot_product_attention`` on K/V laid out
``[batch, kv_heads, context, head_dim]`` (what a contiguous cache gives), ``enable_gqa``.
Reported: time per layer call, paged/baseline speed ratio (>1 = paged faster), and GB/s
of KV read (K and V bytes of the context / time). Prefill: one sequence, causal, TFLOP/s
(4 * q_heads * head_dim * L^2 / 2 flops) vs SDPA ``is_causal``.

Script (the full sweep; prints a table, optional JSON lines)::

    .venv/bin/python benches/bench_attention.py [--threads 1] [--max-gb 3] [--json out.jsonl]

pytest-benchmark (the target point only: batch 16, context 2048, float32)::

    .venv/bin/python -m pytest benches/bench_attention.py --benchmark-enable
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.backends.torch_backend import TorchBackend
from kvpage.specs import make_attention_spec

HQ, HKV, D, BS = 32, 8, 128, 16
SPEC = make_attention_spec(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Setup:
    """One paged cache and the same tokens laid out contiguously."""

    cache: object
    meta: AttentionMetadata
    k: torch.Tensor  # [batch, kv_heads, L, D]
    v: torch.Tensor
    q: torch.Tensor  # [batch (or L), q_heads, D]


def make_setup(batch: int, ctx: int, dtype: torch.dtype, *, prefill: bool, seed: int = 0) -> Setup:
    g = torch.Generator().manual_seed(seed)
    nblk = -(-ctx // BS)
    num_blocks = batch * nblk + 1
    cache = allocate_kv_cache(num_blocks, BS, HKV, D, dtype=dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).view(batch, nblk)
    tables = perm.tolist()
    slots = (perm[:, :, None] * BS + torch.arange(BS)).view(batch, -1)[:, :ctx]
    k = cache.kv[0].view(-1, HKV, D)[slots].transpose(1, 2).contiguous()
    v = cache.kv[1].view(-1, HKV, D)[slots].transpose(1, 2).contiguous()
    if prefill:
        meta = AttentionMetadata.build([ctx] * batch, [ctx] * batch, tables, BS)
        q = torch.randn(batch * ctx, HQ, D, generator=g).to(dtype)
    else:
        meta = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, BS)
        q = torch.randn(batch, HQ, D, generator=g).to(dtype)
    return Setup(cache, meta, k, v, q)


def paged_fn(s: Setup, backend: TorchBackend, prefill: bool) -> Callable[[], torch.Tensor]:
    backend.plan(s.meta)  # once per step in the engine, shared by all layers
    out = torch.empty_like(s.q)
    if prefill:
        return lambda: backend.forward(s.q, s.cache, backend.plan(s.meta), SPEC, out=out)  # type: ignore[arg-type]
    return lambda: backend.forward(s.q, s.cache, backend.plan(s.meta), SPEC, out=out)  # type: ignore[arg-type]


def sdpa_fn(s: Setup, prefill: bool) -> Callable[[], torch.Tensor]:
    b = s.k.shape[0]
    if prefill:
        q = s.q.view(b, -1, HQ, D).transpose(1, 2).contiguous()
    else:
        q = s.q.view(b, HQ, 1, D)
    return lambda: F.scaled_dot_product_attention(
        q, s.k, s.v, is_causal=prefill, scale=SPEC.scale, enable_gqa=True
    )


def interleaved_min(
    fa: Callable[[], object], fb: Callable[[], object], reps: int
) -> tuple[float, float]:
    """Best-of-``reps`` seconds of each, alternating a and b so drift hits both."""
    fa(), fb()
    ta, tb = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t)
    return min(ta), min(tb)


def check_same(s: Setup, prefill: bool, backend: TorchBackend) -> float:
    a = paged_fn(s, backend, prefill)().float()
    b = sdpa_fn(s, prefill)()
    b = (b.transpose(1, 2).reshape(a.shape) if prefill else b.reshape(a.shape)).float()
    return float((a - b).abs().max())


def sweep(args: argparse.Namespace) -> list[dict[str, object]]:
    backend = TorchBackend()
    rows: list[dict[str, object]] = []
    for dname in args.dtypes:
        dt = DTYPES[dname]
        el = torch.finfo(dt).bits // 8
        for batch in args.batches:
            for ctx in args.contexts:
                kv_bytes = 2 * batch * ctx * HKV * D * el
                if 2 * kv_bytes > args.max_gb * 2**30:
                    rows.append(
                        dict(kind="decode", dtype=dname, batch=batch, ctx=ctx, skipped="memory")
                    )
                    continue
                s = make_setup(batch, ctx, dt, prefill=False)
                err = check_same(s, False, backend)
                tp, tb = interleaved_min(paged_fn(s, backend, False), sdpa_fn(s, False), args.reps)
                rows.append(
                    dict(
                        kind="decode",
                        dtype=dname,
                        batch=batch,
                        ctx=ctx,
                        paged_ms=tp * 1e3,
                        sdpa_ms=tb * 1e3,
                        ratio=tb / tp,
                        paged_gbs=kv_bytes / tp / 1e9,
                        sdpa_gbs=kv_bytes / tb / 1e9,
                        max_abs_diff=err,
                    )
                )
                print(fmt(rows[-1]), flush=True)
                del s
        for ctx in args.prefill_contexts:
            s = make_setup(1, ctx, dt, prefill=True)
            err = check_same(s, True, backend)
            tp, tb = interleaved_min(
                paged_fn(s, backend, True), sdpa_fn(s, True), max(1, args.reps // 2)
            )
            flops = 4 * HQ * D * ctx * ctx / 2
            rows.append(
                dict(
                    kind="prefill",
                    dtype=dname,
                    batch=1,
                    ctx=ctx,
                    paged_ms=tp * 1e3,
                    sdpa_ms=tb * 1e3,
                    ratio=tb / tp,
                    paged_tflops=flops / tp / 1e12,
                    sdpa_tflops=flops / tb / 1e12,
                    max_abs_diff=err,
                )
            )
            print(fmt(rows[-1]), flush=True)
    return rows


def fmt(r: dict[str, object]) -> str:
    head = f"{r['kind']:<7} {r['dtype']:<8} b={r['batch']:<3} L={r['ctx']:<5}"
    if "skipped" in r:
        return f"{head} skipped ({r['skipped']})"
    if r["kind"] == "decode":
        return (
            f"{head} paged {r['paged_ms']:8.2f} ms {r['paged_gbs']:6.2f} GB/s | sdpa "
            f"{r['sdpa_ms']:8.2f} ms {r['sdpa_gbs']:6.2f} GB/s | ratio {r['ratio']:.2f}x"
        )
    return (
        f"{head} paged {r['paged_ms']:8.2f} ms {r['paged_tflops']:.4f} TFLOP/s | sdpa "
        f"{r['sdpa_ms']:8.2f} ms {r['sdpa_tflops']:.4f} TFLOP/s | ratio {r['ratio']:.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--max-gb",
        type=float,
        default=3.0,
        help="skip points whose paged+contiguous KV exceeds this",
    )
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    p.add_argument("--prefill-contexts", nargs="*", type=int, default=[512, 2048])
    p.add_argument("--json", default=None, help="append JSON lines here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), block_size {BS}, random block permutation"
    )
    rows = sweep(args)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, threads=args.threads)) + "\n")


# ---- pytest-benchmark: the target point -------------------------------------------------
def _target(prefill: bool = False) -> Setup:
    return make_setup(16, 2048, torch.float32, prefill=prefill)


def test_decode_paged_b16_l2048(benchmark) -> None:  # type: ignore[no-untyped-def]
    s = _target()
    backend = TorchBackend()
    assert check_same(s, False, backend) < 1e-4
    benchmark.group = "decode b16 L2048 float32"
    benchmark(paged_fn(s, backend, False))


def test_decode_sdpa_b16_l2048(benchmark) -> None:  # type: ignore[no-untyped-def]
    s = _target()
    benchmark.group = "decode b16 L2048 float32"
    benchmark(sdpa_fn(s, False))


if __name__ == "__main__":
    main()
