"""Attention math of the torch backend: gather, dequantize, attend (vectorized).

Buckets come from ``plan.py``. Streamed buckets (one long sequence) gather whole blocks
with one row gather (``F.embedding``) per chunk and attend with batched matmuls over
the KV heads (decode, soft cap) or ``scaled_dot_product_attention`` (prefill); padded
buckets (many short sequences) gather per slot into ``[n, max_keys]``: decode buckets
attend with two float32 batched matmuls per bucket over all heads at once (see
``_decode_padded``), prefill buckets use SDPA with a key mask, or explicit float32
matmuls when a logit soft cap is set (SDPA has none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import KVCache
from kvpage.backends.torch_backend.plan import SeqBucket
from kvpage.specs import AttentionSpec

#: the float32 logits of one chunk of query rows stay under this many bytes
LOGITS_BUDGET_BYTES = 64 * 2**20
#: padded decode multiplies by a block-diagonal query (all KV heads in one matmul) while
#: ``num_kv_heads * head_dim`` is at most this; wider rows take per-head matmuls
BLOCK_DIAG_MAX_ROW = 256
#: streamed decode gathers at most this many bytes of float32 K (or V) at a time, so
#: the gathered chunk is still in cache (L2) when the matmul reads it
DECODE_CHUNK_BYTES = 2 * 2**20


def compute_dtype(cache: KVCache, streamed: bool) -> torch.dtype:
    """Unquantized caches attend in the cache dtype (streamed buckets on the CPU in
    float32, which the buffer conversion makes free); int8/fp8 caches in float32."""
    if cache.kv_dtype != "auto":
        return torch.float32
    if streamed and cache.kv.device.type == "cpu":
        return torch.float32
    return cache.kv.dtype


def _rows(x: torch.Tensor, rows_per_entry: int) -> torch.Tensor:
    """``x`` (one K or V tensor ``[num_blocks, ...]``) as 2-D rows for a row gather,
    1-byte types as uint8 (fp8 gathers are not implemented everywhere)."""
    y = x.view(torch.uint8) if x.element_size() == 1 else x
    return y.reshape(-1, rows_per_entry)


def _gather(
    cache: KVCache, i: int, index: torch.Tensor, per_block: bool, dtype: torch.dtype
) -> torch.Tensor:
    """K (``i`` = 0) or V (1) rows at ``index`` (blocks or slots), dequantized, as
    ``[num_rows, num_kv_heads, head_dim]`` in ``dtype``."""
    bs, h, d = cache.block_size, cache.num_kv_heads, cache.head_dim
    width = (bs if per_block else 1) * h * d
    raw = F.embedding(index, _rows(cache.kv[i], width))  # a row gather, faster than index_select
    if cache.kv.element_size() == 1:
        raw = raw.view(cache.kv.dtype)
    raw = raw.view(-1, h, d)
    kind = cache.kv_dtype
    if kind == "auto":
        return raw if raw.dtype == dtype else raw.to(dtype)
    if kind == "int8":
        assert cache.token_scales is not None
        sw = (bs if per_block else 1) * h
        sc = F.embedding(index, cache.token_scales[i].reshape(-1, sw)).view(-1, h, 1)
        return raw.to(dtype) * sc.to(dtype)
    s = cache.k_scale if i == 0 else cache.v_scale
    assert s is not None
    s = s.to(dtype)
    return raw.to(dtype) * (s.view(h, 1) if s.dim() == 1 else s)


def sink_softmax(logits: torch.Tensor, sink_col: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with ``sink_col`` (broadcastable to ``logits``
    without its last dim, plus a size-1 last dim) the softmax of ``[logits, sink]``
    without the sink's entry (attention sinks, ``kvpage.attention.reference``)."""
    if sink_col is None:
        return torch.softmax(logits, dim=-1)
    col = sink_col.expand(*logits.shape[:-1], 1).to(logits.dtype)
    return torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]


