"""Rotary position embedding (RoPE): the inverse frequencies (plain, ``linear`` and
``llama3`` scaling), the cos/sin tables and the rotation of queries and keys.

Source: RoPE (Su et al., 2021, "RoFormer"), in HF's rotate-half layout (dimension ``j``
pairs with ``j + head_dim/2``) with
``inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)``.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 of RoPE.

    Plain: ``1 / theta ** (2j / head_dim)`` (RoFormer). ``linear``: divided by
    ``factor`` (position interpolation, Chen et al., 2023). ``llama3`` (Meta's Llama 3.1
    reference code): wavelengths ``2*pi/f`` shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept, longer than
    ``original / low_freq_factor`` divided by ``factor``, and in between blended with
    ``s = (original / wavelen - low) / (high - low)``: ``(1 - s) * f / factor + s * f``.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    out = torch.where(wavelen > old / low, inv / factor, inv)
    mid = (wavelen <= old / low) & (wavelen >= old / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables of RoPE, grown on demand, float32 like HF.

    Args:
        head_dim: rotated dimensions per head (even).
        theta: base.
        max_positions: initial table length.
        scaling: optional ``linear`` / ``llama3`` parameters (see ``rope_inv_freq``).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int = 2048,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        inv = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        #: ``sin_table`` with its first half negated (see :func:`apply_rope_qkv`)
        self.register_buffer("sin_signed_table", torch.empty(0), persistent=False)
        self._build(max_positions)

    def _build(self, n: int) -> None:
        inv = cast(torch.Tensor, self.inv_freq)
        pos = torch.arange(n, device=inv.device).float()
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos()
        self.sin_table = emb.sin()
        half = freqs.shape[-1]
        self.sin_signed_table = torch.cat((-self.sin_table[:, :half], self.sin_table[:, half:]), -1)

    def forward(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        max_position: int | None = None,
        signed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables at ``positions``.

        Args:
            positions: ``[num_tokens]`` int64.
            dtype: dtype of the returned tables.
            max_position: an upper bound of ``positions`` known on the host (e.g. the
                step's ``max_seq_len - 1``), so that no device sync is needed; default
                ``positions.max()``.
            signed: return the sine with its first half negated (the table
                :func:`apply_rope_qkv` takes) instead of the plain sine.

        Returns:
            cos, sin: ``[num_tokens, 1, head_dim]``.
        """
        if positions.numel():
            top = int(positions.max()) if max_position is None else max_position
            if top >= self.cos_table.shape[0]:
                self._build(max(2 * self.cos_table.shape[0], top + 1))
        cos = self.cos_table[positions].to(dtype)[:, None, :]
        sin_t = self.sin_signed_table if signed else self.sin_table
        sin = sin_t[positions].to(dtype)[:, None, :]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves: ``x * cos + rotate_half(x) * sin``; x ``[num_tokens, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` of the query and the key in one call (HF's
    ``apply_rotary_pos_emb(q, k, cos, sin)``): q ``[num_tokens, num_q_heads, head_dim]``,
    k ``[num_tokens, num_kv_heads, head_dim]`` -> new tensors of the same shapes."""
    half = q.shape[-1] // 2
    rq = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    rk = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return q * cos + rq * sin, k * cos + rk * sin


def apply_rope_qkv(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope_qk` of the query and key columns of a fused q/k/v projection,
    in 6 tensor ops instead of 10, bit-identical to it.

    The halves of q and k are swapped by one ``cat`` over both, and the sign of
    ``rotate_half`` is carried by the table: ``rotate_half(x) * sin ==
    cat(x2, x1) * cat(-s, s)`` elementwise (negation is exact), so ``q * cos +
    swapped * sin_signed`` rounds exactly as :func:`apply_rope` does.

    Args:
        qkv: ``[num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]`` (q, k, v
            columns in that order; only q and k are read; not mutated).
        num_q_heads, num_kv_heads: head counts.
        cos: ``[num_tokens, 1, head_dim]``.
        sin_signed: ``[num_tokens, 1, head_dim]`` sine with its first half negated
            (``RotaryEmbedding(..., signed=True)``).

    Returns:
        q ``[num_tokens, num_q_heads, head_dim]`` and k ``[num_tokens, num_kv_heads,
        head_dim]``, new contiguous tensors.
    """
    t, d = qkv.shape[0], cos.shape[-1]
    half = d // 2
    qk = qkv[:, : (num_q_heads + num_kv_heads) * d].view(t, num_q_heads + num_kv_heads, d)
    rot = torch.cat((qk[..., half:], qk[..., :half]), dim=-1).mul_(sin_signed)
    q = qk[:, :num_q_heads] * cos
    k = qk[:, num_q_heads:] * cos
    return q.add_(rot[:, :num_q_heads]), k.add_(rot[:, num_q_heads:])


__all__ = ["RotaryEmbedding", "apply_rope", "apply_rope_qk", "apply_rope_qkv", "rope_inv_freq"]
