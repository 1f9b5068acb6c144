"""Paged attention kernels (one kernel for decode and varlen prefill, plus a split-KV reduce).

Imported lazily by the launcher (it imports triton). Kernels take raw tensors, strides
and sizes only; every check happens in the launcher (``kvpage_triton.validate``).

``paged_attention_kernel`` — grid ``(num_tiles, num_kv_heads * NUM_CHUNKS, num_splits)``.
A *tile* is up to ``BLOCK_Q`` consecutive new tokens of one sequence; a program computes
those tokens for ``HEADS_PER_PROG`` query heads of one KV group (all of them when the
group is small), so every K/V element it loads is reused by ``BLOCK_Q * HEADS_PER_PROG``
query rows (rows = token-major, head-minor, padded to ``BLOCK_M``). Keys are walked in
tiles of ``BLOCK_N`` *positions*; each position is mapped through the block table to its
slot (``block_table[p // block_size] * block_size + p % block_size``), so any block_size
works. Online softmax in base 2 (FlashAttention-2, Dao 2023). With ``num_splits > 1`` the key
range of a tile is divided among ``num_splits`` programs that each write a normalised
partial output and its log-sum-exp (FlashDecoding, Dao et al. 2023; vLLM
paged-attention v2); ``reduce_splits_kernel`` merges them.

Masks: a query at absolute position ``p`` sees keys ``max(0, p - W + 1) .. p`` (W =
sliding window, keys including itself; HF convention). Masked K/V/scale loads read 0,
never the (possibly NaN-poisoned) memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # |x| >= 1/8: tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|) (no overflow);
    # |x| < 1/8: Taylor series to x^9 (truncation < 1e-12 relative), which avoids the
    # cancellation in 1 - e (float32 soft-capped logits stay within ~1 ulp).
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = a * a
    poly = 62.0 / 2835.0
    poly = poly * x2 - 17.0 / 315.0
    poly = poly * x2 + 2.0 / 15.0
    poly = poly * x2 - 1.0 / 3.0
    small = a + a * x2 * poly
    t = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit(do_not_specialize=["window", "num_splits", "stride_pt", "stride_ph", "stride_ps", "stride_lt", "stride_lh"])  # fmt: skip
def paged_attention_kernel(
    q_ptr,
    kv_ptr,
    ts_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    tile_seq_ptr,
    tile_qstart_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_blk,
    stride_slot,
    stride_kvh,
    stride_ts_kv,
    stride_ts_blk,
    stride_ts_slot,
    stride_ts_h,
    stride_fs_h,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    sm_scale,
    soft_cap,
    window,
    block_size,
    head_dim,
    num_splits,
    GROUP: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DIRECT_TILES: tl.constexpr,
    KV_QUANT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """KV_QUANT: 0 = model dtype, 1 = int8 + per-token scales, 2 = fp8 + per-tensor/head
    scales. USE_SOFTCAP: apply ``soft_cap`` (a constexpr, so that the hot loop has no
    branch). The window (``window``; 2**30 = none) and the split count are runtime
    values, to keep the number of compiled variants small (each costs seconds of
    compile on first use). DOT_FP32: upcast dot operands to float32 (float32
    queries, and bfloat16 under the interpreter whose bf16 tl.dot is wrong); otherwise
    dots run on the query dtype."""
    tile = tl.program_id(0)
    hc = tl.program_id(1)
    split = tl.program_id(2)
    kvh = hc // NUM_CHUNKS
    chunk = hc % NUM_CHUNKS

    if DIRECT_TILES:
        seq = tile
        q_start = 0
    else:
        seq = tl.load(tile_seq_ptr + tile)
        q_start = tl.load(tile_qstart_ptr + tile)
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + q_start
    n_tok = tl.minimum(q_len - q_start, BLOCK_Q)

    rows = tl.arange(0, BLOCK_M)
    r_tok = rows // HEADS_PER_PROG
    r_head = chunk * HEADS_PER_PROG + rows % HEADS_PER_PROG
    row_ok = (r_tok < n_tok) & (r_head < GROUP) & (rows < BLOCK_Q * HEADS_PER_PROG)
    q_head = kvh * GROUP + r_head
    tok = (q_begin + q_start + r_tok).to(tl.int64)
    q_pos = first_pos + r_tok

    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    cdt = q.dtype

    # key range of this tile (and of this split)
    kv_hi = tl.where(n_tok > 0, first_pos + n_tok, 0)
    kv_lo = tl.minimum(tl.maximum(first_pos - window + 1, 0), kv_hi)
    t_lo = kv_lo // BLOCK_N
    t_hi = (kv_hi + BLOCK_N - 1) // BLOCK_N
    per_split = (t_hi - t_lo + num_splits - 1) // num_splits
    t_start = t_lo + split * per_split
    t_end = tl.minimum(t_start + per_split, t_hi)

    k_fp8_scale = 1.0
    v_fp8_scale = 1.0
    if KV_QUANT == 2:
        k_fp8_scale = tl.load(k_scale_ptr + kvh * stride_fs_h)
        v_fp8_scale = tl.load(v_scale_ptr + kvh * stride_fs_h)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    n_off = tl.arange(0, BLOCK_N)
    for t in range(t_start, t_end):
        pos = t * BLOCK_N + n_off
        k_ok = (pos >= kv_lo) & (pos < kv_hi)
        blk = tl.load(bt_row + pos // block_size, mask=k_ok, other=0).to(tl.int64)
        in_blk = (pos % block_size).to(tl.int64)
        off = blk * stride_blk + in_blk * stride_slot + kvh * stride_kvh
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(cdt)))
        if KV_QUANT == 1:
            ts_off = blk * stride_ts_blk + in_blk * stride_ts_slot + kvh * stride_ts_h
            ks = tl.load(ts_ptr + ts_off, mask=k_ok, other=0.0)
            vs = tl.load(ts_ptr + stride_ts_kv + ts_off, mask=k_ok, other=0.0)
            s = s * ks[None, :]
        if KV_QUANT == 2:
            s = s * k_fp8_scale
        if USE_SOFTCAP:
            s = soft_cap * _tanh(s * (sm_scale / soft_cap))
            s = s * LOG2E
        else:
            s = s * (sm_scale * LOG2E)
        ok = k_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        ok = ok & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_QUANT == 1:
            # dequantize V rows (float32) before narrowing: scaling P instead would push
            # small weights into float16 subnormals
            v = v.to(tl.float32) * vs[:, None]
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(cdt), v.to(cdt))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    res = acc / l_safe[:, None]
    if KV_QUANT == 2:
        res = res * v_fp8_scale
    st_mask = row_ok[:, None] & d_ok[None, :]
    if num_splits > 1:
        head64 = q_head.to(tl.int64)
        base = tok * stride_pt + head64 * stride_ph + split * stride_ps
        tl.store(part_ptr + base[:, None] + d[None, :], res, mask=st_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        lse_off = tok * stride_lt + head64 * stride_lh + split
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)
    else:
        o = out_ptr + tok[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :]
        tl.store(o, res.to(out_ptr.dtype.element_ty), mask=st_mask)


@triton.jit
def reduce_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge split partials of one (token, query head): out = sum_s w_s o_s / sum_s w_s,
    w_s = 2^(lse_s - max lse). Grid ``(num_tokens, num_q_heads)``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    base = t * stride_pt + h * stride_ph
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(
        part_ptr + base + s[:, None] * stride_ps + d[None, :],
        mask=s_ok[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    num = tl.sum(part * w[:, None], axis=0)
    den = tl.sum(w, axis=0)
    den = tl.where(den > 0.0, den, 1.0)
    res = num / den
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        res.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )
