"""The ``native-cpu`` backend's ``LayerOps`` (``kvpage.attention.protocol``): RMSNorm
(with the residual add before it), RoPE of the fused q/k/v projection and SiLU·mul,
float32 or bfloat16 on the CPU, one C call each (``kernel.c``: ``kvp_rms_norm``,
``kvp_rope_qk``, ``kvp_silu_mul`` and their ``_bf16`` forms), and the greedy argmax of
logits rows (``kvp_argmax_rows``, ``GreedyOps``).

Why: on a small model the ops around attention cost per call, not per element (a
``[20, 64]`` ``F.rms_norm`` is ~20 us, several ops for RoPE), and right after an
attention call that streamed the K/V through the caches every distinct op pays to
refill them (docs/benchmarks.md, "Non-attention CPU per step"). One C call per op
replaces 1-6 torch ops. In bfloat16 the torch forms also upcast whole tensors to
float32 and back (RMSNorm) and round after every op; the C forms read and write bf16
and widen each element in registers (docs/benchmarks.md, issue 28).

The torch formulas in ``kvpage.models`` are the reference: RoPE is bit-identical to
``apply_rope_qkv`` in both dtypes; RMSNorm and SiLU·mul differ by float32 rounding
(sums in another order; exp by the attention kernel's polynomial), which in bfloat16
shows only where a float32 result lies within that rounding of a bf16 rounding
boundary: then the output is one bf16 ulp away (tested against the torch ops and a
float64 reference; docs/tolerances.md).
"""

from __future__ import annotations

import ctypes

import torch

from kvpage.errors import DTypeError, ShapeError

#: the dtypes with C layer ops
DTYPES = (torch.float32, torch.bfloat16)


def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """``t`` is a ``dtype`` CPU tensor, else DTypeError / ShapeError naming it."""
    if t.dtype != dtype:
        raise DTypeError(f"{name}: expected {str(dtype).removeprefix('torch.')}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ShapeError(f"{name}.device: expected cpu, got {t.device}")


def _contig(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` CPU tensor (a copy only when it is strided)."""
    _check(name, t, dtype)
    return t if t.is_contiguous() else t.contiguous()


class NativeLayerOps:
    """``LayerOps`` (and ``GreedyOps``) for ``dtype`` (float32 or bfloat16) CPU
    tensors through the kernel library ``lib``; every tensor argument must have that
    dtype (DTypeError otherwise: the model calls the ops only where it does).

    Raises:
        DTypeError: ``dtype`` has no C ops.
    """

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in DTYPES:
            raise DTypeError(f"dtype: expected float32 or bfloat16, got {dtype}")
        self._lib = lib
        self.dtype = dtype
        bf = dtype == torch.bfloat16
        self._norm = lib.kvp_rms_norm_bf16 if bf else lib.kvp_rms_norm
        self._rope = lib.kvp_rope_qk_bf16 if bf else lib.kvp_rope_qk
        self._silu = lib.kvp_silu_mul_bf16 if bf else lib.kvp_silu_mul

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.rms_norm``. bfloat16: ``s = bf16(residual + x)``, ``y =
        bf16(weight * bf16(s / sqrt(mean(s**2) + eps)))`` (LlamaRMSNorm's roundings),
        the mean in float32."""
        dt = self.dtype
        x = _contig("x", x, dt)
        w = _contig("weight", weight, dt)
        if x.dim() != 2 or w.dim() != 1 or w.shape[0] != x.shape[1]:
            raise ShapeError(f"x, weight: expected [rows, n] and [n], got {list(x.shape)}, {list(w.shape)}")  # fmt: skip
        out = torch.empty_like(x)
        s = x
        rp = None
        if residual is not None:
            r = _contig("residual", residual, dt)
            if r.shape != x.shape:
                raise ShapeError(f"residual: expected {list(x.shape)}, got {list(r.shape)}")
            s = torch.empty_like(x)
            rp = r.data_ptr()
        self._norm(
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
        """See ``LayerOps.rope_qk`` (bit-identical to ``apply_rope_qkv`` in either dtype)."""
        t, d = qkv.shape[0], cos.shape[-1]
        dt = self.dtype
        _check("qkv", qkv, dt)  # strided rows are read in place: no copy
        if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < (num_q_heads + num_kv_heads) * d:
            raise ShapeError(
                f"qkv: expected [rows, >= {(num_q_heads + num_kv_heads) * d}] with unit column "
                f"stride, got {list(qkv.shape)} strides {list(qkv.stride())}"
            )
        if d % 2 or cos.numel() != t * d or sin_signed.numel() != t * d:
            raise ShapeError(f"cos, sin: expected [{t}, 1, even head_dim], got {list(cos.shape)}, {list(sin_signed.shape)}")  # fmt: skip
        c, s = _contig("cos", cos, dt), _contig("sin_signed", sin_signed, dt)
        q = qkv.new_empty((t, num_q_heads, d))
        k = qkv.new_empty((t, num_kv_heads, d))
        self._rope(
            qkv.data_ptr(), qkv.stride(0), c.data_ptr(), s.data_ptr(), t, num_q_heads,
            num_kv_heads, d, q.data_ptr(), k.data_ptr(),
        )  # fmt: skip
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.silu_mul``. bfloat16: ``bf16(bf16(silu(g)) * u)`` (the
        roundings of ``F.silu(g) * u`` on bf16 tensors)."""
        gu = _contig("gate_up", gate_up, self.dtype)
        if gu.dim() != 2 or gu.shape[1] % 2:
            raise ShapeError(f"gate_up: expected [rows, 2 * i], got {list(gu.shape)}")
        i = gu.shape[1] // 2
        out = gu.new_empty((gu.shape[0], i))
        self._silu(gu.data_ptr(), gu.shape[0], i, out.data_ptr())
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """See ``GreedyOps.argmax_rows``: ``[rows]`` int64, the first maximum of each row
        of ``logits`` ``[rows, n]`` (the first NaN of a row that has one; an all
        ``-inf`` row gives 0), ``torch.argmax``'s answer, without a float32 copy of
        bf16 logits (the cast is exact, so it cannot change the answer)."""
        _check("logits", logits, self.dtype)
        if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
            raise ShapeError(
                f"logits: expected [rows, n > 0] with unit column stride, got "
                f"{list(logits.shape)} strides {list(logits.stride())}"
            )
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._lib.kvp_argmax_rows(
            logits.data_ptr(), int(self.dtype == torch.bfloat16), logits.shape[0],
            logits.shape[1], logits.stride(0), out.data_ptr(),
        )  # fmt: skip
        return out


__all__ = ["DTYPES", "NativeLayerOps"]
