"""KV quantization formulas — the spec every backend's ``write_kv`` follows.

int8 (per token, per KV head, symmetric; as in vLLM's per-token int8 KV and
LLM.int8()-style absmax quantization):
    absmax = max(|x|) over head_dim (float32)
    scale  = absmax / 127            (float32; 0 for an all-zero token)
    code   = clamp(round_half_even(x / scale), -127, 127)   (0 where scale == 0)
    x_hat  = code * scale

fp8 (per tensor or per KV head; OCP FP8 e4m3 / e5m2, as in vLLM's fp8 KV cache):
    stored = fp8(clamp(x / scale, -fp8_max, fp8_max))   round to nearest even
    x_hat  = float(stored) * scale
The explicit clamp makes out-of-range values saturate (e4m3: ±448, e5m2: ±57344)
on every backend instead of producing NaN or inf.
"""

from __future__ import annotations

import torch

from kvpage.attention.metadata import FP8_MAX, INT8_MAX


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., head_dim]`` to int8 codes and per-row float32 scales.

    Returns:
        ``(codes [..., head_dim] int8, scales [...] float32)``.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xf / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    codes = torch.where(scale.unsqueeze(-1) > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.int8), scale


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes [..., head_dim]`` int8 times ``scales [...]`` -> float32."""
    return codes.float() * scales.float().unsqueeze(-1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x [..., num_kv_heads, head_dim]`` -> fp8 with ``scale`` ``[]`` or ``[num_kv_heads]``."""
    m = FP8_MAX[fp8_dtype]
    s = scale.float()
    if s.dim() == 1:
        s = s.unsqueeze(-1)
    return (x.float() / s).clamp_(-m, m).to(fp8_dtype)


def dequantize_fp8(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``[..., num_kv_heads, head_dim]`` times ``scale`` (``[]`` or ``[num_kv_heads]``)."""
    s = scale.float()
    if s.dim() == 1:
        s = s.unsqueeze(-1)
    return stored.float() * s
