"""Rotary position embedding (RoPE): the inverse frequencies (plain, ``linear``,
``llama3``, ``dynamic``, ``yarn``, ``longrope``), the cos/sin tables and the rotation of
queries and keys (rotate-half or interleaved pairs, all or the first ``rotary_dim``
dimensions of each head).

Source: RoPE (Su et al., 2021, "RoFormer"), in HF's rotate-half layout (dimension ``j``
pairs with ``j + head_dim/2``) with
``inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)``.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from kvpage.specs.hf import yarn_mscale

#: RoPE variants implemented (HF ``rope_type`` names)
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
#: the variants whose frequencies depend on the position (see :class:`RotaryEmbedding`)
_POSITION_DEPENDENT = ("dynamic", "longrope")


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 of RoPE (:func:`rope_frequencies`
    without the attention factor)."""
    return rope_frequencies(head_dim, theta, scaling, seq_len)[0]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return yarn_mscale(scale, mscale)  # kvpage.specs.hf: the one formula


def rope_frequencies(
    dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim // 2]`` float32 and the attention factor (the factor
    cos and sin are multiplied by) of one RoPE variant, each with transformers'
    formula (``transformers.modeling_rope_utils``, 5.23).

    Args:
        dim: rotated dimensions per head (``head_dim * partial_rotary_factor``, even).
        theta: base.
        scaling: None (plain RoPE) or a dict with ``rope_type`` and its parameters (as
            in ``config.rope_parameters``; ``max_position_embeddings`` added for
            ``dynamic``, ``original_max_position_embeddings`` filled in by the config
            reader).
        seq_len: the sequence length the frequencies are for (``dynamic``:
            ``max(seq_len, max_position_embeddings)`` enters the base; ``longrope``:
            ``long_factor`` when ``seq_len > original_max_position_embeddings``, else
            ``short_factor``); None for the others.

    Formulas:
        * plain (``_compute_default_rope_parameters``): ``1 / theta ** (2j / dim)``
          (RoFormer, Su et al. 2021).
        * ``linear`` (``_compute_linear_scaling_rope_parameters``): divided by
          ``factor`` (position interpolation, Chen et al. 2023).
        * ``llama3`` (``_compute_llama3_parameters``): wavelengths ``2 pi / f`` below
          ``original / high_freq_factor`` kept, above ``original / low_freq_factor``
          divided by ``factor``, blended in between with
          ``s = (original / wavelen - low) / (high - low)``.
        * ``dynamic`` (``_compute_dynamic_ntk_parameters``): base
          ``theta * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2))`` with
          ``L = max(seq_len, max_pos)``.
        * ``yarn`` (``_compute_yarn_parameters``, Peng et al. 2023): interpolated
          ``1 / (factor * theta ** (2j / dim))`` and extrapolated frequencies blended by
          a linear ramp over the correction range of ``beta_fast`` / ``beta_slow``
          rotations (floored / ceiled unless ``truncate`` is false); attention factor
          ``attention_factor`` or ``0.1 ln(factor) + 1`` (``mscale`` /
          ``mscale_all_dim`` ratio when both are given).
        * ``longrope`` (``_compute_longrope_parameters``): ``1 / (ext * theta **
          (2j / dim))`` with ``ext`` the ``short_factor`` or ``long_factor`` list;
          attention factor ``attention_factor`` or ``sqrt(1 + ln(factor) /
          ln(original))`` (1 when ``factor <= 1``).
    """
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (theta**exps)
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return inv, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        out = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out), 1.0
    if kind == "dynamic":
        factor = float(scaling["factor"])
        max_pos = int(scaling["max_position_embeddings"])
        length = max(seq_len or max_pos, max_pos)
        base = theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exps), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, exps)
    if kind == "longrope":
        old = int(scaling["original_max_position_embeddings"])
        raw = scaling.get("factor")
        factor = float(raw) if raw is not None else int(scaling["max_position_embeddings"]) / old
        att = scaling.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        long = seq_len is not None and seq_len > old
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta**exps), float(att)
    raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, got {kind!r}")


def _yarn(
    dim: int, theta: float, sc: dict[str, Any], exps: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """``_compute_yarn_parameters`` (see :func:`rope_frequencies`)."""
    old = float(sc["original_max_position_embeddings"])
    factor = sc.get("factor")
    if factor is None:
        factor = float(sc["max_position_embeddings"]) / old
    factor = float(factor)
    att = sc.get("attention_factor")
    if att is None:
        ms, ms_all = sc.get("mscale"), sc.get("mscale_all_dim")
        if ms and ms_all:
            att = _yarn_mscale(factor, float(ms)) / _yarn_mscale(factor, float(ms_all))
        else:
            att = _yarn_mscale(factor)
    beta_fast = float(sc.get("beta_fast") or 32)
    beta_slow = float(sc.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta**exps
    extra = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(att)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables of RoPE, grown on demand, float32 like HF, multiplied by the
    variant's attention factor (yarn, longrope) as transformers does.

    ``dynamic`` and ``longrope`` frequencies depend on the sequence length in
    transformers (``dynamic_rope_update`` re-derives them from the largest position of
    each forward). A paged cache keeps keys rotated when they were written, so here
    the row of position ``p`` uses the frequencies for ``seq_len = p + 1``: equal to
    transformers for every sequence up to ``max_position_embeddings`` (dynamic) /
    ``original_max_position_embeddings`` (longrope), and to its one-token-at-a-time
    decode beyond (a longer prefill in transformers rotates all its positions with
    the frequencies of its full length instead).

    Args:
        head_dim: dimensions per head.
        theta: base.
        max_positions: initial table length.
        scaling: optional variant parameters (see :func:`rope_frequencies`).
        rotary_dim: rotated dimensions (``head_dim * partial_rotary_factor``; default
            ``head_dim``); the tables are ``rotary_dim`` wide.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int = 2048,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.theta = theta
        self.scaling = scaling
        inv, att = rope_frequencies(self.rotary_dim, theta, scaling)
        self.attention_factor = att
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        #: ``sin_table`` with its first half negated (see :func:`apply_rope_qkv`)
        self.register_buffer("sin_signed_table", torch.empty(0), persistent=False)
        self._build(max_positions)

    def _freqs(self, n: int) -> torch.Tensor:
        """``[n, rotary_dim // 2]`` angles of positions ``0..n-1``."""
        inv = cast(torch.Tensor, self.inv_freq)
        pos = torch.arange(n, device=inv.device).float()
        kind = (self.scaling or {}).get("rope_type", "default")
        if kind not in _POSITION_DEPENDENT:
            return pos[:, None] * inv[None, :]
        sc = cast(dict[str, Any], self.scaling)
        key = "max_position_embeddings" if kind == "dynamic" else "original_max_position_embeddings"
        edge = int(sc[key])  # positions below it use the seq_len-free frequencies
        rows = [pos[: min(n, edge), None] * inv[None, :]]
        if kind == "longrope" and n > edge:  # one set for every longer length
            long = rope_frequencies(self.rotary_dim, self.theta, sc, edge + 1)[0].to(inv.device)
            rows.append(pos[edge:, None] * long[None, :])
        elif n > edge:  # dynamic: the base grows with the length (rope_frequencies'
            # formula for seq_len = p + 1, all rows at once)
            d, factor = self.rotary_dim, float(sc["factor"])
            length = torch.arange(edge + 1, n + 1, dtype=torch.float64)
            base = self.theta * ((factor * length / edge) - (factor - 1)) ** (d / (d - 2))
            exps = torch.arange(0, d, 2, dtype=torch.int64).float() / d
            f = 1.0 / (base.float()[:, None] ** exps[None, :])
            rows.append(pos[edge:, None] * f.to(inv.device))
        return torch.cat(rows)

    def _build(self, n: int) -> None:
        freqs = self._freqs(n)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos()
        self.sin_table = emb.sin()
        if self.attention_factor != 1.0:
            self.cos_table = self.cos_table * self.attention_factor
            self.sin_table = self.sin_table * self.attention_factor
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
            cos, sin: ``[num_tokens, 1, rotary_dim]``.
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


def apply_rope_partial(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """RoPE of the first ``rotary_dim = cos.shape[-1]`` dimensions of each head, the
    rest passed through (transformers' ``apply_rotary_pos_emb`` of Phi-3 / GLM-4 /
    Cohere with ``partial_rotary_factor``).

    Interleaved RoPE (GLM-4 and Cohere's ``rotate_half``: pairs ``(2i, 2i + 1)`` turn by
    frequency ``i``) is computed as rotate-half RoPE of the de-interleaved dimensions
    ``(0, 2, 4, ..., 1, 3, 5, ...)``: the result is the true rotated vector with its
    rotated dimensions permuted the same way for queries and keys, so every ``q . k``
    (all attention reads of them) is unchanged while the cache stores the permuted keys.

    Args:
        x: ``[num_tokens, heads, head_dim]`` (not mutated).
        cos, sin_signed: ``[num_tokens, 1, rotary_dim]`` (``RotaryEmbedding(...,
            signed=True)``).
        interleaved: the family pairs neighbouring dimensions.

    Returns:
        A new ``[num_tokens, heads, head_dim]`` tensor.
    """
    r = cos.shape[-1]
    half = r // 2
    xr = x[..., :r]
    if interleaved:
        xr = torch.cat((xr[..., 0::2], xr[..., 1::2]), dim=-1)
    rot = torch.cat((xr[..., half:], xr[..., :half]), dim=-1) * sin_signed
    out = xr * cos + rot
    if r == x.shape[-1]:
        return out
    return torch.cat((out, x[..., r:]), dim=-1)


__all__ = [
    "ROPE_TYPES",
    "RotaryEmbedding",
    "apply_rope",
    "apply_rope_partial",
    "apply_rope_qk",
    "apply_rope_qkv",
    "rope_frequencies",
    "rope_inv_freq",
]
