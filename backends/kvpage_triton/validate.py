"""Launcher-side validation of the Triton backend (pure torch; no triton import).

Kernels never check anything: every argument is checked here, before any state changes,
and errors read ``"name: expected X, got Y"`` (``kvpage.errors``). The checks shared by
every backend (``kvpage.attention.checks``) run first, so backends agree on which error a
bad call raises; the checks here add what raw-pointer kernels need (unit inner strides,
index dtypes, devices of every tensor, block ids in range).
"""

from __future__ import annotations

import torch

from kvpage.attention import checks as shared
from kvpage.attention.metadata import FP8_MAX, KV_STORAGE_DTYPES, AttentionMetadata, KVCache
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import AttentionSpec

MODEL_TORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Raise DTypeError if ``t`` is not on ``device`` (a tensor type includes its device)."""
    if t.device != device:
        raise DTypeError(f"{name}.device: expected {device}, got {t.device}")


def check_cache(cache: KVCache, name: str = "cache") -> str:
    """Check a KVCache's layout, dtypes and scale tensors; return its ``kv_dtype``.

    Raises:
        ShapeError: ``kv`` is not ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
            with a contiguous last dimension, or a scale tensor has the wrong shape.
        DTypeError: unsupported storage dtype, scales not float32, or on another device.
    """
    kv = cache.kv
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise ShapeError(
            f"{name}.kv: expected [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {list(kv.shape)}"
        )
    if kv.stride(-1) != 1:
        raise ShapeError(f"{name}.kv.stride(-1): expected 1, got {kv.stride(-1)}")
    if kv.dtype not in MODEL_TORCH_DTYPES and kv.dtype not in KV_STORAGE_DTYPES.values():
        raise DTypeError(
            f"{name}.kv.dtype: expected float32|float16|bfloat16|int8|float8_e4m3fn|"
            f"float8_e5m2, got {kv.dtype}"
        )
    kind = cache.kv_dtype
    nb, bs, hk = kv.shape[1], kv.shape[2], kv.shape[3]
    if kind == "int8":
        ts = cache.token_scales
        if ts is None:
            raise ShapeError(f"{name}.token_scales: expected [2, {nb}, {bs}, {hk}], got None")
        if list(ts.shape) != [2, nb, bs, hk]:
            raise ShapeError(
                f"{name}.token_scales: expected [2, {nb}, {bs}, {hk}], got {list(ts.shape)}"
            )
        if ts.dtype != torch.float32:
            raise DTypeError(f"{name}.token_scales.dtype: expected float32, got {ts.dtype}")
        check_device(f"{name}.token_scales", ts, kv.device)
    elif kind.startswith("fp8"):
        for sname, s in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
            if s is None or s.dim() > 1 or (s.dim() == 1 and s.shape[0] != hk):
                got = None if s is None else list(s.shape)
                raise ShapeError(f"{name}.{sname}: expected [] or [{hk}], got {got}")
            if s.dtype != torch.float32:
                raise DTypeError(f"{name}.{sname}.dtype: expected float32, got {s.dtype}")
            check_device(f"{name}.{sname}", s, kv.device)
    return kind


def check_write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Validate ``write_kv`` arguments (see ``AttentionBackend.write_kv``).

    Raises:
        ShapeError / DTypeError: as named in the message; a slot out of range raises
        ShapeError (checked on the host copy when the slot mapping is on the CPU).
    """
    shared.check_write_kv(key, value, cache, slot_mapping)
    kind = check_cache(cache)
    kv = cache.kv
    _, nb, bs, hk, hd = kv.shape
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or x.shape[1] != hk or x.shape[2] != hd:
            raise ShapeError(f"{name}: expected [num_tokens, {hk}, {hd}], got {list(x.shape)}")
        if x.dtype not in MODEL_TORCH_DTYPES:
            raise DTypeError(f"{name}.dtype: expected float32|float16|bfloat16, got {x.dtype}")
        if kind == "auto" and x.dtype != kv.dtype:
            raise DTypeError(f"{name}.dtype: expected {kv.dtype} (the cache dtype), got {x.dtype}")
        if x.stride(-1) != 1:
            raise ShapeError(f"{name}.stride(-1): expected 1, got {x.stride(-1)}")
        check_device(name, x, kv.device)
    if value.shape[0] != key.shape[0]:
        raise ShapeError(f"value.shape[0]: expected {key.shape[0]}, got {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping: expected [{key.shape[0]}], got {list(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise DTypeError(f"slot_mapping.dtype: expected int64, got {slot_mapping.dtype}")
    check_device("slot_mapping", slot_mapping, kv.device)
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= nb * bs:
            bad = lo if lo < -1 else hi
            raise ShapeError(f"slot_mapping: expected values in [-1, {nb * bs}), got {bad}")


def check_attention(
    query: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    spec: AttentionSpec,
    out: torch.Tensor | None,
    *,
    decode: bool,
) -> str:
    """Validate ``decode``/``prefill`` arguments; return the cache's ``kv_dtype``.

    Raises:
        ShapeError: shapes disagree with ``spec``/``meta``, a query longer than its
            sequence, block tables too narrow, or (CPU tensors) block ids out of range.
        DTypeError: unsupported dtypes, a model-dtype cache whose dtype is not the
            query's, tensors on different devices.
    """
    shared.check_attention(query, cache, meta, spec, out, decode=decode)
    kind = check_cache(cache)
    kv = cache.kv
    _, nb, bs, hk, hd = kv.shape
    dev = kv.device
    if hk != spec.num_kv_heads or hd != spec.head_dim:
        raise ShapeError(
            f"cache.kv: expected num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim} "
            f"(from spec), got {hk}, {hd}"
        )
    n = meta.num_seqs
    rows = n if decode else meta.num_tokens
    want = [rows, spec.num_q_heads, spec.head_dim]
    if list(query.shape) != want:
        raise ShapeError(f"query: expected {want}, got {list(query.shape)}")
    if query.dtype not in MODEL_TORCH_DTYPES:
        raise DTypeError(f"query.dtype: expected float32|float16|bfloat16, got {query.dtype}")
    if kind == "auto" and kv.dtype != query.dtype:
        raise DTypeError(f"cache.kv.dtype: expected {query.dtype} (query dtype), got {kv.dtype}")
    if query.stride(-1) != 1:
        raise ShapeError(f"query.stride(-1): expected 1, got {query.stride(-1)}")
    check_device("query", query, dev)
    if out is not None:
        if list(out.shape) != want:
            raise ShapeError(f"out: expected {want}, got {list(out.shape)}")
        if out.dtype != query.dtype:
            raise DTypeError(f"out.dtype: expected {query.dtype}, got {out.dtype}")
        if out.stride(-1) != 1:
            raise ShapeError(f"out.stride(-1): expected 1, got {out.stride(-1)}")
        check_device("out", out, dev)
    if decode and any(q != 1 for q in meta.query_lens_cpu):
        bad = next(q for q in meta.query_lens_cpu if q != 1)
        raise ShapeError(f"meta.query_lens_cpu: expected all 1 for decode, got {bad}")
    if len(meta.query_lens_cpu) != n:
        raise ShapeError(
            f"meta.query_lens_cpu: expected {n} entries, got {len(meta.query_lens_cpu)}"
        )
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q < 0 or s < q:
            raise ShapeError(f"meta.query_lens_cpu[{i}]: expected 0 <= q <= seq_len={s}, got {q}")
    for name, t, shape, dt in (
        ("meta.query_start_loc", meta.query_start_loc, [n + 1], torch.int32),
        ("meta.seq_lens", meta.seq_lens, [n], torch.int32),
    ):
        if list(t.shape) != shape:
            raise ShapeError(f"{name}: expected {shape}, got {list(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise DTypeError(f"{name}.dtype: expected {dt}, got {t.dtype}")
        check_device(name, t, dev)
    bt = meta.block_tables
    if bt.dim() != 2 or bt.shape[0] != n:
        raise ShapeError(f"meta.block_tables: expected [{n}, max_blocks], got {list(bt.shape)}")
    if bt.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"meta.block_tables.dtype: expected torch.int32, got {bt.dtype}")
    check_device("meta.block_tables", bt, dev)
    need = -(-max(meta.seq_lens_cpu, default=0) // bs)
    if n and bt.shape[1] < need:
        raise ShapeError(f"meta.block_tables.shape[1]: expected >= {need}, got {bt.shape[1]}")
    if dev.type == "cpu":
        for i, s in enumerate(meta.seq_lens_cpu):
            used = bt[i, : -(-s // bs)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nb):
                bad = int(used.min()) if int(used.min()) < 0 else int(used.max())
                raise ShapeError(f"meta.block_tables[{i}]: expected ids in [0, {nb}), got {bad}")
    return kind


def fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """(max finite value, mantissa bits, smallest normal exponent) of an fp8 dtype
    (OCP 8-bit floating point spec, 2023: e4m3 bias 7, e5m2 bias 15)."""
    if dtype == torch.float8_e4m3fn:
        return FP8_MAX[dtype], 3, -6
    return FP8_MAX[dtype], 2, -14
