"""The numba backend: launchers for the ``@numba.cuda.jit`` kernels in ``kernels``.

numba is imported lazily (inside methods), so importing this module costs nothing and
works without numba. On a GPU, torch tensors reach the kernels zero-copy through
``__cuda_array_interface__`` (bfloat16 and fp8 tensors as int16/uint8 views of the same
memory), on the current torch stream. Under ``NUMBA_ENABLE_CUDASIM=1`` the kernels run in
numba's CUDA simulator on CPU tensors (passed as numpy views of the same memory); the
backend then runs on device ``cpu`` and nowhere else.
"""

from __future__ import annotations

import importlib.util
from typing import Any

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
from kvpage_numba.simulator import SimArray, SimLaunch, cudasim_enabled

_FP8_FORMATS = {"fp8_e4m3": (3, 7), "fp8_e5m2": (2, 15)}
_RAW_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numba_state() -> tuple[bool, bool]:
    """(numba importable, simulator enabled) without failing when numba is absent."""
    if importlib.util.find_spec("numba") is None:
        return False, False
    return True, cudasim_enabled()


class NumbaBackend:
    """Paged attention with Numba CUDA kernels (GPU, or CPU under the CUDA simulator).

    Args:
        threads: threads per attention block (keys are dealt round-robin to threads);
            default 64 on a GPU, 4 under the simulator (every simulated thread is a
            Python thread: ARCHITECTURE.md section 8). At most 128.
        num_splits: force this many KV splits (split-KV + reduce); ``None`` = heuristic:
            on a GPU, split when ``num_tokens * num_q_heads`` blocks would not fill twice
            the SM count, into chunks of at least 256 keys; under the simulator, split
            into chunks of 32 keys (at most 4) so small tests exercise the reduce.

    Attributes:
        test_budget: the conformance-suite hook (``kvpage.testing.budget_for``): small
            shapes under the simulator (every simulated thread is a Python thread; a
            launch costs about 1 ms per block here), the default budget on a GPU.
    """

    name = "numba"
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"}),
        priority={"cuda": 10},  # after triton and cupy (docs/benchmarks.md); never auto on cpu
        max_head_dim=256,
        notes=(
            "cpu only under NUMBA_ENABLE_CUDASIM=1 (the CUDA simulator; slow)",
            "bfloat16 carried as int16 bits; fp8 encoded with integer arithmetic",
        ),
    )

    def test_budget(self, device: torch.device) -> dict[str, Any] | None:
        """Shape and example limits for shared test suites on ``device`` (None = the
        suite's default). Under the simulator: a quarter of the examples, at most 2
        sequences of 24 tokens and 4 query heads (a simulated launch costs about a
        millisecond per block plus Python per element), but every head_dim up to 256 so
        the pinned edge cases (C13) run too. Measured: the numba share of the
        conformance suite takes about 70 s of CPU on this machine."""
        if torch.device(device).type != "cpu":
            return None
        return dict(
            example_fraction=0.25,
            max_head_dim=256,
            max_q_heads=4,
            max_kv_heads=2,
            max_seq_len=24,
            max_seqs=2,
            max_block_size=16,
            huge_pools=False,
            max_pool_bytes=2**20,
        )

    def __init__(self, *, threads: int | None = None, num_splits: int | None = None) -> None:
        if threads is not None and not 1 <= threads <= 128:
            raise ValueError(f"threads: expected 1..128, got {threads}")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
        self.threads = threads
        self.num_splits = num_splits

    # ---- capability ---------------------------------------------------------------------
    def unsupported_reasons(self, spec: CacheSpec, device: torch.device | str) -> list[str]:
        """Why this backend cannot run ``spec`` on ``device`` (empty = it can)."""
        dev = torch.device(device)
        reasons: list[str] = []
        have, sim = _numba_state()
        if not have:
            reasons.append("numba is not installed (pip install kvpage[numba])")
        elif dev.type == "cpu" and not sim:
            reasons.append("device cpu: expected NUMBA_ENABLE_CUDASIM=1 (CUDA simulator), got it unset")  # fmt: skip
        elif dev.type == "cuda" and sim:
            reasons.append("device cuda: NUMBA_ENABLE_CUDASIM=1 is set, so numba runs on cpu only")
        elif dev.type == "cuda":
            from numba import cuda

            # numba.cuda.is_available has no annotations
            if not cuda.is_available():  # type: ignore[no-untyped-call]
                reasons.append("device cuda: numba.cuda.is_available() is False (no driver/device)")
        elif dev.type not in ("cpu", "cuda"):
            reasons.append(f"device: expected cpu or cuda, got {dev.type}")
        return (
            reasons
            + sinks_reasons(spec, self.name)
            + mla_reasons(spec, self.name)
            + head_dim_reasons(spec, self.capabilities.max_head_dim)
        )

    def plan(self, meta: AttentionMetadata) -> TokenMapPlan:
        """Validate the step (``kvpage.attention.plan.check_step``) and build the
        row -> (sequence, position) map as int32 device tensors (``TokenMapPlan``;
        from host lists: no device sync).

        Raises:
            ShapeError, DTypeError: see ``check_step``.
        """
        return TokenMapPlan.from_meta(meta)

    # ---- helpers ---------------------------------------------------------------------------
    def _cuda(self) -> Any:
        from numba import cuda

        return cuda

    def _arr(self, t: torch.Tensor) -> Any:
        """A kernel argument sharing ``t``'s memory (bf16 -> int16, fp8 -> uint8 views)."""
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t = t.view(torch.uint8)
        if t.device.type == "cpu":
            return SimArray(t.numpy())
        return self._cuda().as_cuda_array(t)

    def _launch(self, kernel: Any, grid: tuple[int, ...], block: int, dev: torch.device) -> Any:
        if dev.type == "cuda":
            stream = self._cuda().external_stream(torch.cuda.current_stream(dev).cuda_stream)
            return kernel[grid, block, stream]
        return SimLaunch(kernel[grid, block])

    # ---- write ---------------------------------------------------------------------------------
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: StepPlan | None = None,
    ) -> None:
        """Store K/V at their slots (see ``AttentionBackend.write_kv``; formulas in
        ``kvpage.attention.quant``). Mutates ``cache.kv`` (and ``token_scales``).

        The slot range is checked for a CPU slot mapping only: on CUDA the caller
        guarantees ``-1 <= slot < num_blocks * block_size`` (the kernel skips -1).

        ``plan`` (the step's, from the model's layers) is not used: the launch checks
        run on every call (they also guard what the kernel reads raw).

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.checks.check_launch_write``
                (key and value in one dtype).
        """
        checks.check_launch_write(key, value, cache, slot_mapping, same_dtype=True)
        value = refuse_latent_write(value, self.name)  # MLA latent caches: not here
        n = key.shape[0]
        if n == 0:
            return
        from kvpage_numba import kernels

        dev = cache.kv.device
        src = "bf16" if key.dtype == torch.bfloat16 else "float"
        kind = cache.kv_dtype
        h = cache.num_kv_heads
        if kind == "auto":
            kern = kernels.write_kv_kernel(src, "copy")
        elif kind == "int8":
            kern = kernels.write_kv_kernel(src, "int8")
        else:
            mbits, bias = _FP8_FORMATS[kind]
            kern = kernels.write_kv_kernel(src, "fp8", mbits, bias)
        tsc = cache.token_scales if cache.token_scales is not None else self._dummy(4, dev)
        fsc = fp8_scale_table(cache)
        fmax = float(FP8_MAX.get(cache.kv.dtype, 0.0))
        block = 2 * h if dev.type == "cpu" else max(32, -(-2 * h // 32) * 32)
        self._launch(kern, (n,), block, dev)(
            self._arr(key),
            self._arr(value),
            self._arr(cache.kv),
            self._arr(tsc),
            self._arr(fsc),
            self._arr(slot_mapping.to(torch.int64)),
            cache.block_size,
            _f32(fmax),
        )

    @staticmethod
    def _dummy(rank: int, dev: torch.device) -> torch.Tensor:
        return torch.zeros((1,) * rank, dtype=torch.float32, device=dev)

    # ---- attention --------------------------------------------------------------------------------
    def choose_splits(self, rows: int, max_keys: int, dev: torch.device) -> int:
        """KV splits for ``rows`` (query token, head) pairs of at most ``max_keys`` keys."""
        if self.num_splits is not None:  # grid.z is at most 64 on every CUDA GPU
            return max(1, min(self.num_splits, max_keys, 64))
        if dev.type == "cpu":
            return max(1, min(4, -(-max_keys // 32)))
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if rows >= 2 * sms:
            return 1
        return max(1, min(-(-2 * sms // rows), max_keys // 256, 64))

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
        if out is None:
            out = torch.empty_like(query)
        n, hq, hd = query.shape
        if n == 0:
            return out
        from kvpage_numba import kernels

        dev = cache.kv.device
        token_seq, token_pos = plan.token_seq, plan.token_pos
        max_keys = plan.keys_for(spec)
        splits = self.choose_splits(n * hq, max_keys, dev)
        chunk = -(-max_keys // splits)
        o32 = out if out.dtype == torch.float32 and out.is_contiguous() else None
        if o32 is None:
            o32 = torch.empty((n, hq, hd), dtype=torch.float32, device=dev)
        if splits > 1:
            part_out = torch.empty((n, hq, splits, hd), dtype=torch.float32, device=dev)
            part_lse = torch.empty((n, hq, splits), dtype=torch.float32, device=dev)
        else:
            part_out, part_lse = self._dummy(4, dev), self._dummy(3, dev)
        kind = cache.kv_dtype
        kv_kind = {"auto": "float", "int8": "int8"}.get(kind, "fp8")
        if kind == "auto" and cache.kv.dtype == torch.bfloat16:
            kv_kind = "bf16"
        q_kind = "bf16" if query.dtype == torch.bfloat16 else "float"
        if kv_kind == "fp8":
            lut = torch.arange(256, dtype=torch.uint8).view(cache.kv.dtype).float().to(dev)
        else:
            lut = torch.zeros(1, dtype=torch.float32, device=dev)
        tsc = cache.token_scales if cache.token_scales is not None else self._dummy(4, dev)
        threads = self.threads or (4 if dev.type == "cpu" else 64)
        bt = meta.block_tables
        if bt.dtype != torch.int32 or bt.device != dev:
            bt = bt.to(dev, torch.int32)
        kern = kernels.attention_kernel(q_kind, kv_kind)
        # heads per block: 1 on a GPU (parallelism); all of a token's heads under the
        # simulator, whose cost is per block (thread start-up and polling)
        hb = hq if dev.type == "cpu" else 1
        self._launch(kern, (n, -(-hq // hb), splits), threads, dev)(
            self._arr(query),
            self._arr(cache.kv),
            self._arr(tsc),
            self._arr(fp8_scale_table(cache)),
            self._arr(lut),
            self._arr(bt),
            self._arr(token_seq),
            self._arr(token_pos),
            self._arr(o32),
            self._arr(part_out),
            self._arr(part_lse),
            cache.block_size,
            _f32(spec.scale),
            spec.sliding_window or 0,
            _f32(spec.logits_soft_cap or 0.0),
            chunk,
            splits,
            hb,
        )
        if splits > 1:
            red = min(hd, 4 if dev.type == "cpu" else 128)
            self._launch(kernels.split_reduce_kernel, (n, -(-hq // hb)), red, dev)(
                self._arr(part_out), self._arr(part_lse), self._arr(o32), hb
            )
        if o32 is not out:
            out.copy_(o32)
        return out

    # ---- copy ----------------------------------------------------------------------------------
    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        """``cache[:, dst] = cache[:, src]`` for each pair in every cache, int8 token
        scales included, bit-exact (copied as raw integers). Mutates ``caches``.

        Raises:
            ShapeError, DTypeError: see
                ``kvpage.attention.checks.check_independent_pairs``; a non-contiguous
                cache.
        """
        host = checks.check_independent_pairs(caches, pairs)
        if host.shape[0] == 0:
            return
        from kvpage_numba import kernels

        for i, c in enumerate(caches):
            dev = c.kv.device
            p = self._arr(host.to(dev))
            tensors = [c.kv] + ([c.token_scales] if c.token_scales is not None else [])
            for t in tensors:
                if not t.is_contiguous():
                    raise ShapeError(f"caches[{i}]: expected contiguous tensors, got strides {t.stride()}")  # fmt: skip
                raw = t.view(_RAW_INT[t.element_size()]).view(2, c.num_blocks, -1)
                block = min(raw.shape[2], 8 if dev.type == "cpu" else 256)
                self._launch(kernels.copy_blocks_kernel, (host.shape[0], 2), block, dev)(
                    self._arr(raw), p
                )


def _f32(x: float) -> Any:
    """A float32 scalar argument (numpy), so kernels compute in float32 everywhere."""
    import numpy as np

    return np.float32(x)


__all__ = ["NumbaBackend"]
