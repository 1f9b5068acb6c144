"""Launchers: choose tile sizes and split counts, build grids, call the kernels.

Imports triton (the backend imports this module lazily). Arguments are assumed valid
(``kvpage_triton.validate`` runs first).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.specs import AttentionSpec
from kvpage_triton.kernels.attention import paged_attention_kernel, reduce_splits_kernel
from kvpage_triton.kernels.cache_ops import copy_blocks_kernel, write_kv_kernel
from kvpage_triton.plan import TritonPlan
from kvpage_triton.validate import fp8_format

#: whether the kernels above were created in interpreter mode (decided at import time)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
#: cap on query heads handled by one program (larger groups are split in chunks)
MAX_HEADS_PER_PROG = 64
#: cap on KV splits per tile
MAX_SPLITS = 64
#: window passed for full attention (any window >= every position sees all keys)
NO_WINDOW = 2**30


@dataclass(frozen=True)
class AttnConfig:
    """Tile sizes and grid of one attention launch."""

    heads_per_prog: int
    num_chunks: int
    block_q: int
    block_m: int
    block_n: int
    block_d: int
    num_splits: int
    num_warps: int
    num_stages: int


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _target_programs(device: torch.device) -> int:
    """Programs that keep the device busy: 2 per SM on CUDA; a small fixed number under
    the interpreter so that long sequences exercise the split path in tests."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return 2 * _sm_count(idx)
    return 8


