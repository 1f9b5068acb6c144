"""The Triton attention backend: ``TritonBackend`` (entry point ``triton`` of the
``kvpage.backends`` group).

Importing this module does not import triton; the kernels and launchers
(``kvpage_triton.launch``) are imported on first use. On CPU the backend runs only
under the Triton interpreter (``TRITON_INTERPRET=1`` set before the kernels are first
imported); on CUDA it compiles the kernels for the device.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

import torch

from kvpage.attention.canonical import (
    head_dim_reasons,
    mla_reasons,
    refuse_latent_write,
    refuse_mla,
    refuse_sinks,
    sinks_reasons,
)
from kvpage.attention.checks import check_block_pairs
from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import BackendCapabilities
from kvpage.errors import BackendUnavailableError, DTypeError, ShapeError
from kvpage.specs import AttentionSpec, CacheSpec
from kvpage_triton.plan import TritonPlan
from kvpage_triton.validate import check_cache, check_forward, check_write_kv


class _Launcher(Protocol):
    """What the backend uses of the lazily imported ``kvpage_triton.launch`` module."""

    INTERPRET: bool

    def attention(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: TritonPlan,
        spec: AttentionSpec,
        out: torch.Tensor,
        kind: str,
        *,
        force_splits: int | None = None,
    ) -> torch.Tensor: ...

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        kind: str,
    ) -> None: ...

    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None: ...


#: largest head_dim: BLOCK_D is head_dim rounded up to a power of two (masked), and a
#: 512-wide Q/K/V tile set does not fit in registers/shared memory at useful tile sizes
MAX_HEAD_DIM = 256
#: CUDA compute capability needed for fp8 KV (Triton's float8e4nv needs sm_89; Ada/Hopper)
FP8_MIN_CC = (8, 9)
#: CUDA compute capability for bfloat16 tensor-core dots (Ampere)
BF16_MIN_CC = (8, 0)


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value in the environment."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class TritonBackend:
    """Paged attention with ``@triton.jit`` kernels (decode with split-KV, varlen
    prefill with cached context, cache writes with int8/fp8 quantization, block copies).

    Args:
        num_splits: force this many KV splits in every attention launch (tests and
            benchmarks); ``None`` lets the launcher decide (split only when the
            sequences would leave the device idle).
    """

    name = "triton"
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"}),
        priority={"cuda": 30},  # first on CUDA (docs/benchmarks.md); never auto on cpu
        max_head_dim=MAX_HEAD_DIM,
        min_compute_capability=(7, 0),
        notes=(
            "cpu only under TRITON_INTERPRET=1 (slow; for tests)",
            "fp8 KV on CUDA needs compute capability >= 8.9",
            "bfloat16 on CUDA needs compute capability >= 8.0",
            "any head_dim <= 256 (padded to a power of two with masks), any block_size",
        ),
    )

    def __init__(self, *, num_splits: int | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ShapeError(f"num_splits: expected >= 1 or None, got {num_splits}")
        self.num_splits = num_splits
        self._launch: _Launcher | None = None

    def test_budget(self, device: torch.device) -> dict[str, object] | None:
        """Conformance budget (``AttentionBackend.test_budget``): under the
        interpreter (CPU) draw small shapes and about half the profile's examples (one
        interpreted example costs ~0.1-1 s); on CUDA the default budget (None)."""
        if torch.device(device).type != "cpu":
            return None
        return {
            "example_fraction": 0.5,
            "max_head_dim": 256,
            "max_q_heads": 8,
            "max_kv_heads": 2,
            "max_seq_len": 48,
            "max_seqs": 3,
            "max_block_size": 32,
            "huge_pools": True,
            "max_pool_bytes": 4 * 2**20,
        }

    # ---- selection -----------------------------------------------------------------
    def unsupported_reasons(self, spec: CacheSpec, device: torch.device) -> list[str]:
        """Why this backend cannot run ``spec`` on ``device`` (empty list = it can)."""
        device = torch.device(device)
        reasons: list[str] = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("triton is not installed (pip install 'kvpage[triton]')")
        if device.type == "cpu":
            if not interpreter_enabled():
                reasons.append(
                    "device cpu: triton runs on CPU only under the interpreter "
                    "(TRITON_INTERPRET=1), which is not set"
                )
        elif device.type == "cuda":
            if not torch.cuda.is_available():
                reasons.append("device cuda: torch.cuda.is_available() is False")
            elif interpreter_enabled():
                reasons.append("device cuda: TRITON_INTERPRET=1 is set (kernels would not compile)")
            else:
                cc = torch.cuda.get_device_capability(device)
                if cc < (7, 0):
                    reasons.append(f"compute capability: expected >= 7.0, got {cc[0]}.{cc[1]}")
                if spec.kv_dtype.startswith("fp8") and cc < FP8_MIN_CC:
                    reasons.append(
                        f"kv_dtype {spec.kv_dtype}: expected compute capability >= 8.9, "
                        f"got {cc[0]}.{cc[1]}"
                    )
                if spec.dtype == "bfloat16" and cc < BF16_MIN_CC:
                    reasons.append(
                        f"dtype bfloat16: expected compute capability >= 8.0, got {cc[0]}.{cc[1]}"
                    )
        else:
            reasons.append(f"device: expected cuda (or cpu with TRITON_INTERPRET=1), got {device}")
        return (
            reasons
            + sinks_reasons(spec, self.name)
            + mla_reasons(spec, self.name)
            + head_dim_reasons(spec, MAX_HEAD_DIM)
        )

    def _kernels(self, device: torch.device) -> _Launcher:
        """Import the launcher (and triton) on first use; check the device can run it."""
        if self._launch is None:
            try:
                import kvpage_triton.launch as launch
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise BackendUnavailableError(
                    "triton backend unavailable", {"triton": [f"import failed: {e}"]}
                ) from e
            self._launch = launch
        interp = bool(self._launch.INTERPRET)
        if device.type == "cpu" and not interp:
            raise BackendUnavailableError(
                "triton backend cannot run on cpu",
                {
                    "triton": [
                        "device cpu: expected TRITON_INTERPRET=1 when kernels load, got unset"
                    ]
                },
            )
        if device.type == "cuda" and interp:
            raise BackendUnavailableError(
                "triton backend cannot run on cuda",
                {"triton": ["device cuda: kernels were loaded with TRITON_INTERPRET=1"]},
            )
        if device.type not in ("cpu", "cuda"):
            raise BackendUnavailableError(
                "triton backend cannot run here",
                {"triton": [f"device: expected cuda, got {device}"]},
            )
        return self._launch

    # ---- per step ------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> TritonPlan:
        """Validate the step; query tile lists (which depend on the layer's GQA group)
        are built by the first layer that needs them (``TritonPlan.tiles``).

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.plan.check_step``.
        """
        return TritonPlan.from_meta(meta)

    # ---- kernels -------------------------------------------------------------------
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: StepPlan | None = None,
    ) -> None:
        """Store K/V ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``
        (int64, -1 = skip), quantizing per ``kvpage.attention.quant`` for int8/fp8.

        Mutates ``cache.kv`` (and ``cache.token_scales`` for int8) at those slots only.

        ``plan`` (the step's, from the model's layers) is not used: ``check_write_kv``
        runs on every call.

        Raises:
            ShapeError, DTypeError: invalid arguments (nothing is written).
            BackendUnavailableError: the device cannot run the kernels.
        """
        value = refuse_latent_write(value, self.name)  # MLA latent caches: not here
        check_write_kv(key, value, cache, slot_mapping)
        launch = self._kernels(cache.kv.device)
        launch.write_kv(key, value, cache, slot_mapping, cache.kv_dtype)

    def forward(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: TritonPlan,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer over the step (``AttentionBackend.forward``): the
        decode kernel variant for a pure decode step, else the varlen one.

        Raises:
            ShapeError, DTypeError: see ``kvpage_triton.validate.check_forward``.
            BackendUnavailableError: the device cannot run the kernels.
        """
        refuse_sinks(spec, self.name)  # attention sinks: not in these kernels
        refuse_mla(spec, self.name)  # MLA latent caches: not in these kernels
        kind = check_forward(query, cache, plan, spec, out)
        launch = self._kernels(query.device)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        return launch.attention(query, cache, plan, spec, out, kind, force_splits=self.num_splits)

    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        """For each row ``(src, dst)`` of ``pairs`` (``[n, 2]`` int64) copy block
        ``src`` to ``dst`` in every cache (K, V and int8 token scales), bit-exactly.

        Raises:
            ShapeError: ``pairs`` not ``[n, 2]``, ids out of range, a non-contiguous cache.
            DTypeError: ``pairs`` not int64.
        """
        if pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ShapeError(f"pairs: expected [n, 2], got {list(pairs.shape)}")
        if pairs.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise DTypeError(f"pairs.dtype: expected torch.int64, got {pairs.dtype}")
        if pairs.shape[0] == 0 or not caches:
            return
        for i, c in enumerate(caches):
            check_cache(c, f"caches[{i}]")
            if not c.kv.is_contiguous():
                raise ShapeError(
                    f"caches[{i}].kv: expected contiguous, got strides {c.kv.stride()}"
                )
            if c.token_scales is not None and not c.token_scales.is_contiguous():
                raise ShapeError(f"caches[{i}].token_scales: expected contiguous, got strided")
        for c in caches:
            check_block_pairs(pairs, c.num_blocks)
        dev = caches[0].kv.device
        for i, c in enumerate(caches):
            if c.kv.device != dev:
                raise ShapeError(f"caches[{i}].kv.device: expected {dev}, got {c.kv.device}")
        launch = self._kernels(dev)
        launch.copy_blocks(caches, pairs.to(device=dev, dtype=torch.int64))
