"""The float64 reference: the executable spec of paged attention.

Slow on purpose, one sequence and one query token at a time, gathering K/V through
the block table. Never used by the engine; every backend is tested against it.

Semantics (see ``kvpage.specs`` for sources): logits = scale * q.k; with a soft cap c,
logits = c * tanh(logits / c); a query at position p sees keys
max(0, p - W + 1) .. p (W = sliding window, all keys up to p when None); query head h
reads KV head h // (num_q_heads // num_kv_heads); softmax in float64.
"""

from __future__ import annotations

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8
from kvpage.specs import AttentionSpec


def reference_write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K/V to its slot, one token at a time (-1 = skip).

    Mutates ``cache`` (``kv`` and, for int8, ``token_scales``) at the mapped slots only.
    """
    bs = cache.block_size
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, o = divmod(int(slot), bs)
        for i, x in enumerate((key[t], value[t])):
            kind = cache.kv_dtype
            if kind == "auto":
                cache.kv[i, b, o] = x.to(cache.kv.dtype)
            elif kind == "int8":
                codes, scales = quantize_int8(x)
                assert cache.token_scales is not None
                cache.kv[i, b, o] = codes
                cache.token_scales[i, b, o] = scales
            else:
                s = cache.k_scale if i == 0 else cache.v_scale
                assert s is not None
                cache.kv[i, b, o] = quantize_fp8(x, s, cache.kv.dtype)


def gather_kv(
    cache: KVCache, block_table: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K and V of positions ``0 .. seq_len-1`` of one sequence, float64,
    each ``[seq_len, num_kv_heads, head_dim]``."""
    bs = cache.block_size
    rows = [(block_table[p // bs], p % bs) for p in range(seq_len)]
    out = []
    for i in (0, 1):
        toks = []
        for b, o in rows:
            stored = cache.kv[i, b, o]
            if cache.kv_dtype == "int8":
                assert cache.token_scales is not None
                toks.append(dequantize_int8(stored, cache.token_scales[i, b, o]))
            elif cache.kv_dtype.startswith("fp8"):
                s = cache.k_scale if i == 0 else cache.v_scale
                assert s is not None
                toks.append(dequantize_fp8(stored, s))
            else:
                toks.append(stored.float())
        if toks:
            out.append(torch.stack(toks).double().cpu())
        else:
            out.append(torch.zeros(0, cache.num_kv_heads, cache.head_dim, dtype=torch.float64))
    return out[0], out[1]


def reference_attention(
    query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, spec: AttentionSpec
) -> torch.Tensor:
    """Paged attention for every new token of the step (decode or prefill alike).

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]`` any float dtype.
        cache: the layer's cache, already holding this step's K/V.
        meta: the step (query_start_loc, seq_lens, block_tables).
        spec: the layer's attention spec.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` float64.
    """
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = spec.num_q_heads // spec.num_kv_heads
    qsl = meta.query_start_loc.tolist()
    tables = meta.block_tables.tolist()
    for s in range(meta.num_seqs):
        seq_len = meta.seq_lens_cpu[s]
        k, v = gather_kv(cache, tables[s], seq_len)
        start, end = qsl[s], qsl[s + 1]
        context = seq_len - (end - start)
        for j, t in enumerate(range(start, end)):
            p = context + j
            lo = 0 if spec.sliding_window is None else max(0, p - spec.sliding_window + 1)
            for h in range(spec.num_q_heads):
                q = query[t, h].double().cpu()
                kh = k[lo : p + 1, h // group]
                logits = (kh @ q) * spec.scale
                if spec.logits_soft_cap is not None:
                    c = spec.logits_soft_cap
                    logits = c * torch.tanh(logits / c)
                w = torch.softmax(logits, dim=0)
                out[t, h] = w @ v[lo : p + 1, h // group]
    return out


def reference_contiguous(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, context_len: int = 0
) -> torch.Tensor:
    """Attention with no paging at all: one sequence, contiguous float K/V.

    Args:
        q: ``[q_len, num_q_heads, head_dim]`` for positions ``context_len ..``.
        k, v: ``[seq_len, num_kv_heads, head_dim]`` for positions ``0 .. seq_len-1``.

    Returns:
        ``[q_len, num_q_heads, head_dim]`` float64.
    """
    group = spec.num_q_heads // spec.num_kv_heads
    kd, vd = k.double(), v.double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        p = context_len + j
        lo = 0 if spec.sliding_window is None else max(0, p - spec.sliding_window + 1)
        for h in range(spec.num_q_heads):
            logits = (kd[lo : p + 1, h // group] @ q[j, h].double()) * spec.scale
            if spec.logits_soft_cap is not None:
                c = spec.logits_soft_cap
                logits = c * torch.tanh(logits / c)
            out[j, h] = torch.softmax(logits, 0) @ vd[lo : p + 1, h // group]
    return out
