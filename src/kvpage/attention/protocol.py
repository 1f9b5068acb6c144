"""The contract every attention backend meets (built-in or plugin).

A backend is stateless apart from caches of compiled kernels: every per-step input is
an argument. The float64 reference (``kvpage.attention.reference``) defines what each
method must compute; the conformance suite (``conformance/``) proves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.specs import AttentionSpec, CacheSpec


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do, declared up front; ``unsupported_reasons`` checks a spec
    and device against it.

    Attributes:
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        head_dims: supported head sizes; empty = any.
        max_head_dim: largest supported head size (0 = unbounded).
        query_dtypes: supported model dtypes (names as in ``CacheSpec.dtype``).
        kv_dtypes: supported ``CacheSpec.kv_dtype`` values.
        sliding_window / logits_soft_cap / gqa: feature flags.
        min_compute_capability: CUDA (major, minor) needed, or None.
        block_sizes: supported block sizes; empty = any.
    """

    devices: frozenset[str]
    query_dtypes: frozenset[str] = frozenset({"float32", "float16", "bfloat16"})
    kv_dtypes: frozenset[str] = frozenset({"auto", "int8", "fp8_e4m3", "fp8_e5m2"})
    head_dims: frozenset[int] = frozenset()
    max_head_dim: int = 0
    block_sizes: frozenset[int] = frozenset()
    sliding_window: bool = True
    logits_soft_cap: bool = True
    gqa: bool = True
    min_compute_capability: tuple[int, int] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention kernels behind one interface.

    Tensor conventions (glossary names): ``num_tokens`` new tokens in the step,
    ``num_seqs`` sequences, ``num_q_heads``/``num_kv_heads``/``head_dim`` from the
    layer's AttentionSpec. Query/key/value are in the model dtype
    (float32|float16|bfloat16) on the cache's device; they may be strided views (e.g.
    slices of a fused QKV projection): a kernel that needs contiguous memory calls
    ``.contiguous()`` itself.
    """

    name: str
    capabilities: BackendCapabilities

    def unsupported_reasons(self, spec: CacheSpec, device: torch.device) -> list[str]:
        """Why this backend cannot run ``spec`` on ``device`` (empty = it can).

        Must not raise for a missing optional library: report it as a reason.
        """
        ...

    def kv_cache_shape(self, spec: CacheSpec, layer_id: int) -> tuple[int, ...]:
        """Shape of layer ``layer_id``'s ``KVCache.kv`` for ``spec.num_blocks`` blocks."""
        ...

    def allocate_kv_cache(self, spec: CacheSpec, layer_id: int, device: torch.device) -> KVCache:
        """Allocate (zeroed) the cache of one layer for ``spec``."""
        ...

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Precompute per-step data shared by all layers (stored in ``meta.extras``);
        called once per step before any layer. Returns ``meta``."""
        ...

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
    ) -> None:
        """Store new K/V into their slots, quantizing for int8/fp8 caches.

        Args:
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, model dtype.
            cache: mutated in place: ``kv`` (and ``token_scales`` for int8) at the
                slots in ``slot_mapping``; every other slot stays bit-identical.
            slot_mapping: ``[num_tokens]`` int64; -1 = skip this token.

        int8: scale = absmax over head_dim / 127 per token and head (0 -> codes 0,
        scale 0); codes = clamp(round_half_even(x / scale), -127, 127).
        fp8: stored = fp8(clamp(x / scale, -fp8_max, fp8_max)) with the cache's
        k_scale / v_scale (per tensor or per KV head).
        """
        ...

    def decode(
        self,
        query: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One new token per sequence attends to its whole (windowed) context.

        Args:
            query: ``[num_seqs, num_q_heads, head_dim]`` (``meta.max_query_len == 1``).
            out: optional ``[num_seqs, num_q_heads, head_dim]`` buffer to write into.

        Returns:
            ``[num_seqs, num_q_heads, head_dim]`` in the query dtype.
        """
        ...

    def prefill(
        self,
        query: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Varlen causal attention of new tokens over cached context + themselves.

        Args:
            query: ``[num_tokens, num_q_heads, head_dim]``, sequences packed by
                ``meta.query_start_loc``; token ``j`` of sequence ``i`` is at absolute
                position ``context_len_i + j``.
            out: optional ``[num_tokens, num_q_heads, head_dim]`` buffer.

        Returns:
            ``[num_tokens, num_q_heads, head_dim]`` in the query dtype.
        """
        ...

    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        """Copy whole blocks (copy-on-write): for each row ``(src, dst)`` of ``pairs``
        (``[n, 2]`` int64), ``cache[:, dst] = cache[:, src]`` in every given layer,
        scales included. Mutates ``caches``; bit-exact."""
        ...
