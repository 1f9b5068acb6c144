"""A complete attention backend in plain torch, one sequence at a time.

The worked example of docs/backend-authoring.md: every method of
``kvpage.attention.protocol.AttentionBackend``, written from that page alone, and run
by the conformance suite in the default test run (``conformance/conftest.py`` adds it
as ``example-loop``). It is slow by design (a Python loop over sequences) and declares
no ``priority``, so ``select_backend(prefer="auto")`` never picks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvpage.attention.checks import check_block_pairs, check_forward, check_write_kv
from kvpage.attention.metadata import AttentionMetadata, KVCache, slot_of
from kvpage.attention.plan import StepPlan, step_fields
from kvpage.attention.protocol import BackendCapabilities
from kvpage.attention.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8
from kvpage.specs import AttentionSpec, CacheSpec


@dataclass(frozen=True, kw_only=True)
class LoopPlan(StepPlan):
    """The step, validated, plus what every layer shares: each sequence's first query
    row and (per block size, built by the first layer that needs it) the cache slots of
    its keys ``0 .. seq_len - 1``."""

    query_starts: tuple[int, ...]
    key_slots: dict[int, list[torch.Tensor]] = field(default_factory=dict, compare=False)

    def slots(self, block_size: int) -> list[torch.Tensor]:
        """Per sequence: ``[seq_len]`` int64 slots of its keys (``slot_of``)."""
        if block_size not in self.key_slots:
            tables = self.meta.block_tables.tolist()
            self.key_slots[block_size] = [
                torch.tensor(
                    [slot_of(tables[i][p // block_size], p, block_size) for p in range(s)],
                    dtype=torch.int64,
                    device=self.device,
                )
                for i, s in enumerate(self.meta.seq_lens_cpu)
            ]
        return self.key_slots[block_size]


def _flat(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as ``[rows, width]``, 1-byte dtypes as uint8 (fp8 indexing is not
    implemented on every device)."""
    return (x.view(torch.uint8) if x.element_size() == 1 else x).reshape(-1, width)


class LoopBackend:
    """Paged attention as a loop over sequences (reference-grade, slow)."""

    name = "example-loop"
    capabilities = BackendCapabilities(devices=frozenset({"cpu", "cuda"}))

    def unsupported_reasons(self, spec: CacheSpec, device: torch.device) -> list[str]:
        dev = torch.device(device)
        if dev.type not in self.capabilities.devices:
            return [f"device: expected cpu or cuda, got {dev.type}"]
        if dev.type == "cuda" and not torch.cuda.is_available():
            return ["device: expected an available CUDA device, got none"]
        return []

    def test_budget(self, device: torch.device) -> Mapping[str, object] | None:
        return {"example_fraction": 0.5, "max_seq_len": 96}

    def plan(self, meta: AttentionMetadata) -> LoopPlan:
        starts = [0]
        for q in meta.query_lens_cpu:
            starts.append(starts[-1] + q)
        return LoopPlan(**step_fields(meta), query_starts=tuple(starts))

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: LoopPlan | None = None,  # the step's plan; unused: it checks every call
    ) -> None:
        check_write_kv(key, value, cache, slot_mapping)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(torch.int64)
        h, d = cache.num_kv_heads, cache.head_dim
        for i, x in enumerate((key[keep], value[keep])):
            if cache.kv_dtype == "auto":
                stored = x.to(cache.kv.dtype)
            elif cache.kv_dtype == "int8":
                stored, scales = quantize_int8(x)
                assert cache.token_scales is not None
                cache.token_scales[i].view(-1, h)[slots] = scales
            else:
                scale = cache.k_scale if i == 0 else cache.v_scale
                assert scale is not None
                stored = quantize_fp8(x, scale, cache.kv.dtype)
            _flat(cache.kv[i], h * d)[slots] = _flat(stored, h * d)

    def _keys(self, cache: KVCache, i: int, slots: torch.Tensor) -> torch.Tensor:
        """K (``i`` = 0) or V (1) at ``slots``, dequantized: ``[n, num_kv_heads, head_dim]``
        float32."""
        h, d = cache.num_kv_heads, cache.head_dim
        raw = _flat(cache.kv[i], h * d)[slots].view(cache.kv.dtype).view(-1, h, d)
        if cache.kv_dtype == "int8":
            assert cache.token_scales is not None
            return dequantize_int8(raw, cache.token_scales[i].reshape(-1, h)[slots])
        if cache.kv_dtype != "auto":
            scale = cache.k_scale if i == 0 else cache.v_scale
            assert scale is not None
            return dequantize_fp8(raw, scale.view(h, 1) if scale.dim() else scale)
        return raw.float()

    def forward(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: LoopPlan,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_forward(query, cache, plan, spec, out)
        result = torch.empty_like(query) if out is None else out
        group = spec.num_q_heads // spec.num_kv_heads
        for i, slots in enumerate(plan.slots(cache.block_size)):
            q0, q1 = plan.query_starts[i], plan.query_starts[i + 1]
            if q1 == q0:
                continue
            k = self._keys(cache, 0, slots).repeat_interleave(group, dim=1)
            v = self._keys(cache, 1, slots).repeat_interleave(group, dim=1)
            q = query[q0:q1].float()
            logits = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
            if spec.logits_soft_cap is not None:
                logits = spec.logits_soft_cap * torch.tanh(logits / spec.logits_soft_cap)
            seq_len = slots.shape[0]
            qpos = torch.arange(seq_len - (q1 - q0), seq_len, device=query.device)[:, None]
            kpos = torch.arange(seq_len, device=query.device)[None, :]
            visible = kpos <= qpos
            if spec.sliding_window is not None:
                visible &= kpos > qpos - spec.sliding_window
            weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            result[q0:q1] = torch.einsum("hqk,khd->qhd", weights, v).to(query.dtype)
        return result

    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        for c in caches:
            check_block_pairs(pairs, c.num_blocks)
        for c in caches:
            for src, dst in pairs.tolist():
                kv = c.kv.view(torch.uint8) if c.kv.element_size() == 1 else c.kv
                kv[:, dst] = kv[:, src]
                if c.token_scales is not None:
                    c.token_scales[:, dst] = c.token_scales[:, src]
