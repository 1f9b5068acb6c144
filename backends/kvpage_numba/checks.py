"""Launcher-side validation shared by the numba and cupy plugin backends.

Pure Python + torch (no numba, no cupy): the kernels trust their inputs, so every
check lives here and raises a ``kvpage.errors`` error reading "name: expected X, got Y"
before anything is launched or written. The checks every backend shares
(``kvpage.attention.checks``) run first, so all backends raise the same error for the
same bad call; these add what raw-array kernels need (scale dtypes and devices, the
cache dtype for ``kv_dtype="auto"``, block-table dtype and ids, independent copies).
"""

from __future__ import annotations

import torch

from kvpage.attention import checks as shared
from kvpage.attention.metadata import MODEL_DTYPES, AttentionMetadata, KVCache
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import AttentionSpec

_QUERY_DTYPES = tuple(MODEL_DTYPES.values())


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ShapeError(f"{name}.device: expected {device}, got {t.device}")


def check_cache(cache: KVCache) -> None:
    """The cache is in the canonical layout with the scales its kv dtype needs.

    Raises:
        ShapeError: wrong rank, missing or misshapen scales.
        DTypeError: scales not float32.
    """
    kv = cache.kv
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise ShapeError(
            "cache.kv: expected [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv.shape)}"
        )
    nb, bs, h = kv.shape[1], kv.shape[2], kv.shape[3]
    kind = cache.kv_dtype
    if kind == "int8":
        ts = cache.token_scales
        if ts is None or tuple(ts.shape) != (2, nb, bs, h):
            got = None if ts is None else tuple(ts.shape)
            raise ShapeError(f"cache.token_scales: expected {(2, nb, bs, h)}, got {got}")
        if ts.dtype != torch.float32:
            raise DTypeError(f"cache.token_scales: expected float32, got {ts.dtype}")
        _same_device("cache.token_scales", ts, kv.device)
    elif kind.startswith("fp8"):
        for nm, s in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
            if s is None or tuple(s.shape) not in ((), (h,)):
                got = None if s is None else tuple(s.shape)
                raise ShapeError(f"cache.{nm}: expected shape () or ({h},), got {got}")
            if s.dtype != torch.float32:
                raise DTypeError(f"cache.{nm}: expected float32, got {s.dtype}")
            _same_device(f"cache.{nm}", s, kv.device)
    elif kv.dtype not in _QUERY_DTYPES:
        raise DTypeError(f"cache.kv: expected a model or kv dtype, got {kv.dtype}")


