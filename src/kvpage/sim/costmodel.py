"""Step-time cost model: how long one engine step takes on a GPU, from token counts.

A roofline model of one forward step over a batch (no weights are needed):

* **compute time** = FLOPs / (peak_flops x flops_efficiency), with
  ``FLOPs = 2 x active_parameters x num_batched_tokens`` (every weight a token passes is
  one multiply-add: Kaplan et al. 2020, "Scaling Laws", sec. 2.1; a MoE token passes only
  its top-k experts, so ``active_parameters`` = all parameters minus the other experts')
  plus attention ``4 x num_q_heads x head_dim x sum_layers sum_i keys_l(c_i, q_i)`` (QK^T
  and PV), where ``keys_l`` is the number of (query, key) pairs of query i's ``q_i`` new
  tokens at positions ``c_i .. c_i + q_i - 1``: ``sum_x min(x, W_l)`` for
  ``x = c_i + 1 .. c_i + q_i`` (``W_l`` = layer l's sliding window, infinite for full
  attention; without windows this is ``q_i x (c_i + (q_i + 1) / 2)``, causal within the
  chunk). Prefill-heavy steps are compute-bound.
* **memory time** = bytes / (peak_bandwidth x bandwidth_efficiency), with
  ``bytes = weight_bytes + sum_i sum_layers min(seq_len_i, W_l) x layer_kv_bytes_per_token``
  (weights read once per step, every sequence's K/V within each layer's window read
  once, new K/V written) plus, for a hybrid model, ``2 x state_bytes_per_sequence`` per
  scheduled sequence (its recurrent state read and written once per step; the
  recurrent layers' own FLOPs, ~4 x heads x key_dim x value_dim per token and layer,
  are not counted: under 2 % of ``2 x active_parameters`` for Qwen3-Next-80B-A3B).
  Copies of whole state slots (snapshots, restores, host snapshot rows) are not part of
  the step's roofline: ``kvpage.sim.tiers.StateCopyMeter`` adds them.
  Decode steps are memory-bound.
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
        active_parameters: parameters one token passes (MoE: top-k experts); None =
            ``num_parameters`` (dense).
        layer_windows: per layer ``(KV bytes per token, sliding window or None)``; empty
            = every layer full attention with ``kv_bytes_per_token / num_layers`` each.
            When given, ``kv_bytes_per_token`` must equal the sum of the layers' bytes.
        state_bytes_per_sequence: recurrent state bytes of one sequence (hybrid
            models, ``CacheSpec.state_bytes_per_sequence``), 0 = none.

    Raises:
        SpecError: an efficiency outside (0, 1], a negative overhead, ``layer_windows``
            of another length than ``num_layers`` or not summing to
            ``kv_bytes_per_token``, a window < 1, ``active_parameters`` outside
            ``[1, num_parameters]``.
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
    active_parameters: int | None = None
    layer_windows: tuple[tuple[int, int | None], ...] = ()
    state_bytes_per_sequence: int = 0

    def __post_init__(self) -> None:
        lw = self.layer_windows
        if lw:
            if len(lw) != self.num_layers:
                raise SpecError(f"layer_windows: expected {self.num_layers} layers, got {len(lw)}")
            if sum(b for b, _ in lw) != self.kv_bytes_per_token:
                raise SpecError(
                    f"layer_windows: expected bytes summing to kv_bytes_per_token="
                    f"{self.kv_bytes_per_token}, got {sum(b for b, _ in lw)}"
                )
            if any(w is not None and w < 1 for _, w in lw):
                raise SpecError(f"layer_windows: expected windows >= 1 or None, got {lw}")
        ap = self.active_parameters
        if ap is not None and not (1 <= ap <= self.num_parameters):
            raise SpecError(
                f"active_parameters: expected 1 .. num_parameters={self.num_parameters}, got {ap}"
            )
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            v = getattr(self, name)
            if not (0 < v <= 1):
                raise SpecError(f"{name}: expected 0 < e <= 1, got {v}")
        if self.step_overhead_s < 0:
            raise SpecError(f"step_overhead_s: expected >= 0, got {self.step_overhead_s}")

    def _windows(self) -> dict[int | None, tuple[int, int]]:
        """window -> (layers, KV bytes per token of those layers)."""
        if not self.layer_windows:
            return {None: (self.num_layers, self.kv_bytes_per_token)}
        out: dict[int | None, tuple[int, int]] = {}
        for b, w in self.layer_windows:
            n, tot = out.get(w, (0, 0))
            out[w] = (n + 1, tot + b)
        return out

    def flops(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """FLOPs of a step computing ``query_lens[i]`` new tokens on top of
        ``context_lens[i]`` cached tokens per sequence (module docstring)."""
        tokens = sum(query_lens)
        attn = 0.0
        for w, (n, _) in self._windows().items():
            attn += n * sum(_pairs(c, q, w) for q, c in zip(query_lens, context_lens))
        active = self.active_parameters or self.num_parameters
        return 2.0 * active * tokens + 4.0 * self.num_q_heads * self.head_dim * attn

    def bytes_moved(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """Bytes read and written: weights once, each sequence's K/V within each layer's
        window (module docstring)."""
        kv = 0
        for w, (_, b) in self._windows().items():
            lens = (q + c for q, c in zip(query_lens, context_lens))
            kv += b * sum(n if w is None else min(n, w) for n in lens)
        state = 2 * self.state_bytes_per_sequence * len(query_lens)
        return float(self.weight_bytes + kv + state)

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


def _pairs(c: int, q: int, w: int | None) -> float:
    """``sum_x min(x, w)`` for ``x = c + 1 .. c + q`` (keys each new query sees)."""
    a, b = c + 1, c + q
    if w is None or b <= w:
        return (a + b) * q / 2
    if a >= w:
        return float(w * q)
    return (a + w) * (w - a + 1) / 2 + w * (b - w)


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
