"""Building blocks of the decoder: RMSNorm, GLU MLP and the paged attention layer; the
oneDNN-prepacked and fused linears are in :mod:`kvpage.models.linears` and the rotary
embedding in :mod:`kvpage.models.rope` (both re-exported here; change the linears'
settings such as ``PACK_LINEARS`` on ``kvpage.models.linears``, where they are read). Parameter names equal Hugging Face's so a
HF state dict loads as is.

Sources: RMSNorm (Zhang & Sennrich, 2019; HF ``LlamaRMSNorm``, Gemma's ``1 + w``
variant ``Gemma2RMSNorm``); SwiGLU / GeGLU MLP (Shazeer, 2020).
"""

from __future__ import annotations

from typing import Any

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
from kvpage.models.mla import MLAAttention
from kvpage.models.moe import MoEMLP
from kvpage.models.rope import (
    RotaryEmbedding,
    apply_rope,
    apply_rope_partial,
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
        backend's ``LayerOps``, used for the Llama form when ``x`` has the weight's
        dtype (None = torch ops)."""
        if ops is not None and not self.gemma and x.dtype == self.weight.dtype:
            return ops.rms_norm(x, self.weight, self.eps)[1]
        xf = x.float()
        if self.gemma:
            normed = F.rms_norm(xf, (xf.shape[-1],), None, self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused op
        # LlamaRMSNorm: normalise in float32, round to the input dtype, then scale; one
        # fused F.rms_norm instead of pow/mean/add/rsqrt/mul (the same formula)
        normed = F.rms_norm(xf, (xf.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, ops: LayerOps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before the norm: ``(s, norm(s))`` with ``s = residual + x``
        (both ``[num_tokens, dim]``); one ``ops.rms_norm`` call for the Llama form
        when both have the weight's dtype."""
        if ops is not None and not self.gemma and x.dtype == residual.dtype == self.weight.dtype:
            return ops.rms_norm(x, self.weight, self.eps, residual=residual)
        s = residual + x
        return s, self(s)


class LayerNorm(nn.Module):
    """``y = (x - mean) / sqrt(var + eps) * w (+ b)`` over the last dimension, computed
    in float32 (``nn.LayerNorm`` of StarCoder2 / GPT-2; ``CohereLayerNorm``: no bias).

    Args:
        dim: hidden size.
        eps: epsilon inside the square root.
        bias: carry a bias (Cohere: no).
    """

    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """x: ``[num_tokens, dim]``; returns the same shape and dtype (``ops`` unused)."""
        b = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), b, self.eps)
        return y.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, ops: LayerOps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, norm(s))`` with ``s = residual + x``."""
        s = residual + x
        return s, self(s)


class HeadLayerNorm(nn.Module):
    """LayerNorm without bias of each head's vector, with one weight row per head
    (``CohereLayerNorm(hidden_size=(num_heads, head_dim))``, Cohere's q/k norm).

    Args:
        heads, dim: the weight's shape ``[heads, dim]``.
        eps: epsilon.
    """

    def __init__(self, heads: int, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, heads, dim]`` -> the same shape and dtype."""
        y = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps)
        return (y * self.weight.float()).to(x.dtype)


Norm = RMSNorm | LayerNorm


def make_norm(arch: ArchConfig, dim: int) -> Norm:
    """The family's norm of width ``dim`` (``arch.family.norm``)."""
    kind = arch.family.norm
    if kind.startswith("layernorm"):
        return LayerNorm(dim, arch.rms_norm_eps, bias=kind == "layernorm")
    return RMSNorm(dim, arch.rms_norm_eps, gemma=kind == "rms_gemma")


