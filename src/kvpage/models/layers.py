"""Building blocks of the decoder: RMSNorm, GLU MLP and the paged attention layer; the
oneDNN-prepacked and fused linears are in :mod:`kvpage.models.linears` and the rotary
embedding in :mod:`kvpage.models.rope` (both re-exported here; change the linears'
settings such as ``PACK_LINEARS`` on ``kvpage.models.linears``, where they are read). Parameter names equal Hugging Face's so a
HF state dict loads as is.

Sources: RMSNorm (Zhang & Sennrich, 2019; HF ``LlamaRMSNorm``, Gemma's ``1 + w``
variant ``Gemma2RMSNorm``); SwiGLU / GeGLU MLP (Shazeer, 2020).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention.metadata import KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import AttentionBackend, LayerOps
from kvpage.models.config import ArchConfig
from kvpage.models.linears import (
    NEVER_PACK,
    PACK_LINEARS,
    PACK_MIN_MACS,
    PACK_MIN_WEIGHT,
    FusedLinear,
    PackedWeight,
    pack_min_rows,
)
from kvpage.models.moe import MoEMLP
from kvpage.models.rope import (
    RotaryEmbedding,
    apply_rope,
    apply_rope_qk,
    apply_rope_qkv,
    rope_inv_freq,
)
from kvpage.specs import AttentionSpec


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x**2) + eps) * w`` (Llama) or ``* (1 + w)`` computed in
    float32 (Gemma).

    Args:
        dim: hidden size.
        eps: epsilon inside the square root.
        gemma: use the Gemma ``1 + w`` form (weights initialised to 0 then).
    """

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """x: ``[num_tokens, dim]``; returns the same shape and dtype. ``ops``: a
        backend's ``LayerOps``, used for the Llama form (None = torch ops)."""
        if ops is not None and not self.gemma:
            return ops.rms_norm(x, self.weight, self.eps)[1]
        xf = x.float()
        if self.gemma:
            normed = F.rms_norm(xf, (xf.shape[-1],), None, self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused op
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, ops: LayerOps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before the norm: ``(s, norm(s))`` with ``s = residual + x``
        (both ``[num_tokens, dim]``); one ``ops.rms_norm`` call for the Llama form."""
        if ops is not None and not self.gemma:
            return ops.rms_norm(x, self.weight, self.eps, residual=residual)
        s = residual + x
        return s, self(s)


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; gate and up run as one fused matmul."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        h, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.activation = arch.activation
        self.intermediate_size = i
        self._gate_up = FusedLinear([self.gate_proj, self.up_proj])
        self._down = PackedWeight()

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> same; ``ops``: a backend's ``LayerOps``
        for SiLU·mul (None = torch ops)."""
        gu = self._gate_up(x)
        d = self.down_proj
        if ops is not None and self.activation == "silu":
            return self._down(ops.silu_mul(gu), d.weight, d.bias)
        i = self.intermediate_size
        g, u = gu[:, :i], gu[:, i:]
        if self.activation == "silu":
            g = F.silu(g)
        elif self.activation == "gelu_tanh":
            g = F.gelu(g, approximate="tanh")
        else:
            g = F.gelu(g)
        return self._down(g.mul_(u), d.weight, d.bias)


class PagedAttention(nn.Module):
    """Self-attention of one layer on the paged KV cache.

    Args:
        arch: the model architecture.
        spec: this layer's AttentionSpec (scale, window, soft cap), from
            ``CacheSpec.from_hf_config``.
    """

    def __init__(self, arch: ArchConfig, spec: AttentionSpec) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_q_heads, self.num_kv_heads, self.head_dim = arch.num_q_heads, arch.num_kv_heads, d
        self.q_proj = nn.Linear(h, arch.num_q_heads * d, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.num_q_heads * d, h, bias=arch.o_bias)
        self.spec = spec
        self._qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        self._splits = (arch.num_q_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d)
        self._o = PackedWeight()
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:  # Qwen3MoeAttention.q_norm / k_norm: RMSNorm over head_dim
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        if spec.sinks:  # GptOssAttention.sinks: one logit per query head
            self.sinks = nn.Parameter(torch.zeros(arch.num_q_heads))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        plan: StepPlan,
        backend: AttentionBackend,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """Project, rotate, write this step's K/V into ``cache`` and attend.

        Args:
            x: ``[num_tokens, hidden_size]`` normalised hidden states.
            cos, sin: ``[num_tokens, 1, head_dim]`` RoPE tables at each token's position
                (``sin`` with its first half negated: ``RotaryEmbedding(...,
                signed=True)``, see ``apply_rope_qkv``).
            cache: the layer's cache; mutated at ``plan.meta.slot_mapping``.
            plan: the backend's plan of this layer's KV group for the step.
            backend: the attention backend.
            ops: the backend's ``LayerOps`` for RoPE (None = ``apply_rope_qkv``).

        Returns:
            ``[num_tokens, hidden_size]``.
        """
        t = x.shape[0]
        qkv = self._qkv(x)
        b = self._splits[0] + self._splits[1]
        v = qkv[:, b:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per-head RMSNorm of q and k, then RoPE (HF order)
            hq, hk, d = self.num_q_heads, self.num_kv_heads, self.head_dim
            qn = self.q_norm(qkv[:, : hq * d].reshape(t * hq, d)).view(t, hq * d)
            kn = self.k_norm(qkv[:, hq * d : b].reshape(t * hk, d)).view(t, hk * d)
            q, k = apply_rope_qkv(torch.cat([qn, kn], dim=1), hq, hk, cos, sin)
        elif ops is not None:
            q, k = ops.rope_qk(qkv, self.num_q_heads, self.num_kv_heads, cos, sin)
        else:
            q, k = apply_rope_qkv(qkv, self.num_q_heads, self.num_kv_heads, cos, sin)
        backend.write_kv(k, v, cache, plan.meta.slot_mapping)
        if self.spec.sinks:  # float32 for the kernels (a copy only for other dtypes)
            o = backend.forward(q, cache, plan, self.spec, sinks=self.sinks.float())
        else:
            o = backend.forward(q, cache, plan, self.spec)
        o = o.reshape(t, self.num_q_heads * self.head_dim)
        return self._o(o, self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP (Gemma-2 adds post norms); the MLP
    is a mixture of experts (``kvpage.models.moe.MoEMLP``) on the MoE layers of
    ``arch.moe``."""

    def __init__(self, arch: ArchConfig, spec: AttentionSpec, layer_id: int = 0) -> None:
        super().__init__()
        eps, g = arch.rms_norm_eps, arch.gemma_norm
        self.self_attn = PagedAttention(arch, spec)
        self.mlp: MLP | MoEMLP
        if arch.moe is not None and layer_id in arch.moe.sparse_layers:
            self.mlp = MoEMLP(arch.hidden_size, arch.moe)
        else:
            self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, g)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, g)
        self.sandwich = arch.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, g)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, g)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        plan: StepPlan,
        backend: AttentionBackend,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """x: ``[num_tokens, hidden_size]`` -> same; mutates ``cache`` (see PagedAttention).
        ``ops``: a backend's ``LayerOps``, handed to every part (None = torch ops)."""
        a = self.self_attn(self.input_layernorm(x, ops), cos, sin, cache, plan, backend, ops)
        if self.sandwich:
            x = x + self.post_attention_layernorm(a, ops)
            m = self.mlp(self.pre_feedforward_layernorm(x, ops), ops)
            return x + self.post_feedforward_layernorm(m, ops)
        x, h = self.post_attention_layernorm.add_forward(a, x, ops)
        return x + self.mlp(h, ops)


__all__ = [
    "PACK_LINEARS",
    "PACK_MIN_MACS",
    "PACK_MIN_WEIGHT",
    "FusedLinear",
    "PackedWeight",
    "rope_inv_freq",
    "MLP",
    "DecoderLayer",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "NEVER_PACK",
    "apply_rope",
    "apply_rope_qk",
    "apply_rope_qkv",
    "pack_min_rows",
]
