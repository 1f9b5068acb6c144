"""The ``numba-cpu`` backend: paged attention on the CPU as one compiled Numba kernel
(``kernels.paged_attention``) that reads K/V in place through the block table.

numba is imported lazily (inside methods): importing this module costs nothing and
works without numba, which then is an unsupported reason. torch tensors reach the
kernel zero-copy as numpy views (bfloat16 as int16 bits, fp8 as uint8 bits). The
kernel runs on ``torch.get_num_threads()`` threads — the engine's ``num_threads``
(``numba.set_num_threads``, capped at numba's pool size); with one thread the serial
worker is called directly and numba's thread pool is never started. ``write_kv`` and
``copy_blocks`` are the built-in torch backend's (already vectorized copies; one
implementation of the quantization formulas).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import numpy as np
import torch

from kvpage.attention.canonical import mla_as_mqa
from kvpage.attention.checks import check_launch_forward
from kvpage.attention.cpu_plan import CpuPlan, forward_operands, torch_threads
from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import BackendCapabilities
from kvpage.backends.torch_backend import TorchBackend
from kvpage.specs import AttentionSpec, CacheSpec

#: the 256 values of each fp8 format's bit patterns, built on first use
_FP8_TABLES: dict[torch.dtype, np.ndarray] = {}
_DUMMY_SCALES = np.zeros((1, 1, 1, 1), dtype=np.float32)
_NO_TABLE = np.zeros(256, dtype=np.float32)
#: the kernel's "no attention sinks" (an empty array)
_NO_SINKS = np.zeros(0, dtype=np.float32)
_NO_FLOATS = np.zeros(1, dtype=np.float32)


def _fp8_table(dtype: torch.dtype) -> np.ndarray:
    """``[256]`` float32: the value of every bit pattern of fp8 ``dtype`` (exact)."""
    if dtype not in _FP8_TABLES:
        bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FP8_TABLES[dtype] = bits.view(dtype).float().numpy().copy()
    return _FP8_TABLES[dtype]


class NumbaCpuBackend:
    """Paged attention on CPU with a compiled, multi-threaded Numba kernel.

    Decode, prefill, chunked prefill and prefix-cache hits share one kernel; sliding
    windows, logit soft caps, GQA/MQA, float32 and bfloat16 queries, and auto (float32
    or bfloat16), int8 and fp8 KV caches. float16 is refused (Numba has no CPU float16
    arithmetic). Results are computed in float32 (see ``kernels``) and do not depend on
    the batch or the thread count.

    ``capabilities.priority["cpu"]`` = -10 ranks it after the torch backend (0), so
    ``select_backend(prefer="auto")`` keeps torch on CPU and this backend is chosen by
    name (``--backend numba-cpu``): measured (docs/benchmarks.md, "numba-cpu") it
    takes 0.7-0.85x the torch backend's CPU on ~125M-class models (head_dim 64) but
    1.1x on the bundled stories260K replay of the main job (head_dim 8), and ``auto``
    must not make the default run slower.
    """

    name = "numba-cpu"
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu"}),
        own_cpu_threads=True,
        priority={"cpu": -10},
        query_dtypes=frozenset({"float32", "bfloat16"}),
        sinks=True,
        mla=True,
        notes=(
            "MLA: the latent read as both K and V of one KV head (the kernel takes the V "
            "plane of a [1, ...] cache to be its K plane)",
            "compiled on first use per KV storage dtype (cached on disk by numba)",
            "float16 refused: numba has no CPU float16 arithmetic",
            "more than one thread starts numba's OpenMP pool (GNU OpenMP: not fork-safe)",
        ),
    )

    def __init__(self) -> None:
        self._torch = TorchBackend()

    # ---- selection -------------------------------------------------------------------
    def unsupported_reasons(self, spec: CacheSpec, device: torch.device | str) -> list[str]:
        """Why this backend cannot run ``spec`` on ``device`` ([] = it can)."""
        dev = torch.device(device)
        why: list[str] = []
        if dev.type != "cpu":
            why.append(f"device: expected cpu, got {dev.type}")
        if importlib.util.find_spec("numba") is None:
            why.append("numba is not installed (pip install kvpage[numba])")
        if spec.dtype not in self.capabilities.query_dtypes:
            why.append(f"dtype: expected float32|bfloat16, got {spec.dtype}")
        return why

    def test_budget(self, device: torch.device) -> Mapping[str, object] | None:
        """The suite's full default budget (``{}``: no field changed; ``None`` would
        give a CPU plugin the small simulator budget). The kernel is compiled — four
        specializations at most, about 8 s of CPU each the first time, then loaded from
        numba's on-disk cache — so a case costs about what the torch backend's does."""
        return {}

    # ---- per step --------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> CpuPlan:
        """Validate the step and build the kernel's host arrays (``CpuPlan``); sets
        numba's thread count to torch's (the engine's ``num_threads``).

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.plan.check_step``.
        """
        return CpuPlan.from_meta(meta, _sync_threads())

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: StepPlan | None = None,
    ) -> None:
        """The torch backend's ``write_kv`` (see ``AttentionBackend.write_kv``).

        ``plan`` goes to the torch backend, which skips its check for the slot mapping
        the engine validated at plan time (``plan.checked_slot_mapping``).
        """
        self._torch.write_kv(key, value, cache, slot_mapping, plan=plan)

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
        compiled kernel; writes ``out`` (or a new tensor) and nothing else. An MLA layer
        (``spec.kv_lora_rank``): one-KV-head attention whose key and value are the
        latent, result ``[..., :kv_lora_rank]``.

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.checks.check_launch_forward``.
        """
        kind = (  # validated at plan time (checks.check_step_layers) when marked
            cache.kv_dtype
            if plan.layers_checked
            else check_launch_forward(query, cache, plan, spec, out, sinks)
        )
        if spec.is_mla:  # one KV head whose K and V are the latent (mla_as_mqa)
            full = self._run(query, cache, plan, mla_as_mqa(cache, spec)[1], kind, None, None)
            res_mla = full[..., : spec.value_dim]
            if out is None:
                return res_mla.contiguous()
            out.copy_(res_mla)
            return out
        return self._run(query, cache, plan, spec, kind, out, sinks)

    def _run(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: CpuPlan,
        spec: AttentionSpec,
        kind: str,
        out: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward`` after its checks: the kernel call (an MLA latent cache with the
        MQA spec of ``mla_as_mqa``: the kernel reads its one plane as K and V)."""
        from kvpage_numba_cpu import kernels

        out, ops = forward_operands(query, plan, spec, out)
        if ops is None:
            return out
        res, q, units, bounds = ops
        kv, code, tsc, fsc, lut = _storage(cache, kind)
        args = (
            q.detach().numpy(),
            kv,
            kv.reshape(-1) if code == kernels.KIND_FLOAT else _NO_FLOATS,
            code,
            tsc,
            fsc,
            lut,
            plan.block_tables,
            plan.query_start,
            plan.seq_lens,
            units,
            bounds,
            np.float32(spec.scale),
            spec.sliding_window or 0,
            np.float32(spec.logits_soft_cap or 0.0),
            _NO_SINKS if sinks is None else sinks.detach().contiguous().numpy(),
            res.detach().numpy(),
        )
        if plan.threads == 1:
            # one part: the serial worker, called directly — no parallel region, so
            # numba's thread pool is never started (a 1-thread region ran the kernel
            # on a pool thread and kept a second OpenMP runtime alive next to torch's:
            # docs/benchmarks.md, "numba-cpu")
            kernels.run_part(0, *args)
        else:
            kernels.paged_attention(*args)
        if res is not out:
            out.copy_(res)
        return out


def _storage(
    cache: KVCache, kind: str
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
    """The cache as the kernel reads it: ``(kv bits, KIND_*, token scales, fp8 scale
    table [2, num_kv_heads], fp8 value table)``, numpy views sharing the cache's memory
    (scales: small copies)."""
    from kvpage_numba_cpu import kernels

    kv = cache.kv.detach()
    if kind == "auto":
        if kv.dtype == torch.bfloat16:
            return kv.view(torch.int16).numpy(), kernels.KIND_BF16, _DUMMY_SCALES, _ones(cache), _NO_TABLE  # fmt: skip
        return kv.numpy(), kernels.KIND_FLOAT, _DUMMY_SCALES, _ones(cache), _NO_TABLE
    if kind == "int8":
        assert cache.token_scales is not None
        return kv.numpy(), kernels.KIND_INT8, cache.token_scales.detach().numpy(), _ones(cache), _NO_TABLE  # fmt: skip
    from kvpage.attention.canonical import fp8_scale_table

    fsc = fp8_scale_table(cache).numpy()
    return kv.view(torch.uint8).numpy(), kernels.KIND_FP8, _DUMMY_SCALES, fsc, _fp8_table(kv.dtype)


def _ones(cache: KVCache) -> np.ndarray:
    return np.ones((2, cache.num_kv_heads), dtype=np.float32)


def _sync_threads() -> int:
    """Set numba's thread count for this thread to torch's (at most numba's pool size)
    and return it. One thread touches nothing (asking numba would start its pool)."""
    import numba

    pool = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]  # set at import
    n = max(1, min(torch_threads(), pool))
    if n > 1 and numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


__all__ = ["NumbaCpuBackend"]
