"""Attention math of the torch backend: gather, dequantize, attend (vectorized).

Each padded group (see ``plan.py``) is computed with whole tensors: K/V blocks are
gathered with one ``index_select`` per tensor, dequantized, masked positions zeroed,
and attention runs either through ``torch.nn.functional.scaled_dot_product_attention``
(no soft cap) or through explicit float32 matmuls (soft cap, which SDPA lacks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import KVCache
from kvpage.backends.torch_backend.plan import GroupIndex
from kvpage.specs import AttentionSpec

#: query rows per chunk of the explicit path are chosen so that the float32 logits
#: of one chunk stay under this many bytes
LOGITS_BUDGET_BYTES = 64 * 2**20


def compute_dtype(cache: KVCache, query_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention runs in: the cache's for unquantized caches, else float32."""
    return cache.kv.dtype if cache.kv_dtype == "auto" else torch.float32


def gather_group(
    cache: KVCache, g: GroupIndex, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the group's gathered blocks, ``[n, num_keys, num_kv_heads, head_dim]``
    in ``dtype``, dequantized, zero at invalid key positions."""
    n, nb = g.blocks.shape
    bs, h, d = cache.block_size, cache.num_kv_heads, cache.head_dim
    idx = g.blocks.reshape(-1)
    out = []
    for i in (0, 1):
        raw = cache.kv[i].index_select(0, idx)
        kind = cache.kv_dtype
        if kind == "auto":
            x = raw if raw.dtype == dtype else raw.to(dtype)
        elif kind == "int8":
            assert cache.token_scales is not None
            sc = cache.token_scales[i].index_select(0, idx)
            x = raw.to(dtype) * sc.unsqueeze(-1).to(dtype)
        else:
            s = cache.k_scale if i == 0 else cache.v_scale
            assert s is not None
            s = s.to(dtype)
            x = raw.to(dtype) * (s.unsqueeze(-1) if s.dim() == 1 else s)
        x = x.view(n, nb * bs, h, d)
        if g.key_valid is not None:
            x = x.masked_fill(~g.key_valid[:, :, None, None], 0)
        out.append(x)
    return out[0], out[1]


def _attend_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: GroupIndex, spec: AttentionSpec
) -> torch.Tensor:
    """q ``[n, max_q, Hq, D]``, k/v ``[n, L, Hkv, D]`` -> ``[n, max_q, Hq, D]``."""
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


def _attend_explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: GroupIndex, spec: AttentionSpec
) -> torch.Tensor:
    """The same contract as ``_attend_sdpa`` with float32 matmuls and the soft cap
    ``c * tanh(logits / c)`` (Gemma-2), chunked over query rows."""
    n, max_q, hq, d = q.shape
    hkv = spec.num_kv_heads
    grp = hq // hkv
    L = k.shape[1]
    kt = k.float().permute(0, 2, 3, 1).unsqueeze(2)  # [n, Hkv, 1, D, L]
    vt = v.float().permute(0, 2, 1, 3).unsqueeze(2)  # [n, Hkv, 1, L, D]
    qh = q.float().view(n, max_q, hkv, grp, d).permute(0, 2, 3, 1, 4)  # [n, Hkv, G, q, D]
    rows = max(1, LOGITS_BUDGET_BYTES // max(1, 4 * n * hq * L))
    mask = g.attn_mask
    if mask is None and g.is_causal and max_q > 1:
        mask = torch.ones(max_q, L, dtype=torch.bool, device=q.device).tril()[None, None]
    outs = []
    for a in range(0, max_q, rows):
        b = min(max_q, a + rows)
        logits = torch.matmul(qh[:, :, :, a:b], kt) * spec.scale  # [n, Hkv, G, r, L]
        if spec.logits_soft_cap is not None:
            c = spec.logits_soft_cap
            logits = torch.tanh(logits / c) * c
        if mask is not None:
            m = mask[:, :, a:b] if mask.shape[2] > 1 else mask
            logits = logits.masked_fill(~m.unsqueeze(2), float("-inf"))
        outs.append(torch.matmul(torch.softmax(logits, dim=-1), vt))  # [n, Hkv, G, r, D]
    o = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return o.permute(0, 3, 1, 2, 4).reshape(n, max_q, hq, d)


def attend_group(
    query: torch.Tensor,
    cache: KVCache,
    g: GroupIndex,
    spec: AttentionSpec,
    out: torch.Tensor,
) -> None:
    """Compute one group and write its real rows into ``out`` ``[num_tokens, Hq, D]``."""
    dtype = compute_dtype(cache, query.dtype)
    k, v = gather_group(cache, g, dtype)
    n, max_q = g.q_rows.shape
    if g.identity_rows:
        q = query.view(n, 1, *query.shape[1:])
    else:
        q = query.index_select(0, g.q_rows.reshape(-1)).view(n, max_q, *query.shape[1:])
    if q.dtype != dtype:
        q = q.to(dtype)
    if spec.logits_soft_cap is None:
        res = _attend_sdpa(q, k, v, g, spec)
    else:
        res = _attend_explicit(q, k, v, g, spec)
    res = res.reshape(n * max_q, *res.shape[2:])
    if g.identity_rows:
        out.copy_(res)
        return
    if g.q_valid is not None:
        res = res[g.q_valid]
    out.index_copy_(0, g.out_rows, res.to(out.dtype))
