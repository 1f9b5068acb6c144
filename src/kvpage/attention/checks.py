"""Input validation shared by every backend (built-in or plugin).

Each check raises a ``kvpage.errors`` exception with a "name: expected X, got Y"
message *before* any state is touched, so a rejected call changes nothing.
"""

from __future__ import annotations

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import AttentionSpec

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_cache(cache: KVCache) -> None:
    """The cache's tensors agree with its kv dtype (scales present, shapes right)."""
    kv = cache.kv
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise ShapeError(
            f"cache.kv: expected [2, num_blocks, block_size, num_kv_heads, head_dim], got {list(kv.shape)}"
        )
    if cache.kv_dtype == "int8":
        ts = cache.token_scales
        if ts is None or tuple(ts.shape) != tuple(kv.shape[:4]):
            raise ShapeError(
                f"cache.token_scales: expected {list(kv.shape[:4])}, got "
                f"{None if ts is None else list(ts.shape)}"
            )
    elif cache.kv_dtype.startswith("fp8"):
        for name, s in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
            if s is None or s.dim() > 1 or (s.dim() == 1 and s.shape[0] != kv.shape[3]):
                raise ShapeError(
                    f"cache.{name}: expected [] or [{kv.shape[3]}], got "
                    f"{None if s is None else list(s.shape)}"
                )


def check_write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Validate ``write_kv`` arguments (see ``AttentionBackend.write_kv``).

    Raises:
        ShapeError: shapes disagree, or a slot is outside ``[-1, num_blocks * block_size)``.
        DTypeError: key/value not float32|float16|bfloat16, or slot_mapping not integer.
    """
    check_cache(cache)
    want = (cache.num_kv_heads, cache.head_dim)
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or tuple(x.shape[1:]) != want:
            raise ShapeError(
                f"{name}: expected [num_tokens, {want[0]}, {want[1]}], got {list(x.shape)}"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise DTypeError(f"{name}: expected float32|float16|bfloat16, got {x.dtype}")
        if x.device != cache.kv.device:
            raise ShapeError(f"{name}.device: expected {cache.kv.device}, got {x.device}")
    if key.shape[0] != value.shape[0]:
        raise ShapeError(f"value: expected {key.shape[0]} tokens like key, got {value.shape[0]}")
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise DTypeError(f"slot_mapping: expected int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping: expected [{key.shape[0]}], got {list(slot_mapping.shape)}")
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        n = cache.num_blocks * cache.block_size
        if lo < -1 or hi >= n:
            raise ShapeError(f"slot_mapping: expected values in [-1, {n - 1}], got [{lo}, {hi}]")


def check_attention(
    query: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    spec: AttentionSpec,
    out: torch.Tensor | None,
    *,
    decode: bool,
) -> None:
    """Validate ``decode``/``prefill`` arguments.

    Raises:
        ShapeError: query/out/cache shapes disagree with the spec or the metadata
            (decode needs exactly one query token per sequence).
        DTypeError: query or out not float32|float16|bfloat16, or out's dtype differs.
    """
    check_cache(cache)
    hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    if (cache.num_kv_heads, cache.head_dim) != (hkv, d):
        raise ShapeError(
            f"cache: expected num_kv_heads={hkv}, head_dim={d}, got "
            f"{cache.num_kv_heads}, {cache.head_dim}"
        )
    rows = meta.num_seqs if decode else meta.num_tokens
    if decode and any(q != 1 for q in meta.query_lens_cpu):
        raise ShapeError(
            f"meta.query_lens: expected all 1 for decode, got max {meta.max_query_len}"
        )
    if query.dim() != 3 or tuple(query.shape) != (rows, hq, d):
        raise ShapeError(f"query: expected [{rows}, {hq}, {d}], got {list(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"query: expected float32|float16|bfloat16, got {query.dtype}")
    if query.device != cache.kv.device:
        raise ShapeError(f"query.device: expected {cache.kv.device}, got {query.device}")
    if out is not None:
        if tuple(out.shape) != tuple(query.shape):
            raise ShapeError(f"out: expected {list(query.shape)}, got {list(out.shape)}")
        if out.dtype != query.dtype:
            raise DTypeError(f"out: expected {query.dtype}, got {out.dtype}")
    width = meta.block_tables.shape[1] if meta.block_tables.dim() == 2 else 0
    bs = cache.block_size
    for i, s in enumerate(meta.seq_lens_cpu):
        if -(-s // bs) > width:
            raise ShapeError(
                f"meta.block_tables[{i}]: expected >= {-(-s // bs)} blocks for {s} tokens, got {width}"
            )


def check_block_pairs(pairs: torch.Tensor, num_blocks: int) -> None:
    """``pairs``: ``[n, 2]`` integer block ids in ``[0, num_blocks)``."""
    if pairs.dtype.is_floating_point or pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ShapeError(f"pairs: expected [n, 2] int64, got {list(pairs.shape)} {pairs.dtype}")
    if pairs.numel():
        lo, hi = int(pairs.min()), int(pairs.max())
        if lo < 0 or hi >= num_blocks:
            raise ShapeError(
                f"pairs: expected block ids in [0, {num_blocks - 1}], got [{lo}, {hi}]"
            )
