"""Cache-writing kernels: ``write_kv_kernel`` (with int8/fp8 quantization) and
``copy_blocks_kernel`` (bit-exact block copies for copy-on-write).

Imported lazily by the launcher. The quantization formulas are those of
``kvpage.attention.quant`` (the spec); rounding is done here in float32 arithmetic so
that the interpreter and every GPU produce the same bytes:

* ``div_rn`` (IEEE round-to-nearest division), because ``/`` may lower to an approximate
  division on GPUs while torch divides exactly.
* ``_round_half_even``: floor-based round-half-to-even (``torch.round``'s rule), exact
  for any float32 (values >= 2**23 are already integers).
* ``_round_to_fp8_grid``: rounds a clamped float32 to the nearest fp8 value (ties to
  even) *before* the cast, so the cast itself is exact whatever rounding the target
  implements (Triton 3.9's interpreter rounds fp8 ties away from zero; GPUs use RNE).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    f = tl.floor(y)
    frac = y - f
    half = f * 0.5
    odd = tl.floor(half) != half
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _round_to_fp8_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Nearest value (ties to even) of an fp8 format with MANT_BITS mantissa bits and
    smallest normal exponent MIN_EXP to float32 ``y`` (already clamped to +-max)."""
    a = tl.abs(y)
    e = (a.to(tl.int32, bitcast=True) >> 23) - 127
    e = tl.maximum(e, MIN_EXP)
    # quantum 2^(e - MANT_BITS) and its inverse, built from exponent bits (exact)
    quantum = ((e - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e + MANT_BITS) << 23).to(tl.float32, bitcast=True)
    r = _round_half_even(a * inv) * quantum
    return tl.where(y < 0, -r, r)


@triton.jit
def _quant_store(
    x,
    dst,
    mask,
    ts_dst,
    h_ok,
    fp8_scale,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    """Store one token's ``[BLOCK_H, BLOCK_D]`` K or V tile at ``dst`` (QUANT: 0 model
    dtype, 1 int8 with scale stored at ``ts_dst``, 2 fp8 with ``fp8_scale`` per row)."""
    if QUANT == 0:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    elif QUANT == 1:
        xf = tl.where(mask, x.to(tl.float32), 0.0)
        absmax = tl.max(tl.abs(xf), axis=1)
        scale = tl.math.div_rn(absmax, tl.full(absmax.shape, 127.0, tl.float32))
        safe = tl.where(scale > 0.0, scale, 1.0)
        codes = _round_half_even(tl.math.div_rn(xf, tl.broadcast_to(safe[:, None], xf.shape)))
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
        codes = tl.where(scale[:, None] > 0.0, codes, 0.0)
        tl.store(dst, codes.to(tl.int8), mask=mask)
        tl.store(ts_dst, scale, mask=h_ok)
    else:
        xf = x.to(tl.float32)
        y = tl.math.div_rn(xf, tl.broadcast_to(fp8_scale[:, None], xf.shape))
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        r = _round_to_fp8_grid(y, MANT_BITS, MIN_EXP)
        tl.store(dst, r.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    slot_ptr,
    kv_ptr,
    ts_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_blk,
    stride_slot,
    stride_h,
    stride_ts_kv,
    stride_ts_blk,
    stride_ts_slot,
    stride_ts_h,
    stride_fs_h,
    num_tokens,
    block_size,
    num_kv_heads,
    head_dim,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens, BLOCK_T),)``: each program stores the K and V of
    ``BLOCK_T`` tokens x all KV heads (rows = token-major, head-minor) at
    ``slot_mapping[t]``; slot -1 writes nothing."""
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + r // BLOCK_H
    h = r % BLOCK_H
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1)
    h_ok = (h < num_kv_heads) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    blk = slot // block_size
    in_blk = slot % block_size
    d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (d[None, :] < head_dim)
    dst = kv_ptr + (blk * stride_blk + in_blk * stride_slot + h * stride_h)[:, None] + d[None, :]
    ts_base = blk * stride_ts_blk + in_blk * stride_ts_slot + h * stride_ts_h
    k_sc = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    v_sc = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    if QUANT == 2:
        k_sc = tl.load(k_scale_ptr + h * stride_fs_h, mask=h_ok, other=1.0)
        v_sc = tl.load(v_scale_ptr + h * stride_fs_h, mask=h_ok, other=1.0)
    src = (t * stride_kt + h * stride_kh)[:, None] + d[None, :]
    k = tl.load(key_ptr + src, mask=mask)
    _quant_store(k, dst, mask, ts_ptr + ts_base, h_ok, k_sc, QUANT, FP8_MAX, MANT_BITS, MIN_EXP)
    src = (t * stride_vt + h * stride_vh)[:, None] + d[None, :]
    v = tl.load(value_ptr + src, mask=mask)
    _quant_store(
        v,
        dst + stride_kv,
        mask,
        ts_ptr + stride_ts_kv + ts_base,
        h_ok,
        v_sc,
        QUANT,
        FP8_MAX,
        MANT_BITS,
        MIN_EXP,
    )


@triton.jit
def copy_blocks_kernel(buf_ptr, pairs_ptr, stride_kv, stride_blk, elems, BLOCK: tl.constexpr):
    """Grid ``(num_pairs, 2, cdiv(elems, BLOCK))``: copy ``elems`` contiguous elements of
    block ``pairs[p, 0]`` to block ``pairs[p, 1]`` for K (axis 1 = 0) or V (= 1). The
    launcher passes integer views of the buffers, so copies are bit-exact (NaN payloads
    included)."""
    p = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64)
    src = tl.load(pairs_ptr + 2 * p)
    dst = tl.load(pairs_ptr + 2 * p + 1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < elems
    x = tl.load(buf_ptr + which * stride_kv + src * stride_blk + offs, mask=ok)
    tl.store(buf_ptr + which * stride_kv + dst * stride_blk + offs, x, mask=ok)