class MLP(nn.Module):
    """The dense MLP of ``arch.family.mlp``: ``glu`` ``down(act(gate(x)) * up(x))``
    (gate and up as one fused matmul), ``fused_glu`` the same from one
    ``gate_up_proj`` (gate rows first: Phi-3, GLM-4), ``plain`` ``down(act(up(x)))``
    (StarCoder2 / GPT-2 ``c_fc`` / ``c_proj``). ``intermediate_size`` / ``kind``
    override the arch's (Granite-4 hybrid's ``shared_mlp``: ``fused_glu`` of
    ``shared_intermediate_size``). Activations: SiLU, GELU (tanh or erf), ``relu2``
    (``relu(x) ** 2``, Nemotron-H)."""

    def __init__(
        self, arch: ArchConfig, intermediate_size: int | None = None, kind: str | None = None
    ) -> None:
        super().__init__()
        h, b = arch.hidden_size, arch.mlp_bias
        i = arch.intermediate_size if intermediate_size is None else intermediate_size
        self.kind = kind or (arch.family.mlp if arch.family.mlp != "moe" else "glu")
        self.gate_up_proj: nn.Linear | None = None
        if self.kind == "glu":
            self.gate_proj = nn.Linear(h, i, bias=b)
            self.up_proj = nn.Linear(h, i, bias=b)
            self._gate_up = FusedLinear([self.gate_proj, self.up_proj])
        elif self.kind == "fused_glu":
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=b)
            self._gate_up = FusedLinear([self.gate_up_proj])
        else:
            self.up_proj = nn.Linear(h, i, bias=b)
            self._gate_up = FusedLinear([self.up_proj])
        self.down_proj = nn.Linear(i, h, bias=b)
        self.activation = arch.activation
        self.intermediate_size = i
        self._down = PackedWeight()
        #: ``(gate, down)`` scales: ``down(act(gate x * g) * up x) * d`` (Falcon-H1
        #: ``mlp_multipliers``), None = none
        self.multipliers: tuple[float, float] | None = None

    def _act(self, g: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return F.silu(g)
        if self.activation == "gelu_tanh":
            return F.gelu(g, approximate="tanh")
        if self.activation == "relu2":
            return torch.square(F.relu(g))
        return F.gelu(g)

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> same; ``ops``: a backend's ``LayerOps``
        for SiLU·mul (None = torch ops)."""
        gu = self._gate_up(x)
        d = self.down_proj
        if self.kind == "plain":
            return self._down(self._act(gu), d.weight, d.bias)
        i = self.intermediate_size
        if self.multipliers is not None:
            gm, dm = self.multipliers
            h = self._act(gu[:, :i] * gm) * gu[:, i:]
            return self._down(h, d.weight, d.bias) * dm
        if ops is not None and self.activation == "silu":
            return self._down(ops.silu_mul(gu), d.weight, d.bias)
        g, u = gu[:, :i], gu[:, i:]
        return self._down(self._act(g).mul_(u), d.weight, d.bias)


class PagedAttention(nn.Module):
    """Self-attention of one layer on the paged KV cache.

    Args:
        arch: the model architecture (``arch.family``: fused q/k/v, q/k norm kind,
            RoPE layout).
        spec: this layer's AttentionSpec (scale, window, soft cap, sinks), from
            ``CacheSpec.from_hf_config``.
    """

    def __init__(self, arch: ArchConfig, spec: AttentionSpec) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        hq, hk = arch.num_q_heads, arch.num_kv_heads
        fam = arch.family
        self.num_q_heads, self.num_kv_heads, self.head_dim = hq, hk, d
        self.gate = False
        if fam.fused_qkv:  # Phi3Attention.qkv_proj / GPT-2 c_attn: q, k, v rows
            self.qkv_proj = nn.Linear(h, (hq + 2 * hk) * d, bias=arch.qkv_bias)
            self._qkv = FusedLinear([self.qkv_proj])
        else:  # Qwen3-Next: q_proj rows per head = query then output gate
            self.gate = fam.attn_output_gate
            self.q_proj = nn.Linear(h, hq * d * (2 if self.gate else 1), bias=arch.qkv_bias)
            self.k_proj = nn.Linear(h, hk * d, bias=arch.qkv_bias)
            self.v_proj = nn.Linear(h, hk * d, bias=arch.qkv_bias)
            self._qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = nn.Linear(hq * d, h, bias=arch.o_bias)
        self.spec = spec
        self._splits = (hq * d, hk * d, hk * d)
        self._o = PackedWeight()
        self.qk_norm = fam.qk_norm if arch.qk_norm else ""
        self.q_norm: nn.Module
        self.k_norm: nn.Module
        if self.qk_norm == "head":  # Qwen3 / Gemma-3 q_norm, k_norm over head_dim
            gemma = fam.norm == "rms_gemma"
            self.q_norm = RMSNorm(d, arch.rms_norm_eps, gemma)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps, gemma)
        elif self.qk_norm == "full":  # Olmo2Attention: over the whole projection
            self.q_norm = RMSNorm(hq * d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(hk * d, arch.rms_norm_eps)
        elif self.qk_norm == "head_ln":  # CohereAttention: [heads, head_dim] weights
            self.q_norm = HeadLayerNorm(hq, d, arch.rms_norm_eps)
            self.k_norm = HeadLayerNorm(hk, d, arch.rms_norm_eps)
        self.rope = not fam.learned_positions and arch.use_rope
        self.interleaved = fam.rope_interleaved
        # the fused rotate-half path (backend LayerOps or apply_rope_qkv) applies when
        # nothing comes between the projection and a full-width rotate-half RoPE
        self._plain_rope = (
            self.rope and not self.qk_norm and not self.interleaved and arch.rotary_dim == d
        )
        #: k is scaled by this before RoPE (Falcon-H1 ``key_multiplier``), None = not
        self.key_multiplier: float | None = None
        if spec.sinks:  # GptOssAttention.sinks: one logit per query head
            self.sinks = nn.Parameter(torch.zeros(hq))

    def _q_k(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[t, hq, d]``, k ``[t, hk, d]`` normed (the family's q/k norm) and rotated
        (partial / interleaved RoPE, none with learned positions)."""
        t = qkv.shape[0]
        hq, hk, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(t * hq, d)).view(t, hq, d)
            k = self.k_norm(k.reshape(t * hk, d)).view(t, hk, d)
        else:
            q, k = q.reshape(t, hq, d), k.reshape(t, hk, d)
        if self.qk_norm == "head_ln":
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.rope or cos is None or sin is None:
            return q.contiguous(), k.contiguous()
        return (
            apply_rope_partial(q, cos, sin, self.interleaved),
            apply_rope_partial(k, cos, sin, self.interleaved),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: KVCache,
        plan: StepPlan,
        backend: AttentionBackend[Any],
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """Project, rotate, write this step's K/V into ``cache`` and attend.

        Args:
            x: ``[num_tokens, hidden_size]`` normalised hidden states.
            cos, sin: ``[num_tokens, 1, rotary_dim]`` RoPE tables at each token's
                position (``sin`` with its first half negated: ``RotaryEmbedding(...,
                signed=True)``, see ``apply_rope_qkv``); None with learned positions.
            cache: the layer's cache; mutated at ``plan.meta.slot_mapping``.
            plan: the backend's plan of this layer's KV group for the step.
            backend: the attention backend.
            ops: the backend's ``LayerOps`` for RoPE (None = ``apply_rope_qkv``).

        Returns:
            ``[num_tokens, hidden_size]``.
        """
        t = x.shape[0]
        qkv = self._qkv(x)
        gate = None
        if self.gate:  # [t, hq, 2d] per head: query, gate (Qwen3NextAttention)
            hq, d = self.num_q_heads, self.head_dim
            qg = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
            gate = qg[:, :, d:].reshape(t, hq * d)
            qkv = torch.cat([qg[:, :, :d].reshape(t, hq * d), qkv[:, 2 * hq * d :]], dim=1)
        b = self._splits[0] + self._splits[1]
        if self.key_multiplier is not None:
            a0 = self._splits[0]
            qkv = torch.cat([qkv[:, :a0], qkv[:, a0:b] * self.key_multiplier, qkv[:, b:]], dim=1)
        v = qkv[:, b:].view(t, self.num_kv_heads, self.head_dim)
        if not self._plain_rope or cos is None or sin is None:
            q, k = self._q_k(qkv, cos, sin)
        elif ops is not None:
            q, k = ops.rope_qk(qkv, self.num_q_heads, self.num_kv_heads, cos, sin)
        else:
            q, k = apply_rope_qkv(qkv, self.num_q_heads, self.num_kv_heads, cos, sin)
        backend.write_kv(k, v, cache, plan.meta.slot_mapping, plan=plan)
        if self.spec.sinks:  # float32 for the kernels (a copy only for other dtypes)
            o = backend.forward(q, cache, plan, self.spec, sinks=self.sinks.float())
        else:
            o = backend.forward(q, cache, plan, self.spec)
        o = o.reshape(t, self.num_q_heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self._o(o, self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    """One residual block in the family's layout (``arch.family.block``):

    * ``pre``: ``x += attn(input_layernorm(x))``; ``x += mlp(post_attention_layernorm(x))``
      (Granite: each output times ``residual_multiplier`` first);
    * ``sandwich`` (Gemma-2/3, GLM-4): ``x += post_attention_layernorm(attn(
      input_layernorm(x)))``; ``x += post_feedforward_layernorm(mlp(
      pre_feedforward_layernorm(x)))``;
    * ``post`` (OLMo-2): ``x += post_attention_layernorm(attn(x))``;
      ``x += post_feedforward_layernorm(mlp(x))``;
    * ``parallel`` (Cohere): ``h = input_layernorm(x)``; ``x + attn(h) + mlp(h)``.

    The MLP is a mixture of experts (``kvpage.models.moe.MoEMLP``) on the MoE layers of
    ``arch.moe``.
    """

    def __init__(self, arch: ArchConfig, spec: AttentionSpec, layer_id: int = 0) -> None:
        super().__init__()
        h = arch.hidden_size
        self.block = arch.family.block
        self.self_attn: PagedAttention | MLAAttention
        if spec.is_mla:  # DeepSeek-V3: the latent cache (kvpage.models.mla)
            self.self_attn = MLAAttention(arch, spec, RMSNorm)
        else:
            self.self_attn = PagedAttention(arch, spec)
        self.mlp: MLP | MoEMLP
        if arch.moe is not None and layer_id in arch.moe.sparse_layers:
            self.mlp = MoEMLP(h, arch.moe)
        else:
            self.mlp = MLP(arch)
        if self.block != "post":
            self.input_layernorm = make_norm(arch, h)
        if self.block != "parallel":
            self.post_attention_layernorm = make_norm(arch, h)
        if self.block == "sandwich":
            self.pre_feedforward_layernorm = make_norm(arch, h)
        if self.block in ("sandwich", "post"):
            self.post_feedforward_layernorm = make_norm(arch, h)
        self.residual_multiplier = arch.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: KVCache,
        plan: StepPlan,
        backend: AttentionBackend[Any],
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """x: ``[num_tokens, hidden_size]`` -> same; mutates ``cache`` (see PagedAttention).
        ``ops``: a backend's ``LayerOps``, handed to every part (None = torch ops)."""
        attn = self.self_attn
        if self.block == "post":
            x = x + self.post_attention_layernorm(attn(x, cos, sin, cache, plan, backend, ops))
            y: torch.Tensor = x + self.post_feedforward_layernorm(self.mlp(x, ops))
            return y
        h = self.input_layernorm(x, ops)
        a = attn(h, cos, sin, cache, plan, backend, ops)
        if self.block == "parallel":
            par: torch.Tensor = x + a + self.mlp(h, ops)
            return par
        if self.block == "sandwich":
            x = x + self.post_attention_layernorm(a, ops)
            m = self.mlp(self.pre_feedforward_layernorm(x, ops), ops)
            sandwich: torch.Tensor = x + self.post_feedforward_layernorm(m, ops)
            return sandwich
        rm = self.residual_multiplier
        if rm is not None:
            a = a * rm
        x, h = self.post_attention_layernorm.add_forward(a, x, ops)
        mo: torch.Tensor = self.mlp(h, ops)
        return x + (mo * rm if rm is not None else mo)

    @property
    def defers_residual(self) -> bool:
        """Whether :meth:`forward_deferred` applies: the ``pre`` block without a
        residual multiplier and with Llama RMSNorms (the backend's fused add + norm)."""
        return (
            self.block == "pre"
            and self.residual_multiplier is None
            and isinstance(self.input_layernorm, RMSNorm)
            and isinstance(self.post_attention_layernorm, RMSNorm)
            and not self.input_layernorm.gemma
            and not self.post_attention_layernorm.gemma
        )

    def forward_deferred(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: KVCache,
        plan: StepPlan,
        backend: AttentionBackend[Any],
        ops: LayerOps | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` of a :attr:`defers_residual` layer with its last residual
        add left to the next norm (vLLM's ``fused_add_rms_norm`` chain): the layer's
        output is ``x + pending`` (``pending`` = the previous layer's MLP output, None
        for the first layer) and this returns ``(x', mlp_out)``, whose sum is this
        layer's output. The input norm adds ``pending`` in one ``ops.rms_norm`` call
        (``s = x + pending``, the same rounding as :meth:`forward`'s add), so a stack of
        layers makes one add fewer per layer; results equal :meth:`forward`'s."""
        if pending is None:
            h = self.input_layernorm(x, ops)
        else:
            x, h = self.input_layernorm.add_forward(pending, x, ops)
        a = self.self_attn(h, cos, sin, cache, plan, backend, ops)
        x, h = self.post_attention_layernorm.add_forward(a, x, ops)
        mo: torch.Tensor = self.mlp(h, ops)
        return x, mo


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
    "LayerNorm",
    "HeadLayerNorm",
    "make_norm",
    "RotaryEmbedding",
    "NEVER_PACK",
    "apply_rope",
    "apply_rope_qk",
    "apply_rope_qkv",
    "pack_min_rows",
]
