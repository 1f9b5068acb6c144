"""The built-in torch backend: paged attention with vectorized torch ops, CPU and CUDA.

Independent of the float64 reference (``kvpage.attention.reference``) and tested
against it by the conformance suite. Quantization follows ``kvpage.attention.quant``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvpage.attention.canonical import mla_as_mqa
from kvpage.attention.checks import (
    check_block_pairs,
    check_forward,
    check_write_kv,
)
from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import BackendCapabilities
from kvpage.attention.quant import quantize_fp8, quantize_int8
from kvpage.backends.torch_backend.compute import pick_attend
from kvpage.backends.torch_backend.plan import STREAM_MIN_BYTES, SeqBucket, TorchPlan
from kvpage.errors import ShapeError
from kvpage.specs import AttentionSpec, CacheSpec


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A same-size integer view, so that 1-byte float8 tensors can be indexed and copied
    bit-exactly on every device."""
    return x.view(torch.uint8) if x.element_size() == 1 else x


class TorchBackend:
    """Paged attention in plain torch (see ``kvpage.attention.protocol.AttentionBackend``).

    Decode and prefill share one path: sequences are bucketed (``plan.TorchPlan``),
    whole blocks are gathered per bucket, and attention runs through
    ``torch.nn.functional.scaled_dot_product_attention`` (explicit float32 matmuls
    when a logit soft cap or attention sinks are set). Unquantized caches compute in the cache dtype;
    int8/fp8 caches are dequantized to float32. An MLA layer runs as the MQA it is in
    the absorbed form (``kvpage.attention.canonical.mla_as_mqa``: the latent is the one
    KV head's key and value) through the same paths; its output keeps the first
    ``kv_lora_rank`` elements.
    """

    name = "torch"
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        priority={"cpu": 0, "cuda": 0},
        sinks=True,
        mla=True,
        notes=("reference-grade semantics in vectorized torch; any head_dim and block_size",),
    )

    def __init__(self, *, stream_min_bytes: int = STREAM_MIN_BYTES) -> None:
        """Args:
        stream_min_bytes: sequences whose K rows in the key range take at least this
            many bytes are computed alone from a whole-block gather (see
            ``plan.py``); smaller ones are batched with padding. 0 streams every
            sequence; a huge value batches every sequence (both are tested).
        """
        self.stream_min_bytes = stream_min_bytes

    # ---- selection -------------------------------------------------------------------
    def unsupported_reasons(self, spec: CacheSpec, device: torch.device) -> list[str]:
        """Reasons this backend cannot run ``spec`` on ``device`` ([] = it can)."""
        dev = torch.device(device)
        why = []
        if dev.type not in self.capabilities.devices:
            why.append(f"device: expected cpu or cuda, got {dev.type}")
        elif dev.type == "cuda" and not torch.cuda.is_available():
            why.append("device: expected an available CUDA device, got none (torch.cuda)")
        if spec.dtype not in self.capabilities.query_dtypes:
            why.append(f"dtype: expected one of float32|float16|bfloat16, got {spec.dtype}")
        if spec.kv_dtype not in self.capabilities.kv_dtypes:
            why.append(f"kv_dtype: expected auto|int8|fp8_e4m3|fp8_e5m2, got {spec.kv_dtype}")
        return why

    def test_budget(self, device: torch.device) -> Mapping[str, object] | None:
        """The default conformance budget on every device."""
        return None

    # ---- per step --------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> TorchPlan:
        """Validate the step and return its ``TorchPlan``; gather indices per
        (block_size, window) are built by the first layer that needs them and reused by
        the others.

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.plan.check_step``.
        """
        return TorchPlan.from_meta(meta)

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
        (``[num_tokens]`` int64, -1 = skip), quantizing per ``kvpage.attention.quant``.
        An MLA latent cache (``cache.is_latent``): the latent ``[num_tokens, 1,
        head_dim]`` as ``key``, ``value=None`` (fp8 with ``k_scale``).

        Mutates ``cache.kv`` (and ``cache.token_scales`` for int8) at the mapped slots
        only; every other slot stays bit-identical. Slots must be distinct.

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.checks.check_write_kv`` (not
                run for the slot mapping ``plan`` says the engine validated at plan
                time: ``plan.checked_slot_mapping is slot_mapping``).
        """
        if plan is None or plan.checked_slot_mapping is not slot_mapping:
            check_write_kv(key, value, cache, slot_mapping)
        slots = slot_mapping.to(torch.int64)
        rows = [key] if value is None else [key, value]
        if slots.numel() and bool((slots < 0).any()):
            keep = torch.nonzero(slots >= 0).squeeze(1)
            slots, rows = slots[keep], [x[keep] for x in rows]
        if slots.numel() == 0:
            return
        n = cache.num_blocks * cache.block_size
        h, d = cache.num_kv_heads, cache.head_dim
        byte = cache.kv.element_size() == 1  # fp8/int8: copy as uint8 bits (see _bits)
        planes = len(rows)
        flat = (cache.kv.view(torch.uint8) if byte else cache.kv).view(planes, n, h, d)
        kind = cache.kv_dtype
        for i, x in enumerate(rows):
            if kind == "auto":
                stored = x.to(cache.kv.dtype)
            elif kind == "int8":
                stored, scales = quantize_int8(x)
                assert cache.token_scales is not None
                cache.token_scales.view(planes, n, h)[i].index_copy_(0, slots, scales)
            else:
                s = cache.k_scale if i == 0 else cache.v_scale
                assert s is not None
                stored = quantize_fp8(x, s, cache.kv.dtype)
            flat[i].index_copy_(0, slots, stored.view(torch.uint8) if byte else stored)

    def forward(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: TorchPlan,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer over the step (``AttentionBackend.forward``): the
        plan's buckets for this cache and window, each attended by the compute path
        chosen for it (``compute.pick_attend``) into ``out``. Buckets, paths and their
        step-constant buffers are built by the first layer of each layer shape and
        kept in ``plan.runs``; later layers only look them up. An MLA layer
        (``spec.kv_lora_rank``): ``query`` is the absorbed query ``[num_tokens,
        num_q_heads, head_dim]`` and the result ``[num_tokens, num_q_heads,
        kv_lora_rank]`` (``mla_as_mqa``).

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.checks.check_forward``.
        """
        if not plan.layers_checked:  # else validated at plan time (checks.check_step_layers)
            check_forward(query, cache, plan, spec, out, sinks)
        if spec.kv_lora_rank is not None:  # spec.is_mla, without a property call per layer
            alias, mqa = mla_as_mqa(cache, spec)
            full = self._attend(query, alias, plan, mqa, None, None)
            res = full[..., : spec.value_dim]
            if out is None:
                return res.contiguous()
            out.copy_(res)
            return out
        return self._attend(query, cache, plan, spec, out, sinks)

    def _attend(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: TorchPlan,
        spec: AttentionSpec,
        out: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward`` after its checks, for a K/V cache (an MLA alias included)."""
        key = (
            cache.block_size,
            cache.num_blocks,
            cache.num_kv_heads,
            cache.head_dim,
            cache.kv.dtype,
            spec.num_q_heads,
            spec.sliding_window,
            self.stream_min_bytes,
            cache.kv.stride(0) == 0,  # an MLA alias (V plane = K plane): no [2 * slots] view
        )
        runs = plan.runs.get(key)
        if runs is None:
            runs = self._layer_runs(cache, plan, spec)
            plan.runs[key] = runs
        if out is None:
            out = torch.empty_like(query)
        for attend, g in runs:
            attend(query, cache, g, spec, out, sinks)
        return out

    def _layer_runs(
        self, cache: KVCache, plan: TorchPlan, spec: AttentionSpec
    ) -> list[tuple[Callable[..., None], SeqBucket]]:
        """The buckets of a layer shape with their compute paths (once per step and
        shape). Off the CPU, checks the block ids the buckets read against the pool
        (CPU block tables were checked by ``check_forward``).

        Raises:
            ShapeError: a block id outside ``[0, cache.num_blocks)``.
        """
        row_bytes = cache.num_kv_heads * cache.head_dim * cache.kv.element_size()
        buckets = plan.buckets(
            cache.block_size, spec.sliding_window, row_bytes, self.stream_min_bytes
        )
        if plan.device.type != "cpu":
            for g in buckets:
                if g.min_block < 0 or g.max_block >= cache.num_blocks:
                    raise ShapeError(
                        f"meta.block_tables: expected block ids in [0, {cache.num_blocks - 1}], "
                        f"got [{g.min_block}, {g.max_block}]"
                    )
        return [(pick_attend(g, cache, spec), g) for g in buckets]

    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        """``cache[:, dst] = cache[:, src]`` for each ``(src, dst)`` row of ``pairs``
        (``[n, 2]`` int64) in every cache, int8 token scales included; bit-exact.

        Raises:
            ShapeError: bad ``pairs`` shape or a block id out of range (nothing copied).
        """
        for c in caches:
            check_block_pairs(pairs, c.num_blocks)
        if pairs.numel() == 0:
            return
        for c in caches:
            p = pairs.to(device=c.kv.device, dtype=torch.int64)
            src, dst = p[:, 0], p[:, 1]
            kv = _bits(c.kv)
            kv[:, dst] = kv[:, src]
            if c.token_scales is not None:
                c.token_scales[:, dst] = c.token_scales[:, src]