def check_write(
    key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Validate ``write_kv`` arguments (see ``AttentionBackend.write_kv``).

    Raises:
        ShapeError: shapes or devices disagree, or a slot is outside ``[-1, num_slots)``.
        DTypeError: key/value not a model dtype, differing, or (``kv_dtype == "auto"``)
            not the cache dtype; slot_mapping not an integer tensor.
    """
    shared.check_write_kv(key, value, cache, slot_mapping)
    check_cache(cache)
    dev = cache.kv.device
    want = (key.shape[0] if key.dim() else 0, cache.num_kv_heads, cache.head_dim)
    for nm, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape) != want:
            raise ShapeError(f"{nm}: expected [num_tokens, {want[1]}, {want[2]}], got {tuple(t.shape)}")  # fmt: skip
        if t.dtype not in _QUERY_DTYPES:
            raise DTypeError(f"{nm}: expected float32|float16|bfloat16, got {t.dtype}")
        _same_device(nm, t, dev)
    if value.dtype != key.dtype:
        raise DTypeError(f"value: expected {key.dtype} (the key dtype), got {value.dtype}")
    if cache.kv_dtype == "auto" and key.dtype != cache.kv.dtype:
        raise DTypeError(f"key: expected the cache dtype {cache.kv.dtype}, got {key.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping: expected [{key.shape[0]}], got {tuple(slot_mapping.shape)}")  # fmt: skip
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise DTypeError(f"slot_mapping: expected int64, got {slot_mapping.dtype}")
    _same_device("slot_mapping", slot_mapping, dev)
    if slot_mapping.numel():
        num_slots = cache.num_blocks * cache.block_size
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            bad = lo if lo < -1 else hi
            raise ShapeError(f"slot_mapping: expected slots in [-1, {num_slots}), got {bad}")


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
        ShapeError: query/out/cache/spec/metadata shapes or devices disagree; ``decode``
            with a query length other than 1; block tables too narrow.
        DTypeError: query not float32|float16|bfloat16, out not the query dtype.
    """
    shared.check_attention(query, cache, meta, spec, out, decode=decode)
    check_cache(cache)
    dev = cache.kv.device
    hq, hd = spec.num_q_heads, spec.head_dim
    if spec.num_kv_heads != cache.num_kv_heads or hd != cache.head_dim:
        raise ShapeError(
            f"cache: expected num_kv_heads={spec.num_kv_heads}, head_dim={hd} (the spec), "
            f"got {cache.num_kv_heads}, {cache.head_dim}"
        )
    n = meta.num_tokens
    if query.dim() != 3 or tuple(query.shape) != (n, hq, hd):
        raise ShapeError(f"query: expected {(n, hq, hd)}, got {tuple(query.shape)}")
    if query.dtype not in _QUERY_DTYPES:
        raise DTypeError(f"query: expected float32|float16|bfloat16, got {query.dtype}")
    _same_device("query", query, dev)
    if decode and any(q != 1 for q in meta.query_lens_cpu):
        raise ShapeError(f"meta.query_lens_cpu: expected all 1 for decode, got {meta.query_lens_cpu}")  # fmt: skip
    if out is not None:
        if tuple(out.shape) != tuple(query.shape):
            raise ShapeError(f"out: expected {tuple(query.shape)}, got {tuple(out.shape)}")
        if out.dtype != query.dtype:
            raise DTypeError(f"out: expected {query.dtype} (the query dtype), got {out.dtype}")
        _same_device("out", out, dev)
    if len(meta.query_lens_cpu) != len(meta.seq_lens_cpu):
        raise ShapeError(
            f"meta.query_lens_cpu: expected {len(meta.seq_lens_cpu)} entries, "
            f"got {len(meta.query_lens_cpu)}"
        )
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q < 0 or q > s:
            raise ShapeError(f"meta.query_lens_cpu[{i}]: expected 0 <= q <= {s}, got {q}")
    bt = meta.block_tables
    if bt.dim() != 2 or bt.shape[0] != meta.num_seqs:
        raise ShapeError(f"meta.block_tables: expected [{meta.num_seqs}, max_blocks], got {tuple(bt.shape)}")  # fmt: skip
    need = -(-max(meta.seq_lens_cpu, default=0) // cache.block_size)
    if bt.shape[1] < need:
        raise ShapeError(f"meta.block_tables: expected >= {need} columns, got {bt.shape[1]}")
    if bt.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"meta.block_tables: expected int32, got {bt.dtype}")
    if bt.device.type == "cpu" and dev.type == "cpu":
        _check_table_ids(meta, cache)


def _check_table_ids(meta: AttentionMetadata, cache: KVCache) -> None:
    """Block ids that will be read are inside the pool (host tensors only: no sync)."""
    bs = cache.block_size
    for i, s in enumerate(meta.seq_lens_cpu):
        used = meta.block_tables[i, : -(-s // bs)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache.num_blocks):
            raise ShapeError(
                f"meta.block_tables[{i}]: expected ids in [0, {cache.num_blocks}), "
                f"got {used.tolist()}"
            )


def check_pairs(caches: list[KVCache], pairs: torch.Tensor) -> torch.Tensor:
    """Validate ``copy_blocks`` pairs; return them as a host int64 ``[n, 2]`` tensor.

    Destinations must be distinct and never a source, so the copies are independent of
    their order (what a parallel kernel does).

    Raises:
        ShapeError: not ``[n, 2]``, an id outside a cache's pool, a repeated
            destination, or a destination that is also a source.
        DTypeError: not an integer tensor.
    """
    for c in caches:
        shared.check_block_pairs(pairs, c.num_blocks)
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ShapeError(f"pairs: expected [n, 2], got {tuple(pairs.shape)}")
    if pairs.dtype not in (torch.int64, torch.int32):
        raise DTypeError(f"pairs: expected int64, got {pairs.dtype}")
    host = pairs.detach().to("cpu", torch.int64)
    rows = host.tolist()
    dsts = [d for _, d in rows]
    if len(set(dsts)) != len(dsts):
        raise ShapeError(f"pairs[:, 1]: expected distinct destination blocks, got {dsts}")
    overlap = set(dsts) & {s for s, _ in rows}
    if overlap:
        raise ShapeError(f"pairs: expected no block as both source and destination, got {sorted(overlap)}")  # fmt: skip
    for li, c in enumerate(caches):
        check_cache(c)
        for r, (s, d) in enumerate(rows):
            for v in (s, d):
                if not 0 <= v < c.num_blocks:
                    raise ShapeError(f"pairs[{r}]: expected block ids in [0, {c.num_blocks}) for cache {li}, got {v}")  # fmt: skip
    return host


def plan_token_map(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """Sequence index and absolute position of every query row, from host lists."""
    seq: list[int] = []
    pos: list[int] = []
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        seq.extend([i] * q)
        pos.extend(range(s - q, s))
    return seq, pos


def max_keys_per_query(meta: AttentionMetadata, spec: AttentionSpec) -> int:
    """The most keys any query row of the step attends to (window included)."""
    best = 0
    for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        if q > 0:
            best = max(best, s if spec.sliding_window is None else min(s, spec.sliding_window))
    return best
