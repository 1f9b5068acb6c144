"""Multi-head latent attention (MLA) of DeepSeek-V2/V3 on the paged latent cache.

Sources: DeepSeek-V2 (arXiv:2405.04434), section 2.1 (eqs. 9-19: low-rank joint
compression of keys and values, decoupled RoPE key) and appendix C (absorbing the
up-projections); transformers 5.23 ``DeepseekV3Attention`` in
transformers/models/deepseek_v3/modeling_deepseek_v3.py, whose parameter names this
module keeps so that a checkpoint loads as is.

Per token ``x`` and head ``h`` (``n`` = qk_nope_head_dim, ``p`` = qk_rope_head_dim,
``r`` = kv_lora_rank, ``v`` = v_head_dim):

* query ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` when
  ``q_lora_rank`` is None), per head ``[q_nope (n), q_pe (p)]``;
* ``kv_a_proj_with_mqa(x) = [c (r), k_pe (p)]``; the latent ``c = kv_a_layernorm(c)``;
  ``q_pe`` and ``k_pe`` rotated by RoPE (DeepSeek's interleaved pairs laid out
  de-interleaved, ``apply_rotary_pos_emb_interleave``, when ``rope_interleave``);
* ``kv_b_proj.weight`` ``[H * (n + v), r]`` holds per head ``W_UK`` ``[n, r]`` and
  ``W_UV`` ``[v, r]``: HF's key is ``[W_UK c, k_pe]`` and its value ``W_UV c``.

What is cached per token is the latent ``[c, k_pe]`` (``r + p`` elements, shared by all
heads; ``AttentionSpec.kv_lora_rank``). Because ``q_nope . (W_UK c) = (W_UK^T q_nope)
. c``, the backend attends with the absorbed query ``[W_UK^T q_nope, q_pe]`` over the
latent (``scale * q_abs . latent``, values = the latent's first ``r`` elements:
``kvpage.attention.reference``), and ``W_UV`` is applied to its ``[H, r]`` output.
Decode and prefill both run in this absorbed form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvpage.attention.metadata import KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import AttentionBackend, LayerOps
from kvpage.errors import SpecError
from kvpage.models.config import ArchConfig
from kvpage.models.rope import apply_rope_partial
from kvpage.specs import AttentionSpec

#: the epsilon of ``q_a_layernorm`` / ``kv_a_layernorm`` (``DeepseekV3RMSNorm``'s
#: default: transformers builds them without the config's ``rms_norm_eps``)
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """One MLA layer (see the module docstring for the formulas).

    Args:
        arch: the model architecture (``arch.mla`` set).
        spec: this layer's AttentionSpec (``kv_lora_rank`` set; scale from
            ``kvpage.specs.hf.mla_softmax_scale``).
        rms_norm: the RMSNorm module class, ``rms_norm(dim, eps)``
            (``kvpage.models.layers.RMSNorm``, passed in: layers imports this module).

    Raises:
        SpecError: ``arch.mla`` missing or disagreeing with ``spec``.
    """

    def __init__(
        self, arch: ArchConfig, spec: AttentionSpec, rms_norm: Callable[[int, float], nn.Module]
    ) -> None:
        super().__init__()
        m = arch.mla
        if m is None or spec.kv_lora_rank != m.kv_lora_rank:
            raise SpecError(
                f"spec.kv_lora_rank: expected the config's kv_lora_rank "
                f"{None if m is None else m.kv_lora_rank}, got {spec.kv_lora_rank}"
            )
        if spec.qk_rope_head_dim != m.qk_rope_head_dim:
            raise SpecError(
                f"spec.qk_rope_head_dim: expected {m.qk_rope_head_dim}, got {spec.qk_rope_head_dim}"
            )
        h, hq = arch.hidden_size, arch.num_q_heads
        bias = arch.qkv_bias  # attention_bias: q_a_proj, kv_a_proj_with_mqa, o_proj
        self.params, self.spec, self.num_q_heads = m, spec, hq
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: nn.Module | None = None
        self.q_b_proj: nn.Linear | None = None
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, hq * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = rms_norm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, hq * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = rms_norm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, hq * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(hq * m.v_head_dim, h, bias=arch.o_bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """``[t, H, qk_nope_head_dim + qk_rope_head_dim]``, before RoPE."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q3: torch.Tensor = q.view(x.shape[0], self.num_q_heads, -1)
        return q3

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
        """Project, rotate, write this step's latents into ``cache`` and attend in the
        absorbed form.

        Args:
            x: ``[num_tokens, hidden_size]`` normalised hidden states.
            cos, sin: ``[num_tokens, 1, qk_rope_head_dim]`` RoPE tables at each
                token's position (``sin`` signed: ``RotaryEmbedding(..., signed=True)``).
            cache: the layer's latent cache ``[1, num_blocks, block_size, 1,
                kv_lora_rank + qk_rope_head_dim]``; mutated at
                ``plan.meta.slot_mapping``.
            plan: the backend's plan of this layer's KV group for the step.
            backend: an attention backend declaring ``capabilities.mla``.
            ops: unused (the latent norms are not followed by a residual add).

        Returns:
            ``[num_tokens, hidden_size]``.

        Raises:
            ShapeError: RoPE tables missing.
        """
        from kvpage.errors import ShapeError

        if cos is None or sin is None:
            raise ShapeError("cos/sin: expected RoPE tables for an MLA layer, got None")
        m, t, hq = self.params, x.shape[0], self.num_q_heads
        n, p, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q = self._query(x)
        q_nope, q_pe = q[..., :n], q[..., n:]
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, :r].contiguous())
        k_pe = ckv[:, r:].reshape(t, 1, p)
        q_pe = apply_rope_partial(q_pe, cos, sin, m.rope_interleave)
        k_pe = apply_rope_partial(k_pe, cos, sin, m.rope_interleave)
        latent = torch.cat([c.view(t, 1, r), k_pe], dim=-1)  # [t, 1, r + p]
        backend.write_kv(latent, None, cache, plan.meta.slot_mapping, plan=plan)
        w = self.kv_b_proj.weight.view(hq, n + m.v_head_dim, r)
        w_uk, w_uv = w[:, :n], w[:, n:]  # [H, n, r], [H, v, r]
        q_abs = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        query = torch.cat([q_abs, q_pe], dim=-1)  # [t, H, r + p]
        o = backend.forward(query, cache, plan, self.spec)  # [t, H, r]
        o = torch.einsum("thr,hvr->thv", o, w_uv).reshape(t, hq * m.v_head_dim)
        y: torch.Tensor = self.o_proj(o)
        return y


__all__ = ["LATENT_NORM_EPS", "MLAAttention"]
