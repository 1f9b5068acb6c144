"""The compiled CPU paged-attention kernel (Numba ``@njit(parallel=True)``).

One kernel serves decode, prefill, chunked prefill and prefix-cache hits: it walks
each sequence's block table and reads K/V **in place** from the paged cache
``kv[2, num_blocks, block_size, num_kv_heads, head_dim]`` (no gather into a padded
tensor). The work is a list of units ``(sequence, query rows, KV heads)``
dealt to threads by the plan (``plan.py``); each unit keeps a streaming softmax
(running max ``m``, sum ``l`` and output accumulator, as in FlashAttention, Dao et al.
2022) for its query rows and the query heads of its KV head (GQA), one block of keys at
a time:

    s_j = scale * q . k_j               (soft cap: cap * tanh(s_j / cap))
    m'  = max(m, max_j s_j);  a = exp(m - m')
    l   = a * l + sum_j exp(s_j - m');  acc = a * acc + sum_j exp(s_j - m') v_j
    out = acc / l                       (sinks: acc / (l + exp(sink - m)))

Everything is float32 and ``fastmath=False`` except the K dot product ``_dot``, the
one function compiled with ``fastmath={"reassoc", "contract"}`` (no finite-math
assumptions: infinities and NaN keep their meaning) so that LLVM vectorizes its sum:
1.5-1.7x less CPU per decode call than the strict in-order sum (measured, see
docs/benchmarks.md). Its order is fixed by the compiled code and the head_dim, so a
unit's result still does not depend on the batch, the thread count or the other units
(tested bit-for-bit). float32 caches are read
in place; other storage is converted block by block (K and V rows of the unit's head)
into a small float32 tile first, so the math reads one kind of array. Hot loops index
with unsigned integers: Numba adds a negative-index wraparound to every signed index,
which kept LLVM from vectorizing them (measured 4.4x on the logit loop alone).

Cache storage is passed as its raw bits: float32 as float32, bfloat16 as uint16
(widened to float32 by ``bits << 16``, exact), int8 codes times the float32 token
scale (one rounding, ``kvpage.attention.quant``), fp8 as uint8 through a 256-entry
float32 table of the format's values times the K/V scale of the head (exact). One
compiled specialization per storage dtype (four at most), cached on disk
(``cache=True``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

#: storage kinds (the ``kind`` argument of ``paged_attention``)
KIND_FLOAT = 0
KIND_BF16 = 1
KIND_INT8 = 2
KIND_FP8 = 3


U = np.uint64


@njit(cache=True, fastmath={"reassoc", "contract"}, inline="never")
def _dot(a, ao, b, bo, d):
    """``sum_x a[ao + x] * b[bo + x]`` for ``x < d`` in float32, the one function
    compiled with reassociation (``fastmath={"reassoc", "contract"}``, no
    finite-math assumptions), so LLVM vectorizes the sum."""
    total = np.float32(0.0)
    for x in range(U(0), d):
        total += a[ao + x] * b[bo + x]
    return total


@njit(cache=True, fastmath=False, inline="always")
def _convert(kv, kind, tsc, fsc, lut, blk, j0, j1, h, tile, tile_bits):
    """K (tile rows ``0 .. bs-1``) and V (rows ``bs .. 2bs-1``) of keys ``j0 .. j1-1`` of
    block ``blk``, KV head ``h``, as float32 rows of ``head_dim`` in ``tile``
    (``tile_bits`` is its uint32 view). An MLA latent cache (``kv`` ``[1, ...]``): both
    from the latent plane (fp8: ``fsc`` row 1 is the latent's ``k_scale`` again)."""
    bs = U(kv.shape[2])
    hd = U(kv.shape[3] * kv.shape[4])
    d = U(kv.shape[4])
    flat = kv.reshape(-1)
    latent = kv.shape[0] == 1  # an MLA latent cache: the latent is K and V
    for c in range(U(0), U(2)):
        cp = U(0) if latent else c
        plane = (cp * U(kv.shape[1]) + blk) * bs
        for j in range(j0, j1):
            src = (plane + j) * hd + h * d
            dst = (c * bs + j) * d
            if kind == KIND_BF16:
                for x in range(U(0), d):
                    tile_bits[dst + x] = np.uint32(np.uint16(flat[src + x])) << np.uint32(16)
            elif kind == KIND_INT8:
                sc = tsc[cp, blk, j, h]
                for x in range(U(0), d):
                    tile[dst + x] = np.float32(flat[src + x]) * sc
            else:
                sc = fsc[c, h]
                for x in range(U(0), d):
                    tile[dst + x] = lut[np.uint8(flat[src + x])] * sc


@njit(cache=True, fastmath=False)
def run_part(
    t,
    q,
    kv,
    kv_f32,
    kind,
    tsc,
    fsc,
    lut,
    block_tables,
    query_start,
    seq_lens,
    units,
    bounds,
    scale,
    window,
    soft_cap,
    sinks,
    out,
):
    """Part ``t`` of ``paged_attention`` (one thread's units, in order)."""
    nq = U(q.shape[1])
    d = U(q.shape[2])
    # V plane offset in blocks; 0 for an MLA latent cache [1, ...] (V = K = the latent)
    nb = U(kv.shape[1]) if kv.shape[0] == 2 else U(0)
    bs = U(kv.shape[2])
    hkv = U(kv.shape[3])
    group = nq // hkv
    qf = q.reshape(-1)
    of = out.reshape(-1)
    tile_bits = np.empty(2 * bs * d, np.uint32)
    tile = tile_bits.view(np.float32)
    s = np.empty(bs, np.float32)
    max_states = U(1)
    for u in range(bounds[t], bounds[t + 1]):
        nst = U((units[u, 2] - units[u, 1]) * (units[u, 4] - units[u, 3])) * group
        max_states = max(max_states, nst)
    m = np.empty(max_states, np.float32)
    l_sum = np.empty(max_states, np.float32)
    acc = np.empty(max_states * d, np.float32)
    for u in range(bounds[t], bounds[t + 1]):
        seq = units[u, 0]
        r0 = units[u, 1]
        nr = U(units[u, 2] - r0)
        h0 = U(units[u, 3])
        nh = U(units[u, 4]) - h0
        qs = query_start[seq]
        ctx = seq_lens[seq] - (query_start[seq + 1] - qs)
        for i in range(U(0), nr * nh * group):
            m[i] = -np.inf
            l_sum[i] = 0.0
        for i in range(U(0), nr * nh * group * d):
            acc[i] = 0.0
        last = ctx + r0 + np.int64(nr) - 1  # last key any row of the unit sees
        first = 0
        if window > 0:
            first = max(0, ctx + r0 - window + 1)
        for b in range(first // kv.shape[2], last // kv.shape[2] + 1):
            kp0 = b * kv.shape[2]
            j0 = U(max(first - kp0, 0))
            j1 = U(min(last + 1 - kp0, kv.shape[2]))
            blk = U(block_tables[seq, b])
            for hh in range(U(0), nh):
                h = h0 + hh
                if kind == KIND_FLOAT:
                    src = kv_f32
                    kbase = (blk * bs) * hkv * d + h * d
                    vbase = ((nb + blk) * bs) * hkv * d + h * d
                    stride = hkv * d
                else:
                    _convert(kv, kind, tsc, fsc, lut, blk, j0, j1, h, tile, tile_bits)
                    src = tile
                    kbase = U(0)
                    vbase = bs * d
                    stride = d
                for r in range(U(0), nr):
                    pos = ctx + r0 + np.int64(r)
                    lo = 0
                    if window > 0:
                        lo = pos - window + 1 - kp0
                    a0 = U(max(np.int64(j0), lo))
                    a1 = U(min(np.int64(j1), pos + 1 - kp0))
                    if a1 <= a0:
                        continue
                    qrow = U(qs + r0) + r
                    for g in range(U(0), group):
                        qo = (qrow * nq + h * group + g) * d
                        st = (r * nh + hh) * group + g
                        mx = m[st]
                        for j in range(a0, a1):
                            s[j] = _dot(qf, qo, src, kbase + j * stride, d)
                        for j in range(a0, a1):
                            v = s[j] * scale
                            if soft_cap > 0:
                                v = soft_cap * np.tanh(v / soft_cap)
                            s[j] = v
                            if v > mx:
                                mx = v
                        alpha = np.exp(m[st] - mx)
                        m[st] = mx
                        total = l_sum[st] * alpha
                        ab = st * d
                        for x in range(U(0), d):
                            acc[ab + x] *= alpha
                        for j in range(a0, a1):
                            p = np.exp(s[j] - mx)
                            total += p
                            vo = vbase + j * stride
                            for x in range(U(0), d):
                                acc[ab + x] += p * src[vo + x]
                        l_sum[st] = total
        for r in range(U(0), nr):
            qrow = U(qs + r0) + r
            for hh in range(U(0), nh):
                for g in range(U(0), group):
                    st = (r * nh + hh) * group + g
                    if sinks.shape[0] > 0:  # the sink joins the denominator only
                        sk = sinks[(h0 + hh) * group + g]
                        mm = m[st]
                        if sk > mm:  # rescaled to the sink: exp cannot overflow
                            e = np.exp(mm - sk)
                            inv = e / (l_sum[st] * e + np.float32(1.0))
                        else:
                            inv = np.float32(1.0) / (l_sum[st] + np.exp(sk - mm))
                    else:
                        inv = np.float32(1.0) / l_sum[st]
                    oo = (qrow * nq + (h0 + hh) * group + g) * d
                    for x in range(U(0), d):
                        of[oo + x] = acc[st * d + x] * inv


@njit(parallel=True, cache=True, fastmath=False)
def paged_attention(
    q,
    kv,
    kv_f32,
    kind,
    tsc,
    fsc,
    lut,
    block_tables,
    query_start,
    seq_lens,
    units,
    bounds,
    scale,
    window,
    soft_cap,
    sinks,
    out,
):
    """Paged attention of every unit into ``out``.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]`` float32, C-contiguous.
        kv: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` storage bits
            (float32, int16 for bfloat16, int8, uint8 for fp8), C-contiguous.
        kv_f32: ``kv`` itself flattened when it is float32, else a ``[1]`` dummy.
        kind: ``KIND_*`` of ``kv``.
        tsc: int8 token scales ``[2, num_blocks, block_size, num_kv_heads]`` float32
            (a ``[1, 1, 1, 1]`` dummy otherwise).
        fsc: fp8 scales per KV head ``[2, num_kv_heads]`` float32 (ones otherwise).
        lut: ``[256]`` float32 value of each fp8 bit pattern (ignored otherwise).
        block_tables: ``[num_seqs, max_blocks]`` int32 (only the used prefix is read).
        query_start: ``[num_seqs + 1]`` int64 first query row of each sequence.
        seq_lens: ``[num_seqs]`` int64 keys of each sequence (cached + new).
        units: ``[num_units, 5]`` int64 rows ``(seq, row0, row1, head0, head1)``: query
            rows ``row0 .. row1-1`` (relative to the sequence's first query row) and
            KV heads ``head0 .. head1-1``.
        bounds: ``[num_parts + 1]`` int64; part ``t`` runs units
            ``bounds[t] .. bounds[t+1]-1`` (one parallel iteration per part).
        scale: softmax scale (float32). window: sliding window in keys (0 = none).
        soft_cap: logit soft cap (float32, 0 = none).
        sinks: ``[num_q_heads]`` float32 attention-sink logits (gpt-oss: each joins
            its head's softmax denominator only), or ``[0]`` for none.
        out: ``[num_tokens, num_q_heads, head_dim]`` float32, C-contiguous, written
            for every row of every unit (nothing else).
    """
    for t in prange(bounds.shape[0] - 1):
        run_part(
            t,
            q,
            kv,
            kv_f32,
            kind,
            tsc,
            fsc,
            lut,
            block_tables,
            query_start,
            seq_lens,
            units,
            bounds,
            scale,
            window,
            soft_cap,
            sinks,
            out,
        )
