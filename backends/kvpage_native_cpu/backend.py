"""The ``native-cpu`` backend: paged attention on the CPU by a C kernel (``kernel.c``)
compiled at first use by the system C compiler (``build.py``) and called through
``ctypes``, reading K/V in place through the block table.

The step plan and its work split are the ``numba-cpu`` backend's (``CpuPlan``: units
``(sequence, query rows, KV heads)`` dealt to threads by estimated cost): the split is
a property of the step, not of the kernel that runs it. With ``n > 1`` compute threads
(``torch.get_num_threads()``, the engine's ``num_threads``) one C call runs part 0 on
the calling thread and the others on ``n - 1`` worker threads the kernel keeps
(``kvp_paged_attention_parts``: a bounded spin, then a condition variable; no second
OpenMP runtime in the process); ``ctypes`` releases the GIL for the call. ``write_kv`` is one C call of row copies when nothing needs
converting, else the built-in torch backend's (one implementation of the quantization
formulas), as is ``copy_blocks`` (already a vectorized copy).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import numpy as np
import torch

from kvpage.attention.canonical import mla_as_mqa
from kvpage.attention.checks import check_launch_forward, check_write_kv
from kvpage.attention.cpu_plan import CpuPlan, forward_operands, torch_threads
from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import BackendCapabilities
from kvpage.backends.torch_backend import TorchBackend
from kvpage.errors import BackendUnavailableError
from kvpage.specs import AttentionSpec, CacheSpec
from kvpage_native_cpu import build
from kvpage_native_cpu.layer_ops import DTYPES as LAYER_OPS_DTYPES
from kvpage_native_cpu.layer_ops import NativeLayerOps

KIND_FLOAT, KIND_BF16, KIND_INT8, KIND_FP8 = 0, 1, 2, 3

#: offer the C layer ops (``layer_ops``) to the model; False = the model's torch ops
#: (an A/B switch for benchmarks, docs/benchmarks.md)
LAYER_OPS = True

#: the 256 values of each fp8 format's bit patterns, built on first use
_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}


def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """``[256]`` float32: the value of every bit pattern of fp8 ``dtype`` (exact)."""
    if dtype not in _FP8_TABLES:
        bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FP8_TABLES[dtype] = bits.view(dtype).float().contiguous()
    return _FP8_TABLES[dtype]


class NativeCpuBackend:
    """Paged attention on CPU with a C kernel built by the system compiler.

    Decode, prefill, chunked prefill and prefix-cache hits share one kernel; sliding
    windows, logit soft caps, GQA/MQA, any head_dim and block size, float32 and
    bfloat16 queries, and auto (float32 or bfloat16), int8 and fp8 KV caches. float16
    is refused by name (the kernel reads float32 or bfloat16 storage for "auto"). All
    math is float32, vectorized explicitly (``kernel.c``); results do not depend on the
    batch or the thread count (tested bit for bit).

    ``capabilities.priority["cpu"]`` = 5 ranks it before the torch backend (0), so
    ``select_backend(prefer="auto")`` picks it on CPU: measured (docs/benchmarks.md,
    "native CPU kernel") it is faster than the torch backend on the bundled model's
    replay (the main job) and on the stories260K-hd32 peer workload. Without a working
    C compiler (``$CC``, default ``cc``) every spec gets the reason and ``auto`` falls
    back to the torch backend.
    """

    name = "native-cpu"
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu"}),
        own_cpu_threads=True,
        priority={"cpu": 5},
        query_dtypes=frozenset({"float32", "bfloat16"}),
        sinks=True,
        mla=True,
        notes=(
            "compiled at first use by $CC (default cc), cached under ~/.cache/kvpage",
            "MLA: the latent read as both K and V of one KV head (num_blocks = 0 in the "
            "kernel arguments aliases the V plane to the K plane)",
            "float16 refused: the kernel reads float32 or bfloat16 storage",
            "threads are the kernel's own pthreads, one C call per layer (GIL released)",
        ),
    )

    def __init__(self) -> None:
        self._torch = TorchBackend()
        #: the kernel library once ``build.load()`` returned it (that call resolves the
        #: compiler and cache path, ~16 us, and would otherwise run on every
        #: ``forward``/``write_kv`` call: 2 per layer per step)
        self._lib: ctypes.CDLL | None = None
        self._ops: dict[torch.dtype, NativeLayerOps] = {}
        #: prepared kernel arguments per plan and layer shape (see ``forward``):
        #: ``(id(plan), spec, num_blocks, block_size, dtype) -> (plan, parts, n)``; the
        #: entry keeps its plan alive, so the id is not reused while it is here;
        #: emptied when it reaches 32 entries (KV groups of a step alternate by layer)
        self._step_args: dict[
            tuple[object, ...], tuple[CpuPlan, ctypes.Array[build.KvpArgs], int]
        ] = {}

    def _library(self) -> tuple[ctypes.CDLL | None, str]:
        """``build.load()``, kept on the instance once it succeeded (a failure is not
        kept: a later call retries, e.g. after ``$CC`` was fixed)."""
        if self._lib is None:
            lib, reason = build.load()
            if lib is None:
                return None, reason
            self._lib = lib
        return self._lib, ""

    # ---- selection -------------------------------------------------------------------
    def unsupported_reasons(self, spec: CacheSpec, device: torch.device | str) -> list[str]:
        """Why this backend cannot run ``spec`` on ``device`` ([] = it can). Builds (or
        loads the cached) kernel library the first time, so a failing compiler is a
        reason here rather than an error at the first step."""
        dev = torch.device(device)
        why: list[str] = []
        if dev.type != "cpu":
            why.append(f"device: expected cpu, got {dev.type}")
        if spec.dtype not in self.capabilities.query_dtypes:
            why.append(f"dtype: expected float32|bfloat16, got {spec.dtype}")
        if not why:
            lib, reason = self._library()
            if lib is None:
                why.append(reason)
        return why

    def test_budget(self, device: torch.device) -> Mapping[str, object] | None:
        """The suite's full default budget (``{}``: the kernel is as fast as the torch
        backend's per case once built, about a second of compile the first time)."""
        return {}

    def layer_ops(self, dtype: torch.dtype, device: torch.device) -> NativeLayerOps | None:
        """The C ``LayerOps`` (``kvpage.attention.protocol``, with ``GreedyOps``) for
        float32 or bfloat16 on the CPU while :data:`LAYER_OPS` is on and the library
        loads, else None (the model keeps its torch ops)."""
        if not LAYER_OPS or dtype not in LAYER_OPS_DTYPES or device.type != "cpu":
            return None
        ops = self._ops.get(dtype)
        if ops is None:
            lib = self._library()[0]
            if lib is None:
                return None
            ops = self._ops[dtype] = NativeLayerOps(lib, dtype)
        return ops

    # ---- per step --------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> CpuPlan:
        """Validate the step and build the kernel's host arrays (``CpuPlan``) for
        ``torch.get_num_threads()`` threads.

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.plan.check_step``.
        """
        return CpuPlan.from_meta(meta, torch_threads())

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: StepPlan | None = None,
    ) -> None:
        """Store K/V at ``slot_mapping`` (see ``AttentionBackend.write_kv``): one C
        call of row copies when nothing needs converting (auto KV in the model dtype,
        int64 slots, rows contiguous), else the torch backend's ``write_kv`` (the one
        implementation of the int8/fp8 quantization, and of MLA latent writes:
        ``value=None``).

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.checks.check_write_kv`` (not
                run for the slot mapping ``plan`` says the engine validated at plan
                time: ``plan.checked_slot_mapping is slot_mapping``).
        """
        kv = cache.kv
        lib = self._library()[0]
        if (
            lib is None
            or value is None
            or cache.kv_dtype != "auto"
            or key.dtype != kv.dtype
            or value.dtype != kv.dtype
            or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous()
            or not (_rows_contiguous(key) and _rows_contiguous(value))
        ):
            self._torch.write_kv(key, value, cache, slot_mapping, plan=plan)
            return
        if plan is None or plan.checked_slot_mapping is not slot_mapping:
            check_write_kv(key, value, cache, slot_mapping)
        es = kv.element_size()
        lib.kvp_write_kv(
            key.data_ptr(), key.stride(0) * es, value.data_ptr(), value.stride(0) * es,
            slot_mapping.data_ptr(), slot_mapping.shape[0], kv.data_ptr(),
            cache.num_blocks * cache.block_size, cache.num_kv_heads * cache.head_dim * es,
        )  # fmt: skip

    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        """The torch backend's ``copy_blocks`` (see ``AttentionBackend.copy_blocks``)."""
        self._torch.copy_blocks(caches, pairs)

    def forward(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: CpuPlan,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer over the step (``AttentionBackend.forward``) by the
        C kernel; writes ``out`` (or a new tensor) and nothing else. Attention sinks
        (``sinks``, ``[num_q_heads]`` float32) are added to each row's denominator
        when its keys are done (``kernel.c``). An MLA layer (``spec.kv_lora_rank``)
        runs as one-KV-head attention whose key and value are the latent (the kernel
        reads the V plane at ``kv + num_blocks * ...``; passing ``num_blocks = 0``
        makes it the K plane), into a ``[num_tokens, num_q_heads, head_dim]`` buffer
        of which the first ``kv_lora_rank`` elements are the result.

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.checks.check_launch_forward``.
            BackendUnavailableError: the kernel library cannot be built or loaded.
            MemoryError: the kernel could not allocate its scratch memory.
        """
        kind = (  # validated at plan time (checks.check_step_layers) when marked
            cache.kv_dtype
            if plan.layers_checked
            else check_launch_forward(query, cache, plan, spec, out, sinks)
        )
        lib, reason = self._library()
        if lib is None:
            raise BackendUnavailableError("native-cpu: kernel unavailable", {self.name: [reason]})
        if spec.is_mla:
            return self._forward_mla(lib, query, cache, plan, spec, kind, out)
        out, ops = forward_operands(query, plan, spec, out)
        if ops is None:
            return out
        res, q, units, bounds = ops
        kv = cache.kv
        sk = None if sinks is None else sinks.contiguous()  # alive until the call returns
        sk_ptr = None if sk is None else sk.data_ptr()
        if kind == "auto":  # the step's arguments once per KV group, three pointers per layer
            key = (id(plan), spec, kv.shape[1], kv.shape[2], kv.dtype)
            got = self._step_args.get(key)
            if got is None:
                if len(self._step_args) >= 32:  # earlier steps' entries (a few per step)
                    self._step_args = {}
                got = (plan, *_parts(_step_args(plan, spec, cache, kind, units, []), bounds))
                self._step_args[key] = got
            if got[2] and lib.kvp_paged_attention_layer(got[1], got[2], q.data_ptr(), kv.data_ptr(), res.data_ptr(), sk_ptr):  # fmt: skip
                raise MemoryError("native-cpu: the kernel could not allocate its scratch memory")
        else:
            keep: list[torch.Tensor] = []  # tensors the call reads, alive until it returns
            args = _step_args(plan, spec, cache, kind, units, keep)
            args.q, args.kv, args.out = q.data_ptr(), kv.data_ptr(), res.data_ptr()
            args.sinks = sk_ptr
            parts, n = _parts(args, bounds)
            if n and lib.kvp_paged_attention_parts(parts, n) != 0:
                raise MemoryError("native-cpu: the kernel could not allocate its scratch memory")
        if res is not out:
            out.copy_(res)
        return out

    def _forward_mla(
        self,
        lib: ctypes.CDLL,
        query: torch.Tensor,
        cache: KVCache,
        plan: CpuPlan,
        spec: AttentionSpec,
        kind: str,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward`` of an MLA layer (checked by the caller): one KV head, V = the
        latent (kernel ``num_blocks`` 0), result ``[..., :kv_lora_rank]``."""
        _, mqa = mla_as_mqa(cache, spec)
        full, ops = forward_operands(query, plan, mqa, None)
        if out is None:
            out = torch.empty(
                (*query.shape[:2], spec.value_dim), dtype=query.dtype, device=query.device
            )
        if ops is None:
            return out
        res, q, units, bounds = ops
        keep: list[torch.Tensor] = []
        args = _step_args(plan, mqa, cache, kind, units, keep)
        args.num_blocks = 0  # the V plane is the K plane: the latent is the value
        args.q, args.kv, args.out = q.data_ptr(), cache.kv.data_ptr(), res.data_ptr()
        parts, n = _parts(args, bounds)
        if n and lib.kvp_paged_attention_parts(parts, n) != 0:
            raise MemoryError("native-cpu: the kernel could not allocate its scratch memory")
        out.copy_(res[..., : spec.value_dim])
        return out


def _step_args(
    plan: CpuPlan,
    spec: AttentionSpec,
    cache: KVCache,
    kind: str,
    units: np.ndarray,
    keep: list[torch.Tensor],
) -> build.KvpArgs:
    """The kernel arguments of a layer of ``spec``'s shape in this step but q, kv and
    out (left 0); the storage fields by :func:`_kind` (``keep``: see there). For "auto"
    storage they are the same for every layer of the KV group."""
    kv = cache.kv
    args = build.KvpArgs()
    args.kind = _kind(cache, kind, args, keep)
    args.block_tables = plan.block_tables.ctypes.data
    args.bt_stride = plan.block_tables.shape[1]
    args.bt_int64 = 0
    args.query_start = plan.query_start.ctypes.data
    args.seq_lens = plan.seq_lens.ctypes.data
    args.units = units.ctypes.data
    args.num_q_heads = spec.num_q_heads
    args.num_kv_heads = spec.num_kv_heads
    args.head_dim = spec.head_dim
    args.num_blocks = kv.shape[1]
    args.block_size = kv.shape[2]
    args.window = spec.sliding_window or 0
    args.scale = spec.scale
    args.soft_cap = spec.logits_soft_cap or 0.0
    return args


def _parts(args: build.KvpArgs, bounds: np.ndarray) -> tuple[ctypes.Array[build.KvpArgs], int]:
    """``(parts, n)``: copies of ``args`` for the non-empty parts ``bounds[t] ..
    bounds[t+1]-1``, which ``kvp_paged_attention_parts`` runs at once (part 0 on the
    calling thread, the others on the kernel's worker threads)."""
    parts = (build.KvpArgs * (bounds.shape[0] - 1))()
    n = 0
    for t in range(bounds.shape[0] - 1):
        u0, u1 = int(bounds[t]), int(bounds[t + 1])
        if u1 > u0:
            parts[n] = args
            parts[n].u0, parts[n].u1 = u0, u1
            n += 1
    return parts, n


def _rows_contiguous(x: torch.Tensor) -> bool:
    """``[n, h, d]`` with each token's ``h * d`` values contiguous (a row slice of a
    fused QKV projection is)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _kind(cache: KVCache, kind: str, args: build.KvpArgs, keep: list[torch.Tensor]) -> int:
    """Fill the storage-specific fields of ``args``; returns the kernel's storage kind."""
    kv = cache.kv
    if kind == "auto":
        return KIND_BF16 if kv.dtype == torch.bfloat16 else KIND_FLOAT
    if kind == "int8":
        assert cache.token_scales is not None
        tsc = cache.token_scales.contiguous()
        keep.append(tsc)
        args.tsc = tsc.data_ptr()
        return KIND_INT8
    from kvpage.attention.canonical import fp8_scale_table

    fsc = fp8_scale_table(cache).float().contiguous()
    lut = _fp8_table(kv.dtype)
    keep += [fsc, lut]
    args.fsc = fsc.data_ptr()
    args.lut = lut.data_ptr()
    return KIND_FP8


__all__ = ["NativeCpuBackend"]
