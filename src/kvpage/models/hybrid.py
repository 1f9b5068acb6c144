"""The decoder layer of the recurrent and hybrid families: per layer the mixers of
:func:`kvpage.specs.state.layer_mixers` (paged attention, Mamba-2, Gated DeltaNet)
and the family's MLP.

Block layouts (transformers 5.23 modeling files):

* ``qwen3_next`` (``Qwen3NextDecoderLayer``): ``x += mixer(input_layernorm(x))`` with
  the mixer Gated DeltaNet (``linear_attn``) or gated attention (``self_attn``), then
  ``x += mlp(post_attention_layernorm(x))`` (sparse MoE with a shared expert, or dense);
* ``mamba2`` (``Mamba2Block``): ``x += mixer(input_layernorm(x))`` (HF: ``norm``), no
  MLP; with ``residual_in_fp32`` the residual stream is float32;
* ``nemotron_h`` (``NemotronHBlock``): ``x += mixer(input_layernorm(x))`` with the
  mixer Mamba-2, attention without RoPE, or (layers that mix nothing) a relu2 MLP;
  Mamba-2's ``dt`` is clamped below at ``time_step_min`` (``NemotronHMamba2Mixer``);
* ``granitemoehybrid`` (``GraniteMoeHybridDecoderLayer``): ``x += rm * mixer(n1(x))``
  (``mamba`` or ``self_attn``), ``x += rm * (moe(n2(x)) + shared_mlp(n2(x)))`` (just
  ``shared_mlp`` without experts), ``rm`` = ``residual_multiplier``.

The mixers' settings are read from the config here (Mamba-2 sizes through
:mod:`kvpage.specs.state`, the one reader of them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvpage.attention.metadata import KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import AttentionBackend, LayerOps
from kvpage.attention.state import StateBatch, StateCache
from kvpage.errors import ShapeError, SpecError
from kvpage.models.config import ArchConfig
from kvpage.models.gated_deltanet import GatedDeltaNet
from kvpage.models.layers import MLP, PagedAttention, make_norm
from kvpage.models.mamba2_mixer import Mamba2Mixer
from kvpage.models.moe import MoEMLP
from kvpage.specs import AttentionSpec
from kvpage.specs.state import LayerMixer, _mamba2_sizes


def _float(v: Any, key: str) -> float:
    """A config number; transformers writes non-finite floats as ``{"__float__":
    "Infinity"}`` in config.json."""
    if isinstance(v, Mapping) and "__float__" in v:
        v = v["__float__"]
    try:
        return float(v)
    except (TypeError, ValueError):
        raise SpecError(f"config.{key}: expected a number, got {v!r}") from None


def mamba2_from_hf(cfg: Mapping[str, Any], hidden_size: int, eps: float) -> Mamba2Mixer:
    """A :class:`Mamba2Mixer` of a config's sizes and its family's keys: ``chunk_size``,
    ``use_bias``, ``use_conv_bias``, ``time_step_limit`` (Mamba2Mixer,
    NemotronHMamba2Mixer: limit ``(time_step_min, inf)``), Granite-4's ``mamba_*``."""
    heads, hd, d_state, groups, kernel, _ = _mamba2_sizes(cfg)
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    if cfg.get("model_type") == "nemotron_h":
        limit = (cfg.get("time_step_min", 0.001), float("inf"))
    granite = cfg.get("model_type") == "granitemoehybrid"
    p = "mamba_" if granite else ""
    return Mamba2Mixer(
        hidden_size,
        heads,
        hd,
        d_state,
        groups,
        kernel,
        int(cfg.get(f"{p}chunk_size") or 256),
        eps,
        use_bias=bool(cfg.get("mamba_proj_bias" if granite else "use_bias", False)),
        use_conv_bias=bool(cfg.get("mamba_conv_bias" if granite else "use_conv_bias", True)),
        time_step_limit=(
            _float(limit[0], "time_step_limit"),
            _float(limit[1], "time_step_limit"),
        ),
    )


#: the HF attribute name of each mixer kind per family (so checkpoint keys load as is)
_MIXER_NAMES: dict[str, dict[str, str]] = {
    "qwen3_next": {"attention": "self_attn", "gated_deltanet": "linear_attn"},
    "mamba2": {"mamba2": "mixer"},
    "nemotron_h": {"attention": "mixer", "mamba2": "mixer", "mlp": "mixer"},
    "granitemoehybrid": {"attention": "self_attn", "mamba2": "mamba"},
}


