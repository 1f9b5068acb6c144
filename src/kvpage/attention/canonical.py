"""Plumbing shared by every backend that stores K/V in the canonical layout
``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(``kvpage.attention.metadata.allocate_kv_cache``).

``CanonicalLayoutBackend`` gives a backend class ``kv_cache_shape``,
``allocate_kv_cache``, and ``decode``/``prefill`` that dispatch to the backend's own
``_attention`` (its checks and kernels); the functions below are the host-side helpers that kernel
launchers share (selection reasons, per-row maps, fp8 scale tables). The built-in torch
backend and the triton, cupy and numba plugins all use them and keep only their own
kernels and launch logic. Launcher-side input checks live in ``kvpage.attention.checks``.
"""

from __future__ import annotations

import torch

from kvpage.attention.metadata import (
    MODEL_DTYPES,
    AttentionMetadata,
    KVCache,
    allocate_kv_cache,
)
from kvpage.specs import AttentionSpec, CacheSpec


class CanonicalLayoutBackend:
    """Mixin: ``kv_cache_shape`` and ``allocate_kv_cache`` of the canonical layout, and
    ``decode``/``prefill`` as one entry point ``_attention(..., decode=...)`` that each
    backend implements (validation first, then its kernels); see
    ``kvpage.attention.protocol.AttentionBackend``."""

    def _attention(
        self,
        query: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        out: torch.Tensor | None,
        decode: bool,
    ) -> torch.Tensor:
        """Validate the inputs (the decode checks when ``decode``) and compute attention
        for every query row of the step. Implemented by each backend."""
        raise NotImplementedError(f"{type(self).__name__}._attention")

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
            query: ``[num_seqs, num_q_heads, head_dim]`` float32|float16|bfloat16.
            cache: the layer's cache, already holding this step's K/V.
            meta: the step; every ``query_lens_cpu`` entry is 1.
            spec: the layer's attention spec (scale, window, soft cap, GQA).
            out: optional ``[num_seqs, num_q_heads, head_dim]`` buffer (query dtype).

        Returns:
            ``[num_seqs, num_q_heads, head_dim]`` in the query dtype (``out`` if given).

        Raises:
            ShapeError, DTypeError: invalid arguments (``kvpage.attention.checks``);
            nothing is written. BackendUnavailableError: the device cannot run it.
        """
        return self._attention(query, cache, meta, spec, out, decode=True)

    def prefill(
        self,
        query: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Varlen causal attention of new tokens over cached context + themselves
        (decode rows allowed; chunked prefill and prefix-cache hits alike).

        Args:
            query: ``[num_tokens, num_q_heads, head_dim]``, packed by
                ``meta.query_start_loc``; token ``j`` of sequence ``i`` is at absolute
                position ``context_len_i + j``.
            out: optional ``[num_tokens, num_q_heads, head_dim]`` buffer (query dtype).

        Returns:
            ``[num_tokens, num_q_heads, head_dim]`` in the query dtype.

        Raises:
            ShapeError, DTypeError: invalid arguments (``kvpage.attention.checks``);
            nothing is written. BackendUnavailableError: the device cannot run it.
        """
        return self._attention(query, cache, meta, spec, out, decode=False)

    def kv_cache_shape(self, spec: CacheSpec, layer_id: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_dim)`` of layer ``layer_id``.

        Raises:
            IndexError: ``layer_id`` is not a layer of ``spec``.
        """
        a = spec.layers[layer_id]
        return (2, spec.num_blocks, spec.block_size, a.num_kv_heads, a.head_dim)

    def allocate_kv_cache(
        self, spec: CacheSpec, layer_id: int, device: torch.device | str
    ) -> KVCache:
        """A zeroed cache of layer ``layer_id`` on ``device`` in the model dtype
        ``spec.dtype`` (or the storage dtype of ``spec.kv_dtype``); int8 token scales
        start at 0, fp8 scales at 1.0 (per tensor or per KV head, after
        ``spec.kv_scale_granularity``).

        Raises:
            IndexError: ``layer_id`` is not a layer of ``spec``.
        """
        _, num_blocks, block_size, num_kv_heads, head_dim = self.kv_cache_shape(spec, layer_id)
        return allocate_kv_cache(
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=MODEL_DTYPES[spec.dtype],
            kv_dtype=spec.kv_dtype,
            kv_scale_granularity=spec.kv_scale_granularity,
            device=device,
        )


def head_dim_reasons(spec: CacheSpec, max_head_dim: int) -> list[str]:
    """``["layers[i].head_dim: expected <= max_head_dim, got d"]`` for the first layer
    of ``spec`` whose head_dim is too large; ``[]`` when all fit (or ``max_head_dim``
    is 0 = unbounded). For ``unsupported_reasons``."""
    if max_head_dim <= 0:
        return []
    for i, layer in enumerate(spec.layers):
        if layer.head_dim > max_head_dim:
            return [f"layers[{i}].head_dim: expected <= {max_head_dim}, got {layer.head_dim}"]
    return []


def token_map(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence index and absolute position of every query row, as two ``[num_tokens]``
    int32 tensors on ``meta.seq_lens``'s device, built from the host lists
    (``query_lens_cpu``, ``seq_lens_cpu``): no device sync. Row ``j`` of sequence ``i``
    sits at position ``seq_len_i - query_len_i + j``."""
    seq: list[int] = []
    pos: list[int] = []
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        seq.extend([i] * q)
        pos.extend(range(s - q, s))
    dev = meta.seq_lens.device
    return (
        torch.tensor(seq, dtype=torch.int32, device=dev),
        torch.tensor(pos, dtype=torch.int32, device=dev),
    )


def max_keys_per_query(meta: AttentionMetadata, spec: AttentionSpec) -> int:
    """The most keys any query row of the step attends to (``spec.sliding_window``
    included); 0 for a step without query rows. From host lists: no device sync."""
    best = 0
    for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        if q > 0:
            best = max(best, s if spec.sliding_window is None else min(s, spec.sliding_window))
    return best


def fp8_scale_table(cache: KVCache) -> torch.Tensor:
    """``[2, num_kv_heads]`` float32 on the cache's device: the K and V fp8 scales per
    KV head (a per-tensor scale broadcast), or ones for a cache without fp8 scales."""
    h = cache.num_kv_heads
    if cache.k_scale is None or cache.v_scale is None:
        return torch.ones((2, h), dtype=torch.float32, device=cache.kv.device)
    return torch.stack([cache.k_scale.expand(h), cache.v_scale.expand(h)]).contiguous()
