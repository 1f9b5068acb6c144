"""Step-time cost model: how long one engine step takes on a GPU, from token counts.

A roofline model of one forward step over a batch (no weights are needed):

* **compute time** = FLOPs / (peak_flops x flops_efficiency), with
  ``FLOPs = 2 x num_parameters x num_batched_tokens`` (every weight is one multiply-add
  per token: Kaplan et al. 2020, "Scaling Laws", sec. 2.1) plus attention
  ``4 x layers x num_q_heads x head_dim x sum_i q_i x (c_i + (q_i + 1) / 2)`` (QK^T and
  PV for query i's ``q_i`` new tokens against ``c_i`` cached ones, causal within the
  chunk). Prefill-heavy steps are compute-bound.
* **memory time** = bytes / (peak_bandwidth x bandwidth_efficiency), with
  ``bytes = weight_bytes + sum_i seq_len_i x kv_bytes_per_token`` (weights read once per
  step, every sequence's K/V read once, new K/V written). Decode steps are memory-bound.
* **step time** = ``max(compute, memory) + step_overhead_s`` (the slower of the two rooflines;
  ``step_overhead_s`` stands for kernel launches, sampling and scheduling on the host).

Peak numbers are the vendors' datasheet figures for dense BF16 tensor-core throughput
and HBM/GDDR bandwidth (no sparsity). The efficiency factors are assumptions, not
measurements: 0.6 of peak FLOPs and 0.8 of peak bandwidth are typical of well-tuned
inference kernels; override them when you have measured numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpage.errors import SpecError


@dataclass(frozen=True)
class GPUPreset:
    """Peak numbers of one accelerator.

    Attributes:
        name: preset name.
        memory_bytes: device memory in bytes.
        peak_flops: dense BF16 tensor-core FLOP/s (no sparsity).
        peak_bandwidth: memory bandwidth in bytes/s.
        source: where the numbers come from.
    """

    name: str
    memory_bytes: int
    peak_flops: float
    peak_bandwidth: float
    source: str


GPU_PRESETS: dict[str, GPUPreset] = {
    "A100-80GB": GPUPreset(
        "A100-80GB",
        80 * 10**9,
        312e12,
        2.039e12,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense, "
        "HBM2e 2,039 GB/s",
    ),
    "H100-80GB": GPUPreset(
        "H100-80GB",
        80 * 10**9,
        989e12,
        3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity = "
        "989 dense, HBM3 3.35 TB/s",
    ),
    "H200": GPUPreset(
        "H200",
        141 * 10**9,
        989e12,
        4.8e12,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity = "
        "989 dense, 141 GB HBM3e at 4.8 TB/s",
    ),
    "L4": GPUPreset(
        "L4",
        24 * 10**9,
        121e12,
        300e9,
        "NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity = 121 dense, "
        "GDDR6 300 GB/s",
    ),
}


@dataclass(frozen=True)
class StepCostModel:
    """Step time of a model on a GPU (see the module docstring for the formulas).

    Attributes:
        num_parameters: model parameters (per model replica).
        weight_bytes: bytes of weights read each step (per replica).
        num_layers, num_q_heads, head_dim: attention shape for attention FLOPs.
        kv_bytes_per_token: KV bytes of one token over all layers.
        gpu: the accelerator's peak numbers.
        flops_efficiency: achieved / peak FLOP/s (0 < e <= 1), default 0.6 (assumed).
        bandwidth_efficiency: achieved / peak bandwidth (0 < e <= 1), default 0.8 (assumed).
        step_overhead_s: fixed host-side cost per step in seconds, default 0.002 (assumed).
    """

    num_parameters: int
    weight_bytes: int
    num_layers: int
    num_q_heads: int
    head_dim: int
    kv_bytes_per_token: int
    gpu: GPUPreset
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002

    def __post_init__(self) -> None:
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            v = getattr(self, name)
            if not (0 < v <= 1):
                raise SpecError(f"{name}: expected 0 < e <= 1, got {v}")
        if self.step_overhead_s < 0:
            raise SpecError(f"step_overhead_s: expected >= 0, got {self.step_overhead_s}")

    def flops(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """FLOPs of a step computing ``query_lens[i]`` new tokens on top of
        ``context_lens[i]`` cached tokens per sequence."""
        tokens = sum(query_lens)
        attn = sum(q * (c + (q + 1) / 2) for q, c in zip(query_lens, context_lens))
        return 2.0 * self.num_parameters * tokens + 4.0 * self.num_layers * (
            self.num_q_heads * self.head_dim * attn
        )

    def bytes_moved(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """Bytes read and written: weights once, K/V of every sequence's full length."""
        kv_tokens = sum(q + c for q, c in zip(query_lens, context_lens))
        return float(self.weight_bytes + kv_tokens * self.kv_bytes_per_token)

    def step_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """Seconds one step takes (0 for an empty batch)."""
        if not query_lens:
            return 0.0
        compute = self.flops(query_lens, context_lens) / (
            self.gpu.peak_flops * self.flops_efficiency
        )
        memory = self.bytes_moved(query_lens, context_lens) / (
            self.gpu.peak_bandwidth * self.bandwidth_efficiency
        )
        return max(compute, memory) + self.step_overhead_s


def get_gpu(name: str) -> GPUPreset:
    """A GPU preset by name (case-insensitive).

    Raises:
        SpecError: unknown name.
    """
    for k, v in GPU_PRESETS.items():
        if k.lower() == name.lower():
            return v
    raise SpecError(f"gpu: expected one of {sorted(GPU_PRESETS)}, got {name!r}")


__all__ = ["GPU_PRESETS", "GPUPreset", "StepCostModel", "get_gpu"]
