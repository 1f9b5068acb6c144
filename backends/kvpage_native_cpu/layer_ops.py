"""The ``native-cpu`` backend's ``LayerOps`` (``kvpage.attention.protocol``): RMSNorm
(with the residual add before it), RoPE of the fused q/k/v projection and SiLU·mul,
float32 on the CPU, one C call each (``kernel.c``: ``kvp_rms_norm``, ``kvp_rope_qk``,
``kvp_silu_mul``).

Why: on a small model the ops around attention cost per call, not per element (a
``[20, 64]`` ``F.rms_norm`` is ~20 us, several ops for RoPE), and right after an
attention call that streamed the K/V through the caches every distinct op pays to
refill them (docs/benchmarks.md, "Non-attention CPU per step"). One C call per op
replaces 1-6 torch ops. The torch formulas in ``kvpage.models`` are the reference:
RoPE is bit-identical to ``apply_rope_qkv``; RMSNorm and SiLU·mul differ by float32
rounding (sums in another order; exp by the attention kernel's polynomial), tested
against them.
"""

from __future__ import annotations

import ctypes

import torch

from kvpage.errors import DTypeError, ShapeError


def _check_f32(name: str, t: torch.Tensor) -> None:
    """``t`` is a float32 CPU tensor, else DTypeError / ShapeError naming it."""
    if t.dtype != torch.float32:
        raise DTypeError(f"{name}: expected float32, got {t.dtype}")
    if t.device.type != "cpu":
        raise ShapeError(f"{name}.device: expected cpu, got {t.device}")


def _f32(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous float32 CPU tensor (a copy only when it is strided)."""
    _check_f32(name, t)
    return t if t.is_contiguous() else t.contiguous()


class NativeLayerOps:
    """``LayerOps`` for float32 CPU tensors through the kernel library ``lib``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.rms_norm``."""
        x = _f32("x", x)
        w = _f32("weight", weight)
        if x.dim() != 2 or w.dim() != 1 or w.shape[0] != x.shape[1]:
            raise ShapeError(f"x, weight: expected [rows, n] and [n], got {list(x.shape)}, {list(w.shape)}")  # fmt: skip
        out = torch.empty_like(x)
        s = x
        rp = None
        if residual is not None:
            r = _f32("residual", residual)
            if r.shape != x.shape:
                raise ShapeError(f"residual: expected {list(x.shape)}, got {list(r.shape)}")
            s = torch.empty_like(x)
            rp = r.data_ptr()
        self._lib.kvp_rms_norm(
            x.data_ptr(), rp, w.data_ptr(), eps, x.shape[0], x.shape[1], s.data_ptr(), out.data_ptr()
        )  # fmt: skip
        return s, out

    def rope_qk(
        self,
        qkv: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.rope_qk``."""
        t, d = qkv.shape[0], cos.shape[-1]
        _check_f32("qkv", qkv)  # strided rows are read in place: no copy
        if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < (num_q_heads + num_kv_heads) * d:
            raise ShapeError(
                f"qkv: expected [rows, >= {(num_q_heads + num_kv_heads) * d}] with unit column "
                f"stride, got {list(qkv.shape)} strides {list(qkv.stride())}"
            )
        if d % 2 or cos.numel() != t * d or sin_signed.numel() != t * d:
            raise ShapeError(f"cos, sin: expected [{t}, 1, even head_dim], got {list(cos.shape)}, {list(sin_signed.shape)}")  # fmt: skip
        c, s = _f32("cos", cos), _f32("sin_signed", sin_signed)
        q = qkv.new_empty((t, num_q_heads, d))
        k = qkv.new_empty((t, num_kv_heads, d))
        self._lib.kvp_rope_qk(
            qkv.data_ptr(), qkv.stride(0), c.data_ptr(), s.data_ptr(), t, num_q_heads,
            num_kv_heads, d, q.data_ptr(), k.data_ptr(),
        )  # fmt: skip
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.silu_mul``."""
        gu = _f32("gate_up", gate_up)
        if gu.dim() != 2 or gu.shape[1] % 2:
            raise ShapeError(f"gate_up: expected [rows, 2 * i], got {list(gu.shape)}")
        i = gu.shape[1] // 2
        out = gu.new_empty((gu.shape[0], i))
        self._lib.kvp_silu_mul(gu.data_ptr(), gu.shape[0], i, out.data_ptr())
        return out


__all__ = ["NativeLayerOps"]
