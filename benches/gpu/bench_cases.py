"""Cases of the backend comparison: paged caches, step metadata, the contiguous SDPA
baseline, timing and the device-to-device copy bandwidth.

Used by ``backend_compare.py``; no kvpage backend is imported here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_kv_cache
from kvpage.specs import AttentionSpec, make_attention_spec


@dataclass(frozen=True)
class Shape:
    """Attention shape of the comparison (Llama-3-8B on a GPU; tiny in a dry run)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    prefill_chunk: int  # new tokens per sequence in a prefill step (chunked prefill)

    def spec(self) -> AttentionSpec:
        return make_attention_spec(
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim
        )


LLAMA3_8B = Shape(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, prefill_chunk=256)
TINY = Shape(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, prefill_chunk=3)


@dataclass
class Case:
    """One benchmark case, materialized on a device."""

    mode: str  # "decode" | "prefill"
    kv_dtype: str  # "auto" (bfloat16) | "fp8_e4m3"
    batch: int
    context: int
    shape: Shape
    cache: KVCache
    meta: AttentionMetadata
    query: torch.Tensor  # [num_tokens, Hq, D] bfloat16
    k_contig: torch.Tensor  # [batch, Hkv, context, D] bfloat16 (dequantized)
    v_contig: torch.Tensor

    @property
    def query_len(self) -> int:
        return 1 if self.mode == "decode" else min(self.shape.prefill_chunk, self.context)

    @property
    def kv_bytes(self) -> int:
        """Bytes of stored K and V the step reads (each cached token once)."""
        sh = self.shape
        elem = self.cache.kv.element_size()
        return 2 * self.batch * self.context * sh.num_kv_heads * sh.head_dim * elem


def case_bytes(shape: Shape, batch: int, context: int, kv_dtype: str) -> int:
    """Device bytes a case needs: paged cache + bf16 contiguous baseline (+ slack)."""
    elem = 1 if kv_dtype.startswith("fp8") else 2
    per_tok = 2 * shape.num_kv_heads * shape.head_dim
    return batch * context * per_tok * (elem + 2) + batch * shape.prefill_chunk * shape.num_q_heads * shape.head_dim * 16  # fmt: skip


def case_flops(shape: Shape, mode: str, batch: int, context: int) -> float:
    """Attention FLOPs of a step (QK^T and PV, 2 flops per multiply-add)."""
    q = 1 if mode == "decode" else min(shape.prefill_chunk, context)
    return 4.0 * batch * q * context * shape.num_q_heads * shape.head_dim


def make_case(
    mode: str, kv_dtype: str, batch: int, context: int, shape: Shape, device: torch.device, seed: int = 0
) -> Case:  # fmt: skip
    """Random K/V in a paged cache whose block ids are a random permutation (block 0
    unused, as the null block), the step metadata, and the same K/V contiguous."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    bs, hkv, d = shape.block_size, shape.num_kv_heads, shape.head_dim
    per_seq = -(-context // bs)
    nb = batch * per_seq + 1
    ids = (torch.randperm(nb - 1, generator=g) + 1).view(batch, per_seq)
    cache = allocate_kv_cache(
        nb, bs, hkv, d, dtype=torch.bfloat16, kv_dtype=kv_dtype, device=device,
        k_scale=0.5, v_scale=0.25,
    )  # fmt: skip
    torch.manual_seed(seed)
    for i in range(2):  # fill per K/V plane to bound the float32 temporary
        x = torch.randn((nb, bs, hkv, d), device=device, dtype=torch.bfloat16)
        cache.kv[i].copy_(x.to(cache.kv.dtype))
        del x
    qlen = 1 if mode == "decode" else min(shape.prefill_chunk, context)
    tables = ids.tolist()
    meta = AttentionMetadata.build([qlen] * batch, [context] * batch, tables, bs, device=device)
    query = torch.randn(meta.num_tokens, shape.num_q_heads, d, device=device, dtype=torch.bfloat16)
    idx = ids.to(device)
    contig = []
    for i, s in enumerate((cache.k_scale, cache.v_scale)):
        plane = cache.kv[i][idx].reshape(batch, per_seq * bs, hkv, d)[:, :context]
        plane = plane.to(torch.bfloat16)
        if s is not None:  # power-of-two scales: exact in bfloat16, no float32 temporary
            plane = plane * s.to(torch.bfloat16)
        contig.append(plane.transpose(1, 2).contiguous())  # [B, Hkv, ctx, D]
    return Case(mode, kv_dtype, batch, context, shape, cache, meta, query, contig[0], contig[1])


def sdpa_baseline(case: Case) -> Callable[[], torch.Tensor]:
    """``scaled_dot_product_attention`` on the contiguous bf16 cache (GQA without
    repeating K/V); queries are the last ``query_len`` positions (bottom-right causal)."""
    b, qlen = case.batch, case.query_len
    hq, d = case.shape.num_q_heads, case.shape.head_dim
    q = case.query.view(b, qlen, hq, d).transpose(1, 2)
    mask = None
    if qlen > 1:
        kpos = torch.arange(case.context, device=q.device)
        qpos = torch.arange(case.context - qlen, case.context, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
    scale = case.shape.spec().scale
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run() -> torch.Tensor:
        o = sdpa(q, case.k_contig, case.v_contig, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * qlen, hq, d)

    return run


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 1) -> tuple[float, list[float]]:  # fmt: skip
    """Median seconds of ``fn`` over ``iters`` runs after ``warmup`` (CUDA events on a
    GPU, perf_counter on CPU); returns (median, all samples)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 5) -> dict[str, float]:
    """Device-to-device copy of ``nbytes``: GB/s counting read + write (2 * nbytes per
    copy), the figure memory-bound kernels are compared with."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t, _ = timed(lambda: dst.copy_(src), device, iters, warmup=2)
    return {"bytes": float(nbytes), "seconds": t, "gbps": 2 * nbytes / t / 1e9}