def gated_deltanet_from_hf(cfg: Mapping[str, Any], hidden_size: int, eps: float) -> GatedDeltaNet:
    """A :class:`GatedDeltaNet` of a Qwen3-Next config (``linear_*`` keys)."""
    return GatedDeltaNet(
        hidden_size,
        int(cfg["linear_num_key_heads"]),
        int(cfg["linear_num_value_heads"]),
        int(cfg["linear_key_head_dim"]),
        int(cfg["linear_value_head_dim"]),
        int(cfg.get("linear_conv_kernel_dim") or 4),
        eps,
    )


class HybridDecoderLayer(nn.Module):
    """One decoder layer of a recurrent/hybrid family (see the module docstring).

    Args:
        arch: the model architecture.
        cfg: the HF config (the mixers' settings).
        layer_id: the decoder layer's index.
        mixers: this layer's mixers (``layer_mixers(cfg)[layer_id]``).
        attn_spec: the AttentionSpec of this layer when it has attention, else None.
    """

    def __init__(
        self,
        arch: ArchConfig,
        cfg: Mapping[str, Any],
        layer_id: int,
        mixers: tuple[LayerMixer, ...],
        attn_spec: AttentionSpec | None,
    ) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.mixers = mixers
        self.single = arch.family.block == "single"
        if len(mixers) > 1 or (not mixers and not self.single):
            raise ShapeError(f"layer {layer_id}: expected one mixer, got {mixers}")
        self.kind = mixers[0] if mixers else "mlp"
        self.op_name = _MIXER_NAMES[arch.model_type][self.kind]
        op: nn.Module
        if self.kind == "attention":
            if attn_spec is None:
                raise ShapeError(f"layer {layer_id}: expected an AttentionSpec, got None")
            op = PagedAttention(arch, attn_spec)
        elif self.kind == "gated_deltanet":
            op = gated_deltanet_from_hf(cfg, h, eps)
        elif self.kind == "mamba2":
            op = mamba2_from_hf(cfg, h, eps)
        else:  # Nemotron-H's MLP-only layer
            op = MLP(arch)
        self.add_module(self.op_name, op)
        self.input_layernorm = make_norm(arch, h)
        self.mlp: MLP | MoEMLP | None = None
        self.shared_mlp: MLP | None = None
        if not self.single:
            self.post_attention_layernorm = make_norm(arch, h)
            if arch.moe is not None and layer_id in arch.moe.sparse_layers:
                self.mlp = MoEMLP(h, arch.moe)
            elif arch.model_type != "granitemoehybrid":
                self.mlp = MLP(arch)
            if arch.model_type == "granitemoehybrid":  # GraniteMoeHybridMLP
                inter = int(cfg.get("shared_intermediate_size") or 0)
                self.shared_mlp = MLP(arch, inter, kind="fused_glu")
        self.residual_fp32 = arch.model_type == "mamba2" and bool(cfg.get("residual_in_fp32", True))
        self.residual_multiplier = arch.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: KVCache | None,
        plan: StepPlan | None,
        backend: AttentionBackend,
        ops: LayerOps | None,
        state: StateCache | None,
        batch: StateBatch | None,
    ) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> same (float32 with ``residual_fp32``).

        Mutates ``cache`` (attention: this step's K/V) or ``state`` (recurrent: the
        slots of ``batch.state_indices``).
        """
        dtype = self.input_layernorm.weight.dtype
        h = self.input_layernorm(x.to(dtype), ops)
        op = getattr(self, self.op_name)
        if self.kind == "attention":
            assert cache is not None and plan is not None
            a = op(h, cos, sin, cache, plan, backend, ops)
        elif self.kind == "mlp":
            a = op(h, ops)
        else:
            assert state is not None and batch is not None
            a = op(h, state, batch)
        rm = self.residual_multiplier
        if rm is not None:
            a = a * rm
        x = (x.float() if self.residual_fp32 else x) + a
        if self.single:
            return x
        h = self.post_attention_layernorm(x, ops)
        m = self.mlp(h, ops) if self.mlp is not None else None
        if self.shared_mlp is not None:
            s = self.shared_mlp(h, ops)
            m = s if m is None else m + s
        assert m is not None
        return x + (m * rm if rm is not None else m)


__all__ = ["HybridDecoderLayer", "gated_deltanet_from_hf", "mamba2_from_hf"]