def _explicit_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    mask: torch.Tensor | None,
    causal: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched over a leading dim ``n``: q ``[n, Lq, Hq, D]``, k/v ``[n, L, Hkv, D]``,
    mask broadcastable to ``[n, 1, Lq, L]`` -> ``[n, Lq, Hq, D]``; float32 matmuls
    per KV head, soft cap ``c * tanh(logits / c)`` (Gemma-2), attention sinks
    ``[Hq]`` in the denominator (gpt-oss), chunked over query rows.
    """
    n, lq, hq, d = q.shape
    hkv = spec.num_kv_heads
    grp = hq // hkv
    L = k.shape[1]
    kt = k.permute(0, 2, 3, 1)  # [n, Hkv, D, L]: a strided view, no copy when n == 1
    vt = v.permute(0, 2, 1, 3)  # [n, Hkv, L, D]
    qh = q.reshape(n, lq, hkv, grp, d).permute(0, 2, 3, 1, 4)  # [n, Hkv, G, Lq, D]
    rows = max(1, LOGITS_BUDGET_BYTES // max(1, 4 * n * hq * L))
    outs = []
    for a in range(0, lq, rows):
        b = min(lq, a + rows)
        r = b - a
        qc = qh[:, :, :, a:b].reshape(n, hkv, grp * r, d)
        logits = torch.matmul(qc, kt).mul_(spec.scale)  # [n, Hkv, G*r, L]
        if spec.logits_soft_cap is not None:
            c = spec.logits_soft_cap
            logits = torch.tanh(logits / c) * c
        m = None
        if mask is not None:
            m = mask[:, :, a:b] if mask.shape[2] > 1 else mask
            m = m.unsqueeze(2)  # [n, 1, 1, r or 1, L]
        elif causal:
            m = torch.ones(r, L, dtype=torch.bool, device=q.device).tril(a)
        if m is not None:
            logits = logits.view(n, hkv, grp, r, L).masked_fill(~m, float("-inf"))
            logits = logits.view(n, hkv, grp * r, L)
        col = None
        if sinks is not None:  # row g * r + j of a KV head is its query head g
            col = sinks.float().view(hkv, grp, 1, 1).expand(hkv, grp, r, 1)
            col = col.reshape(hkv, grp * r, 1)
        o = torch.matmul(sink_softmax(logits, col), vt)  # [n, Hkv, G*r, D]
        outs.append(o.view(n, hkv, grp, r, d))
    o = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return o.permute(0, 3, 1, 2, 4).reshape(n, lq, hq, d)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: SeqBucket, spec: AttentionSpec
) -> torch.Tensor:
    """q ``[n, Lq, Hq, D]``, k/v ``[n, L, Hkv, D]`` -> ``[n, Lq, Hq, D]``."""
    res = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=g.attn_mask,
        is_causal=g.is_causal and g.max_q > 1,
        scale=spec.scale,
        enable_gqa=spec.num_q_heads != spec.num_kv_heads,
    )
    return res.transpose(1, 2)


def _decode_streamed(
    query: torch.Tensor,
    cache: KVCache,
    g: SeqBucket,
    spec: AttentionSpec,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """One query token over one long key range, in two passes over block chunks of at
    most DECODE_CHUNK_BYTES: logits chunk by chunk (all of them are small), one float32
    softmax, then ``P @ V`` chunk by chunk. Each chunk is gathered and consumed while it
    is in cache, so the cache is read from memory once."""
    bs, hkv, d = cache.block_size, spec.num_kv_heads, spec.head_dim
    grp = spec.num_queries_per_kv
    per = max(1, DECODE_CHUNK_BYTES // (bs * hkv * d * 4))
    nblk = int(g.index.numel())
    a0, n = g.key_offset, g.num_keys
    q = query[g.q_start].float().reshape(hkv, grp, d)
    logits = torch.empty(hkv, grp, n, dtype=torch.float32, device=query.device)
    spans = []
    for c in range(0, nblk, per):
        lo, hi = max(c * bs, a0), min((c + per) * bs, a0 + n)
        spans.append((c, lo, hi))
        kc = _gather(cache, 0, g.index[c : c + per], True, torch.float32)[lo - c * bs : hi - c * bs]
        logits[:, :, lo - a0 : hi - a0] = torch.matmul(q, kc.permute(1, 2, 0))
    logits.mul_(spec.scale)
    if spec.logits_soft_cap is not None:
        cap = spec.logits_soft_cap
        logits = torch.tanh(logits / cap) * cap
    p = sink_softmax(logits, None if sinks is None else sinks.float().view(hkv, grp, 1))
    acc = torch.zeros(hkv, grp, d, dtype=torch.float32, device=query.device)
    for c, lo, hi in spans:
        vc = _gather(cache, 1, g.index[c : c + per], True, torch.float32)[lo - c * bs : hi - c * bs]
        acc += torch.matmul(p[:, :, lo - a0 : hi - a0], vc.transpose(0, 1))
    out[g.q_start] = acc.view(spec.num_q_heads, d)


def _attend_streamed(
    query: torch.Tensor,
    cache: KVCache,
    g: SeqBucket,
    spec: AttentionSpec,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    if g.max_q == 1:
        _decode_streamed(query, cache, g, spec, out, sinks)
        return
    dtype = compute_dtype(cache, streamed=True)
    a, b = g.key_offset, g.key_offset + g.num_keys
    k = _gather(cache, 0, g.index, True, dtype)[a:b].unsqueeze(0)
    v = _gather(cache, 1, g.index, True, dtype)[a:b].unsqueeze(0)
    q = query[g.q_start : g.q_start + g.max_q].unsqueeze(0)
    if q.dtype != dtype:
        q = q.to(dtype)
    if spec.logits_soft_cap is not None or sinks is not None:  # SDPA has neither
        res = _explicit_heads(
            q.float(), k.float(), v.float(), spec, g.attn_mask, g.is_causal, sinks
        )
    else:
        res = _sdpa(q, k, v, g, spec)
    out[g.q_start : g.q_start + g.max_q] = res[0]


@dataclass(frozen=True)
class PaddedDecode:
    """Step-constant data of one padded decode bucket for one layer shape (built once per
    step by :func:`layer_runs`, used by every layer of that shape).

    Attributes:
        kv_index: ``[2 * n * max_keys]`` int64: the bucket's slots, then the same slots
            shifted by the cache's slot count (the V half of ``cache.kv`` viewed as
            ``[2 * slots, ...]``), so K and V rows come in one gather; None for
            quantized caches (dequantized per half).
        qbd: ``[n, Hq, Hkv * D]`` float32 block-diagonal query buffer: query head ``h``
            (of KV head ``h // G``) holds its values in columns ``(h // G) * D ..`` and
            zeros elsewhere, so ``qbd @ k_row`` with a K row ``[Hkv * D]`` gives every
            head's logit at once. Zeroed once; each layer overwrites only the diagonal.
        qbd_diag: ``[n, G, D, Hkv]``: the diagonal blocks of ``qbd`` (a view), where
            each layer copies its query.
    """

    kv_index: torch.Tensor | None
    qbd: torch.Tensor
    qbd_diag: torch.Tensor


def padded_decode_data(g: SeqBucket, cache: KVCache, spec: AttentionSpec) -> PaddedDecode:
    """The :class:`PaddedDecode` of bucket ``g`` for caches shaped like ``cache`` and
    layers like ``spec`` (tensors on the bucket's device)."""
    n, _ = g.index.shape
    hkv, d, hq = cache.num_kv_heads, cache.head_dim, spec.num_q_heads
    kv_index = None
    if cache.kv_dtype == "auto" and cache.kv.stride(0) != 0:  # not an MLA alias (one plane)
        slots = cache.num_blocks * cache.block_size
        flat = g.index.reshape(-1)
        kv_index = torch.cat([flat, flat + slots])
    qbd = torch.zeros(n, hq, hkv * d, dtype=torch.float32, device=g.index.device)
    diag = qbd.view(n, hkv, hq // hkv, hkv, d).diagonal(dim1=1, dim2=3)
    return PaddedDecode(kv_index=kv_index, qbd=qbd, qbd_diag=diag)


def _decode_padded(
    query: torch.Tensor,
    cache: KVCache,
    g: SeqBucket,
    spec: AttentionSpec,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
    *,
    data: PaddedDecode,
) -> None:
    """One query row per sequence over ``[n, max_keys]`` gathered keys (padding masked
    by the plan's additive ``key_bias``), in float32: logits ``[n, Hq, L]`` from one
    batched matmul against the K rows ``[n, L, Hkv * D]`` (block-diagonal query
    ``data.qbd``, no per-head copy of K), soft cap, bias, softmax, then ``P @ V`` and
    the diagonal blocks of the result. Buckets are small (``plan.BUCKET_BYTES``), so the
    gathered K/V are read back from cache."""
    assert g.key_bias is not None
    n, L = g.index.shape
    hkv, d, hq = cache.num_kv_heads, cache.head_dim, spec.num_q_heads
    if g.identity_rows:
        q = query
    else:
        q = query.index_select(0, g.q_rows.reshape(-1))
    if data.kv_index is not None:  # K and V rows in one gather from the [2 * slots] view
        kv = F.embedding(data.kv_index, cache.kv.view(-1, hkv * d)).float()
        k, v = kv[: n * L].view(n, L, hkv * d), kv[n * L :].view(n, L, hkv * d)
    else:
        idx = g.index.reshape(-1)
        k = _gather(cache, 0, idx, False, torch.float32).view(n, L, hkv * d)
        v = _gather(cache, 1, idx, False, torch.float32).view(n, L, hkv * d)
    data.qbd_diag.copy_(q.view(n, hkv, hq // hkv, d).permute(0, 2, 3, 1))
    kt = k.transpose(1, 2)
    if spec.logits_soft_cap is None:  # one fused pass: bias + scale * (q @ k)
        logits = torch.baddbmm(g.key_bias, data.qbd, kt, alpha=spec.scale)  # [n, Hq, L]
    else:
        c = spec.logits_soft_cap
        logits = torch.bmm(data.qbd, kt).mul_(spec.scale / c)
        logits = torch.tanh_(logits).mul_(c).add_(g.key_bias)
    p = sink_softmax(logits, None if sinks is None else sinks.float().view(1, hq, 1))
    o = torch.bmm(p, v).view(n, hkv, hq // hkv, hkv, d)
    diag = o.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # [n, Hkv, G, D]
    if g.identity_rows:
        out.view(n, hkv, hq // hkv, d).copy_(diag)
    else:
        out.index_copy_(0, g.out_rows, diag.reshape(n, hq, d).to(out.dtype))


def _attend_padded(
    query: torch.Tensor,
    cache: KVCache,
    g: SeqBucket,
    spec: AttentionSpec,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """A padded bucket through SDPA (or explicit float32 matmuls with a soft cap or
    sinks)."""
    dtype = compute_dtype(cache, streamed=False)
    n, max_q = g.q_rows.shape
    k = _gather(cache, 0, g.index.reshape(-1), False, dtype).view(
        n, g.num_keys, cache.num_kv_heads, cache.head_dim
    )
    v = _gather(cache, 1, g.index.reshape(-1), False, dtype).view(
        n, g.num_keys, cache.num_kv_heads, cache.head_dim
    )
    if g.identity_rows:
        q = query.reshape(n, 1, *query.shape[1:])
    else:
        q = query.index_select(0, g.q_rows.reshape(-1)).view(n, max_q, *query.shape[1:])
    if q.dtype != dtype:
        q = q.to(dtype)
    if spec.logits_soft_cap is None and sinks is None:
        res = _sdpa(q, k, v, g, spec)
    else:
        res = _explicit_heads(
            q.float(), k.float(), v.float(), spec, g.attn_mask, g.is_causal, sinks
        )
    res = res.reshape(n * max_q, *res.shape[2:])
    if g.identity_rows:
        out.copy_(res)
        return
    if g.q_valid is not None:
        res = res[g.q_valid]
    out.index_copy_(0, g.out_rows, res.to(out.dtype))


#: one layer's work on one bucket: ``attend(query, cache, bucket, spec, out, sinks)``
Attend = Callable[
    [torch.Tensor, KVCache, SeqBucket, AttentionSpec, torch.Tensor, torch.Tensor | None], None
]


def pick_attend(g: SeqBucket, cache: KVCache, spec: AttentionSpec) -> Attend:
    """The compute path of bucket ``g`` for caches shaped like ``cache`` and layers like
    ``spec``: streamed decode (two chunked passes), streamed prefill, padded decode
    (block-diagonal query, while ``num_kv_heads * head_dim <= BLOCK_DIAG_MAX_ROW``; its
    step-constant buffers built here, once) or padded SDPA."""
    if g.streamed:
        return _decode_streamed if g.max_q == 1 else _attend_streamed
    if g.key_bias is not None and cache.num_kv_heads * cache.head_dim <= BLOCK_DIAG_MAX_ROW:
        return partial(_decode_padded, data=padded_decode_data(g, cache, spec))
    return _attend_padded
