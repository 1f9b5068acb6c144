"""Launcher-side validation of the Triton backend (pure torch; no triton import).

Kernels never check anything: every argument is checked here, before any state changes,
and errors read ``"name: expected X, got Y"`` (``kvpage.errors``). The launcher checks
shared by the plugin backends (``kvpage.attention.checks.check_launch_*``: layout, dtypes,
devices, block ids) run first, so backends agree on which error a bad call raises; the
checks here add what Triton's pointer arithmetic needs: unit inner strides and a
model-dtype cache in the query dtype.
"""

from __future__ import annotations

import torch

from kvpage.attention import checks as shared
from kvpage.attention.metadata import FP8_MAX, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import AttentionSpec


def _check_unit_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ShapeError(f"{name}.stride(-1): expected 1, got {t.stride(-1)}")


def check_cache(cache: KVCache, name: str = "cache") -> str:
    """``shared.check_launch_cache`` plus a contiguous last dimension; return the
    cache's ``kv_dtype``.

    Raises:
        ShapeError: ``kv`` is not ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
            with a contiguous last dimension, a scale tensor has the wrong shape or is on
            another device.
        DTypeError: unsupported storage dtype, scales not float32.
    """
    kind = shared.check_launch_cache(cache, name)
    _check_unit_stride(f"{name}.kv", cache.kv)
    return kind


def check_write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Validate ``write_kv`` arguments (see ``AttentionBackend.write_kv``).

    Raises:
        ShapeError / DTypeError: as named in the message; a slot out of range raises
        ShapeError (checked only when the slot mapping is on the CPU: on CUDA the caller
        guarantees ``-1 <= slot < num_blocks * block_size`` and the kernel skips -1).
    """
    shared.check_launch_write(key, value, cache, slot_mapping)
    _check_unit_stride("cache.kv", cache.kv)
    for name, x in (("key", key), ("value", value)):
        _check_unit_stride(name, x)


def check_forward(
    query: torch.Tensor,
    cache: KVCache,
    plan: StepPlan,
    spec: AttentionSpec,
    out: torch.Tensor | None,
) -> str:
    """Validate one layer's ``forward`` arguments (the step was validated when the plan
    was built); return the cache's ``kv_dtype``.

    Raises:
        ShapeError: shapes disagree with ``spec``/the plan, block tables too narrow,
            (CPU tensors) block ids out of range, a tensor on another device than the
            cache, or an inner stride other than 1.
        DTypeError: unsupported dtypes, or a model-dtype cache whose dtype is not the
            query's.
    """
    kind = shared.check_launch_forward(query, cache, plan, spec, out)
    kv = cache.kv
    _check_unit_stride("cache.kv", kv)
    if kind == "auto" and kv.dtype != query.dtype:
        raise DTypeError(f"cache.kv.dtype: expected {query.dtype} (query dtype), got {kv.dtype}")
    _check_unit_stride("query", query)
    if out is not None:
        _check_unit_stride("out", out)
    return kind


def fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """(max finite value, mantissa bits, smallest normal exponent) of an fp8 dtype
    (OCP 8-bit floating point spec, 2023: e4m3 bias 7, e5m2 bias 15)."""
    if dtype == torch.float8_e4m3fn:
        return FP8_MAX[dtype], 3, -6
    return FP8_MAX[dtype], 2, -14
