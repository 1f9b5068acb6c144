"""The float64 reference: the executable spec of paged attention.

Slow on purpose, one sequence and one query token at a time, gathering K/V through
the block table. Never used by the engine; every backend is tested against it.

Semantics (see ``kvpage.specs`` for sources): logits = scale * q.k; with a soft cap c,
logits = c * tanh(logits / c); a query at position p sees keys
max(0, p - W + 1) .. p (W = sliding window, all keys up to p when None); query head h
reads KV head h // (num_q_heads // num_kv_heads); softmax in float64. With attention
sinks (``spec.sinks``, gpt-oss) the softmax of query head h runs over the logits and
one more logit ``sinks[h]`` whose probability is dropped:
``p_j = exp(l_j) / (exp(sinks[h]) + sum_i exp(l_i))`` (HF ``eager_attention_forward``
in transformers/models/gpt_oss/modeling_gpt_oss.py: concatenate, softmax, drop).

MLA (``spec.kv_lora_rank``; DeepSeek-V2, arXiv:2405.04434, eqs. 9-11 with the up-
projections absorbed, appendix C; HF ``DeepseekV3Attention``): the cache holds one
latent ``c`` of ``head_dim = kv_lora_rank + qk_rope_head_dim`` elements per token and
the query is the absorbed query ``[W_UK^T q_nope, q_rope]`` of the same width; logits
= scale * q . c over all ``head_dim`` elements, output = softmax . c[:kv_lora_rank]
(``[num_q_heads, kv_lora_rank]`` per token; the model applies ``W_UV`` after).
"""

from __future__ import annotations

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8
from kvpage.specs import AttentionSpec


def reference_write_kv(
    key: torch.Tensor, value: torch.Tensor | None, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K/V to its slot, one token at a time (-1 = skip); an MLA
    latent cache takes the latent as ``key`` and ``value=None`` (fp8: ``k_scale``).

    Mutates ``cache`` (``kv`` and, for int8, ``token_scales``) at the mapped slots only.
    """
    bs = cache.block_size
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, o = divmod(int(slot), bs)
        rows = (key[t],) if value is None else (key[t], value[t])
        for i, x in enumerate(rows):
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
    each ``[seq_len, num_kv_heads, head_dim]`` (an MLA latent cache: the latent twice)."""
    bs = cache.block_size
    rows = [(block_table[p // bs], p % bs) for p in range(seq_len)]
    out = []
    for i in (0,) if cache.is_latent else (0, 1):
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
    return out[0], out[-1]


def softmax_with_sink(logits: torch.Tensor, sink: float | None) -> torch.Tensor:
    """``softmax(logits)`` over the last dim (float64), with a sink logit: the softmax
    of ``[logits, sink]`` without its last entry (the sink attends to nothing)."""
    if sink is None:
        return torch.softmax(logits, dim=-1)
    col = torch.full((*logits.shape[:-1], 1), sink, dtype=logits.dtype)
    return torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]


def _sink_values(sinks: torch.Tensor | None, spec: AttentionSpec) -> list[float] | None:
    if not spec.sinks:
        if sinks is not None:
            raise ValueError("sinks: expected None (spec.sinks is False), got a tensor")
        return None
    if sinks is None or tuple(sinks.shape) != (spec.num_q_heads,):
        got = None if sinks is None else list(sinks.shape)
        raise ValueError(f"sinks: expected [{spec.num_q_heads}], got {got}")
    return [float(x) for x in sinks.detach().double().cpu()]


def reference_attention(
    query: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    spec: AttentionSpec,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention for every new token of the step (decode or prefill alike).

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]`` any float dtype (MLA: the
            absorbed query).
        cache: the layer's cache, already holding this step's K/V (MLA: latents).
        meta: the step (query_start_loc, seq_lens, block_tables).
        spec: the layer's attention spec.
        sinks: ``[num_q_heads]`` sink logits exactly when ``spec.sinks``.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` float64 (MLA: ``[num_tokens,
        num_q_heads, kv_lora_rank]``).
    """
    out = torch.zeros((*query.shape[:2], spec.value_dim), dtype=torch.float64)
    group = spec.num_q_heads // spec.num_kv_heads
    sink = _sink_values(sinks, spec)
    qsl = meta.query_start_loc.tolist()
    tables = meta.block_tables.tolist()
    for s in range(meta.num_seqs):
        seq_len = meta.seq_lens_cpu[s]
        k, v = gather_kv(cache, tables[s], seq_len)
        v = v[..., : spec.value_dim]  # MLA: the values are the latent's first elements
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
                w = softmax_with_sink(logits, None if sink is None else sink[h])
                out[t, h] = w @ v[lo : p + 1, h // group]
    return out


def reference_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    context_len: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with no paging at all: one sequence, contiguous float K/V.

    Args:
        q: ``[q_len, num_q_heads, head_dim]`` for positions ``context_len ..``.
        k, v: ``[seq_len, num_kv_heads, head_dim]`` for positions ``0 .. seq_len-1``.
        sinks: ``[num_q_heads]`` sink logits exactly when ``spec.sinks``.

    Returns:
        ``[q_len, num_q_heads, head_dim]`` float64.
    """
    group = spec.num_q_heads // spec.num_kv_heads
    kd, vd = k.double(), v.double()
    sink = _sink_values(sinks, spec)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        p = context_len + j
        lo = 0 if spec.sliding_window is None else max(0, p - spec.sliding_window + 1)
        for h in range(spec.num_q_heads):
            logits = (kd[lo : p + 1, h // group] @ q[j, h].double()) * spec.scale
            if spec.logits_soft_cap is not None:
                c = spec.logits_soft_cap
                logits = c * torch.tanh(logits / c)
            w = softmax_with_sink(logits, None if sink is None else sink[h])
            out[j, h] = w @ vd[lo : p + 1, h // group]
    return out