def choose_config(
    spec: AttentionSpec,
    meta: AttentionMetadata,
    device: torch.device,
    *,
    decode: bool,
    force_splits: int | None = None,
) -> AttnConfig:
    """Tile sizes for one call (heuristics; on GPU untuned beyond these rules).

    * rows per program ``BLOCK_M``: decode = the KV group's heads (>= 16 for tl.dot);
      prefill = 64 rows on GPU (16 under the interpreter), ``BLOCK_Q = BLOCK_M // heads``.
    * keys per step ``BLOCK_N``: 64 on GPU (32 for head_dim > 128), 16 interpreted.
    * splits: when tiles x KV heads would not fill ``_target_programs``, split each
      tile's key range so that every split still walks >= 4 key tiles (2 interpreted).
    """
    group = spec.num_q_heads // spec.num_kv_heads
    hpp = min(group, MAX_HEADS_PER_PROG)
    chunks = -(-group // hpp)
    block_d = max(16, _pow2(spec.head_dim))
    gpu = device.type == "cuda"
    if decode or meta.max_query_len <= 1:  # pure decode rows: the decode variant
        block_q = 1
    else:
        target_rows = 64 if gpu else 16
        block_q = max(1, target_rows // hpp)
    block_m = max(16, _pow2(block_q * hpp))
    if gpu:
        block_n = 64 if spec.head_dim <= 128 else 32
    else:
        block_n = 16
    num_tiles = sum(-(-q // block_q) for q in meta.query_lens_cpu)
    programs = num_tiles * spec.num_kv_heads * chunks
    span = meta.max_seq_len
    if spec.sliding_window is not None:
        span = min(span, spec.sliding_window + block_q - 1)
    key_tiles = -(-span // block_n) + 1
    if force_splits is not None:
        splits = max(1, force_splits)
    elif programs == 0 or programs >= _target_programs(device):
        splits = 1
    else:
        min_tiles = 4 if gpu else 2
        splits = min(-(-_target_programs(device) // programs), key_tiles // min_tiles)
        splits = max(1, min(splits, MAX_SPLITS))
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    num_stages = 2 if (gpu and block_d > 128) else 3
    return AttnConfig(
        hpp, chunks, block_q, block_m, block_n, block_d, splits, num_warps, num_stages
    )


def _scale_args(cache: KVCache, kind: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    kv = cache.kv
    if kind.startswith("fp8"):
        assert cache.k_scale is not None and cache.v_scale is not None
        stride = 1 if cache.k_scale.dim() == 1 else 0
        if cache.k_scale.dim() != cache.v_scale.dim():
            # mixed granularity: expand the per-tensor one to per head
            hk = kv.shape[3]
            ks = cache.k_scale.expand(hk).contiguous()
            vs = cache.v_scale.expand(hk).contiguous()
            return ks, vs, 1
        return cache.k_scale.contiguous(), cache.v_scale.contiguous(), stride
    return kv, kv, 0


def attention(
    query: torch.Tensor,
    cache: KVCache,
    plan: TritonPlan,
    spec: AttentionSpec,
    out: torch.Tensor,
    kind: str,
    *,
    force_splits: int | None = None,
) -> torch.Tensor:
    """Run paged attention for every query row into ``out`` (see the kernel's doc)."""
    dev = query.device
    meta = plan.meta
    cfg = choose_config(spec, meta, dev, decode=plan.is_decode, force_splits=force_splits)
    kv = cache.kv
    direct = cfg.block_q >= meta.max_query_len
    if direct:
        num_tiles = meta.num_seqs
        tile_seq = tile_start = meta.seq_lens
    else:
        tile_seq, tile_start = plan.tiles(cfg.block_q)
        num_tiles = int(tile_seq.shape[0])
    if num_tiles == 0 or query.shape[0] == 0:
        return out
    ts = cache.token_scales if kind == "int8" else None
    ts_t = ts if ts is not None else kv
    ts_strides = ts.stride() if ts is not None else (0, 0, 0, 0)
    ks, vs, fs_stride = _scale_args(cache, kind)
    quant = 1 if kind == "int8" else (2 if kind.startswith("fp8") else 0)
    split = cfg.num_splits > 1
    if split:
        t, h = query.shape[0], query.shape[1]
        part = torch.empty((t, h, cfg.num_splits, spec.head_dim), dtype=torch.float32, device=dev)
        lse = torch.empty((t, h, cfg.num_splits), dtype=torch.float32, device=dev)
    else:
        part = lse = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=dev)
    dot_fp32 = query.dtype == torch.float32 or (INTERPRET and query.dtype == torch.bfloat16)
    grid = (num_tiles, spec.num_kv_heads * cfg.num_chunks, cfg.num_splits)
    paged_attention_kernel[grid](
        query,
        kv,
        ts_t,
        ks,
        vs,
        out,
        part,
        lse,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        tile_seq,
        tile_start,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        ts_strides[0],
        ts_strides[1],
        ts_strides[2],
        ts_strides[3],
        fs_stride,
        meta.block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        float(spec.scale),
        float(spec.logits_soft_cap or 0.0),
        int(spec.sliding_window or NO_WINDOW),
        kv.shape[2],
        spec.head_dim,
        cfg.num_splits,
        GROUP=spec.num_q_heads // spec.num_kv_heads,
        HEADS_PER_PROG=cfg.heads_per_prog,
        NUM_CHUNKS=cfg.num_chunks,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d,
        DIRECT_TILES=direct,
        KV_QUANT=quant,
        USE_SOFTCAP=spec.logits_soft_cap is not None,
        DOT_FP32=dot_fp32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        reduce_splits_kernel[(query.shape[0], query.shape[1])](
            part,
            lse,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            spec.head_dim,
            cfg.num_splits,
            BLOCK_S=max(2, _pow2(cfg.num_splits)),
            BLOCK_D=cfg.block_d,
            num_warps=4,
        )
    return out


def write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor, kind: str
) -> None:
    """Launch ``write_kv_kernel`` with one program per token."""
    n = key.shape[0]
    if n == 0:
        return
    kv = cache.kv
    hk, hd = kv.shape[3], kv.shape[4]
    quant = {"auto": 0, "int8": 1}.get(kind, 2)
    ts = cache.token_scales if kind == "int8" else None
    ts_t = ts if ts is not None else kv
    ts_strides = ts.stride() if ts is not None else (0, 0, 0, 0)
    ks, vs, fs_stride = _scale_args(cache, kind)
    fmax, mant, min_exp = fp8_format(kv.dtype) if quant == 2 else (0.0, 0, 0)
    block_h = _pow2(hk)
    # rows (token x KV head) per program: >= 16 on GPU; 64 under the interpreter, where
    # per-program overhead dominates
    block_t = max(1, (64 if INTERPRET else 16) // block_h)
    write_kv_kernel[(triton.cdiv(n, block_t),)](
        key,
        value,
        slot_mapping,
        kv,
        ts_t,
        ks,
        vs,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        ts_strides[0],
        ts_strides[1],
        ts_strides[2],
        ts_strides[3],
        fs_stride,
        n,
        kv.shape[2],
        hk,
        hd,
        QUANT=quant,
        FP8_MAX=fmax,
        MANT_BITS=mant,
        MIN_EXP=min_exp,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=_pow2(hd),
        num_warps=4,
        enable_fp_fusion=False,  # keep the rounding arithmetic exactly as written
    )


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_blocks(caches: list[KVCache], pairs: torch.Tensor) -> None:
    """Copy blocks ``pairs[:, 0] -> pairs[:, 1]`` in every cache (K, V and int8 scales).

    When a destination is also a source, or repeats, the pairs are applied one at a
    time in order (the sequential semantics of ``cache[:, dst] = cache[:, src]``).
    """
    n = int(pairs.shape[0])
    if n == 0:
        return
    host = pairs.tolist()
    srcs = {s for s, _ in host}
    dsts = [d for _, d in host]
    ordered = len(set(dsts)) != len(dsts) or bool(srcs & set(dsts))
    batches = [pairs[i : i + 1] for i in range(n)] if ordered else [pairs]
    for cache in caches:
        bufs = [cache.kv]
        if cache.token_scales is not None:
            bufs.append(cache.token_scales)
        for buf in bufs:
            view = buf.view(_INT_VIEW[buf.element_size()])
            elems = view[0, 0].numel()
            block = min(4096, _pow2(elems))
            for b in batches:
                grid = (int(b.shape[0]), 2, triton.cdiv(elems, block))
                copy_blocks_kernel[grid](
                    view, b.contiguous(), view.stride(0), view.stride(1), elems, BLOCK=block
                )
