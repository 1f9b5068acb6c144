"""The gated RMSNorm of the recurrent mixers' outputs.

``norm_before_gate=False`` (Mamba-2, ``MambaRMSNormGated`` of transformers 5.23
models/mamba2/modeling_mamba2.py): ``w * rmsnorm_g(y * silu(z))`` with the RMS taken
over groups of ``group_size`` channels; ``norm_before_gate=True`` (Gated DeltaNet,
``Qwen3NextRMSNormGated`` of models/qwen3_next/modeling_qwen3_next.py):
``(w * rmsnorm_g(y)) * silu(z)``. Both compute in float32 and return the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRMSNorm(nn.Module):
    """Args: dim (channels, the weight's size), group_size (channels per RMS group;
    divides ``dim``), eps, norm_before_gate (see the module docstring)."""

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y``, ``z`` ``[T, dim]`` -> ``[T, dim]`` in ``y``'s dtype."""
        dtype = y.dtype
        h = y.float()
        if not self.norm_before_gate:
            h = h * F.silu(z.float())
        t = h.shape[0]
        g = h.view(t, -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * g.view(t, -1).to(dtype)
        if self.norm_before_gate:
            out = out * F.silu(z.float())
        return out.to(dtype)

    def reference(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The same in float64 (tests' reference)."""
        h, zz = y.double(), z.double()
        if not self.norm_before_gate:
            h = h * F.silu(zz)
        t = h.shape[0]
        g = h.view(t, -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight.double() * g.reshape(t, -1)
        return out * F.silu(zz) if self.norm_before_gate else out


__all__ = ["GatedRMSNorm"]
