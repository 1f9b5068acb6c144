"""The CuPy backend: raw CUDA C kernels (``kernels/*.cu``) loaded with ``cupy.RawModule``.

cupy is imported lazily (inside methods): importing this module needs only torch. Torch
tensors reach the kernels zero-copy as raw device pointers (``data_ptr``) plus element
strides, on torch's current stream (``cupy.cuda.ExternalStream``), so no tensor is ever
copied or converted to a cupy array. Templates are instantiated per call signature by
NVRTC (``name_expressions``) and cached per process.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np
import torch

from kvpage.attention import checks
from kvpage.attention.canonical import (
    TokenMapPlan,
    fp8_scale_table,
    head_dim_reasons,
    mla_reasons,
    refuse_latent_write,
    refuse_mla,
    refuse_sinks,
    sinks_reasons,
)
from kvpage.attention.metadata import FP8_MAX, AttentionMetadata, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import BackendCapabilities
from kvpage.errors import ShapeError
from kvpage.specs import AttentionSpec, CacheSpec
from kvpage_cupy import templates

#: the attention kernel's threads per block (NUM_WARPS * 32 in attention.cu)
ATTENTION_THREADS = 128


@cache
def _function(source: str, expr: str, options: tuple[str, ...]) -> Any:
    """Compile (once per process) and return the kernel named by ``expr``."""
    import cupy

    mod = cupy.RawModule(
        code=templates.read_source(source), options=options, name_expressions=[expr]
    )
    return mod.get_function(expr)


def _i64(x: int) -> Any:
    return np.int64(x)


def _i32(x: int) -> Any:
    return np.int32(x)


def _f32(x: float) -> Any:
    return np.float32(x)


def _ptr(t: torch.Tensor) -> Any:
    return np.uint64(t.data_ptr())


class CupyBackend:
    """Paged attention with raw CUDA C kernels through CuPy (CUDA GPUs, sm_80+).

    Args:
        num_splits: force this many KV splits for attention; ``None`` = split when
            ``num_tokens * num_q_heads / GT`` blocks would not fill twice the SM count,
            into chunks of at least 256 keys (at most 64 splits).
        prefill_kernel: ``auto`` (one warp per query row when the step has a query
            longer than 1 and no KV split, else one block per row), ``rows`` or
            ``block`` to force one (tests use it).
    """

    name = "cupy"
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda"}),
        priority={"cuda": 20},  # after triton, before numba (docs/benchmarks.md)
        max_head_dim=templates.MAX_HEAD_DIM,
        min_compute_capability=(8, 0),
        notes=("head_dim templated per size (NVRTC instance per head_dim)",),
    )

    def __init__(self, *, num_splits: int | None = None, prefill_kernel: str = "auto") -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
        if prefill_kernel not in ("auto", "rows", "block"):
            raise ValueError(f"prefill_kernel: expected auto, rows or block, got {prefill_kernel!r}")  # fmt: skip
        self.num_splits = num_splits
        self.prefill_kernel = prefill_kernel

    # ---- capability -------------------------------------------------------------------
    def unsupported_reasons(self, spec: CacheSpec, device: torch.device | str) -> list[str]:
        """Why this backend cannot run ``spec`` on ``device`` (empty = it can)."""
        dev = torch.device(device)
        reasons: list[str] = []
        if importlib.util.find_spec("cupy") is None:
            reasons.append("cupy is not installed (pip install kvpage[cupy])")
        elif dev.type != "cuda":
            reasons.append(f"device: expected cuda, got {dev.type}")
        else:
            reasons.extend(_cuda_reasons(dev))
        return (
            reasons
            + sinks_reasons(spec, self.name)
            + mla_reasons(spec, self.name)
            + head_dim_reasons(spec, templates.MAX_HEAD_DIM)
        )

    def test_budget(self, device: torch.device) -> Mapping[str, object] | None:
        """The default conformance budget (it runs on CUDA only)."""
        return None

    def plan(self, meta: AttentionMetadata) -> TokenMapPlan:
        """Validate the step (``kvpage.attention.plan.check_step``) and build the
        row -> (sequence, position) map as int32 device tensors (``TokenMapPlan``;
        from host lists: no device sync).

        Raises:
            ShapeError, DTypeError: see ``check_step``.
        """
        return TokenMapPlan.from_meta(meta)

    # ---- launching -------------------------------------------------------------------------
    def _run(self, fn: Any, grid: tuple[int, ...], block: int, args: tuple[object, ...], dev: torch.device) -> None:  # fmt: skip
        import cupy

        with cupy.cuda.Device(dev.index or 0):
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream)
            with stream:
                fn(grid, (block,), args)

    @staticmethod
    def _kernel(source: str, expr: str) -> Any:
        import cupy

        return _function(source, expr, templates.compile_options(cupy.cuda.get_cuda_path()))

    @staticmethod
    def _require_cuda(t: torch.Tensor) -> None:
        """The kernels take CUDA memory with a unit innermost stride."""
        if t.device.type != "cuda":
            raise ShapeError(f"cache.kv.device: expected cuda, got {t.device}")
        if t.stride(-1) != 1:
            raise ShapeError(f"cache.kv.stride(-1): expected 1, got {t.stride(-1)}")

    # ---- write -------------------------------------------------------------------------------
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: StepPlan | None = None,
    ) -> None:
        """Store K/V at their slots (``AttentionBackend.write_kv``; formulas in
        ``kvpage.attention.quant``). Mutates ``cache.kv`` (and int8 ``token_scales``).

        The slot range is checked for a CPU slot mapping only: on CUDA the caller
        guarantees ``-1 <= slot < num_blocks * block_size`` (the kernel skips -1).

        ``plan`` (the step's, from the model's layers) is not used: the launch checks
        run on every call (they also guard what the kernel reads raw).

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.checks.check_launch_write``
                (key and value in one dtype); a cache not on a CUDA device.
        """
        checks.check_launch_write(key, value, cache, slot_mapping, same_dtype=True)
        value = refuse_latent_write(value, self.name)  # MLA latent caches: not here
        self._require_cuda(cache.kv)
        n = key.shape[0]
        if n == 0:
            return
        dev = cache.kv.device
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        ts = cache.token_scales
        if ts is None:
            ts = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=dev)
        fsc = fp8_scale_table(cache)
        src, expr = templates.write_instance(key.dtype, cache.kv_dtype)
        args = write_args(key, value, cache, slots, ts, fsc)
        self._run(self._kernel(src, expr), (n, 2 * cache.num_kv_heads), 32, args, dev)

    # ---- attention ------------------------------------------------------------------------
    def choose_splits(self, blocks: int, max_keys: int, sms: int) -> int:
        """KV splits for ``blocks`` (token, head-group) blocks of at most ``max_keys``
        keys on a GPU with ``sms`` multiprocessors."""
        if self.num_splits is not None:  # grid.z is at most 64 on every CUDA GPU
            return max(1, min(self.num_splits, max_keys, 64))
        if blocks >= 2 * sms:
            return 1
        return max(1, min(-(-2 * sms // blocks), max_keys // 256, 64))

    def forward(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: TokenMapPlan,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer over the step (``AttentionBackend.forward``): the
        launch checks of ``kvpage.attention.checks.check_launch_forward``, then one
        attention kernel over every query row, split-KV + reduce when few rows would
        leave the GPU idle.

        Raises:
            ShapeError, DTypeError: see ``check_launch_forward``.
        """
        refuse_sinks(spec, self.name)  # attention sinks: not in these kernels
        refuse_mla(spec, self.name)  # MLA latent caches: not in these kernels
        checks.check_launch_forward(query, cache, plan, spec, out)
        meta = plan.meta
        self._require_cuda(cache.kv)
        if out is None:
            out = torch.empty_like(query)
        n, hq, hd = query.shape
        if n == 0:
            return out
        dev = cache.kv.device
        token_seq, token_pos = plan.token_seq, plan.token_pos
        q = query if query.stride(-1) == 1 else query.contiguous()
        gt = templates.heads_per_block(spec.num_queries_per_kv, hd)
        blocks = n * (hq // gt)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        max_keys = plan.keys_for(spec)
        splits = self.choose_splits(blocks, max_keys, sms)
        use_rows = self.prefill_kernel == "rows" or (
            self.prefill_kernel == "auto" and meta.max_query_len > 1 and splits == 1
        )
        if use_rows:
            splits = 1
        src, expr, gt = templates.attention_instance(
            query.dtype, cache.kv_dtype, cache.kv.dtype, hd, spec.num_queries_per_kv, rows=use_rows
        )
        chunk = -(-max_keys // splits)
        o = out if out.is_contiguous() else torch.empty_like(query)
        if splits > 1:
            part_out = torch.empty((n, hq, splits, hd), dtype=torch.float32, device=dev)
            part_lse = torch.empty((n, hq, splits), dtype=torch.float32, device=dev)
        else:
            part_out = part_lse = torch.empty(1, dtype=torch.float32, device=dev)
        ts = cache.token_scales
        if ts is None:
            ts = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=dev)
        fsc = fp8_scale_table(cache)
        bt = meta.block_tables.to(dev, torch.int32).contiguous()
        args = attention_args(q, cache, ts, fsc, bt, token_seq, token_pos, o, part_out, part_lse, spec, chunk, splits)  # fmt: skip
        if use_rows:
            warps = ATTENTION_THREADS // 32
            grid: tuple[int, ...] = (-(-n // warps), hq // gt)
            args = (*args, _i32(n))
        else:
            grid = (n, hq // gt, splits)
        self._run(self._kernel(src, expr), grid, ATTENTION_THREADS, args, dev)
        if splits > 1:
            rsrc, rexpr = templates.reduce_instance(query.dtype)
            rargs = reduce_args(part_out, part_lse, o, splits, hd)
            block = min(256, max(32, -(-hd // 32) * 32))
            self._run(self._kernel(rsrc, rexpr), (n * hq,), block, rargs, dev)
        if o is not out:
            out.copy_(o)
        return out

    # ---- copy ---------------------------------------------------------------------------------
    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        """``cache[:, dst] = cache[:, src]`` for each pair in every cache, int8 token
        scales included, bit-exact (raw words). Mutates ``caches``.

        Raises:
            ShapeError, DTypeError: see
                ``kvpage.attention.checks.check_independent_pairs``; a cache not
                contiguous or not on a CUDA device.
        """
        host = checks.check_independent_pairs(caches, pairs)
        for i, c in enumerate(caches):
            self._require_cuda(c.kv)
            for t in [c.kv] + ([c.token_scales] if c.token_scales is not None else []):
                if not t.is_contiguous():
                    raise ShapeError(f"caches[{i}]: expected contiguous tensors, got strides {t.stride()}")  # fmt: skip
        if host.shape[0] == 0:
            return
        for c in caches:
            dev = c.kv.device
            p = host.to(dev).contiguous()
            for t in [c.kv] + ([c.token_scales] if c.token_scales is not None else []):
                block_bytes = t[0, 0].numel() * t.element_size()
                src, expr, word = templates.copy_instance(block_bytes)
                args = copy_args(t, word, p)
                self._run(self._kernel(src, expr), (host.shape[0], 2), 256, args, dev)


# ---- kernel arguments (in the order and C types of the kernels' parameter lists) ----------
def write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: KVCache,
    slots: torch.Tensor,
    ts: torch.Tensor,
    fsc: torch.Tensor,
) -> tuple[Any, ...]:
    """Arguments of ``kvpage::write_kv`` (write_kv.cu)."""
    kv = cache.kv
    return (
        _ptr(key), _i64(key.stride(0)), _i64(key.stride(1)),
        _ptr(value), _i64(value.stride(0)), _i64(value.stride(1)),
        _ptr(kv), *(_i64(s) for s in kv.stride()[:4]),
        _ptr(ts), *(_i64(s) for s in ts.stride()),
        _ptr(fsc), _ptr(slots),
        _i32(cache.num_kv_heads), _i32(cache.head_dim), _i32(cache.block_size),
        _f32(FP8_MAX.get(kv.dtype, 0.0)),
    )  # fmt: skip


def attention_args(
    q: torch.Tensor,
    cache: KVCache,
    ts: torch.Tensor,
    fsc: torch.Tensor,
    bt: torch.Tensor,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    o: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    spec: AttentionSpec,
    chunk: int,
    splits: int,
) -> tuple[Any, ...]:
    """Arguments of ``kvpage::paged_attention`` (attention.cu)."""
    kv = cache.kv
    return (
        _ptr(q), _i64(q.stride(0)), _i64(q.stride(1)),
        _ptr(kv), *(_i64(s) for s in kv.stride()[:4]),
        _ptr(ts), *(_i64(s) for s in ts.stride()),
        _ptr(fsc), _ptr(bt), _i64(bt.stride(0)),
        _ptr(token_seq), _ptr(token_pos),
        _ptr(o), _ptr(part_out), _ptr(part_lse),
        _i32(spec.num_q_heads), _i32(spec.num_kv_heads), _i32(cache.block_size),
        _f32(spec.scale), _i32(spec.sliding_window or 0),
        _f32(spec.logits_soft_cap or 0.0), _i32(chunk), _i32(splits),
    )  # fmt: skip


def reduce_args(
    part_out: torch.Tensor, part_lse: torch.Tensor, o: torch.Tensor, splits: int, hd: int
) -> tuple[Any, ...]:
    """Arguments of ``kvpage::split_reduce`` (attention.cu)."""
    return (_ptr(part_out), _ptr(part_lse), _ptr(o), _i32(splits), _i32(hd))


def copy_args(t: torch.Tensor, word: int, pairs: torch.Tensor) -> tuple[Any, ...]:
    """Arguments of ``kvpage::copy_blocks`` (copy_blocks.cu) for contiguous ``t``
    ``[2, num_blocks, ...]`` copied in ``word``-byte units."""
    words = t[0, 0].numel() * t.element_size() // word
    return (
        _ptr(t), _i64(t.stride(0) * t.element_size() // word), _i64(words), _i64(words),
        _ptr(pairs),
    )  # fmt: skip


def _cuda_reasons(dev: torch.device) -> list[str]:
    """Reasons a CUDA device cannot run the kernels (no driver/device, compute < 8.0)."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # driver missing or too old: a reason, never a crash
        return [f"cupy cannot reach a CUDA device: {type(e).__name__}: {e}"]
    idx = dev.index or 0
    if idx >= count:
        return [f"device: expected a CUDA device index < {count}, got {idx}"]
    cc = int(cupy.cuda.Device(idx).compute_capability)  # e.g. "90"
    if cc < 80:
        return [
            f"compute capability: expected >= 8.0 (bf16/fp8 conversions), got {cc // 10}.{cc % 10}"
        ]
    return []
