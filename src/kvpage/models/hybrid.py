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
  ``shared_mlp`` without experts), ``rm`` = ``residual_multiplier``;
* ``falcon_h1`` (``FalconH1DecoderLayer``): ``h = input_layernorm(x)``, ``x += ssm_out *
  mamba(h) + attn_out * self_attn(attn_in * h)``, ``x += mlp(post_attention_layernorm(x))``
  with Falcon-H1's muP multipliers (``ssm_in/out_multiplier``, ``ssm_multipliers`` on
  in_proj's sections, ``key_multiplier``, ``attention_in/out_multiplier``,
  ``mlp_multipliers``) and its optional gated norm (``mamba_rms_norm``).

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
    mt = cfg.get("model_type")
    granite = mt in ("granitemoehybrid", "falcon_h1")  # the mamba_* key names
    p = "mamba_" if granite else ""
    falcon: dict[str, Any] = {}
    if mt == "falcon_h1":  # FalconH1Mixer
        mults = cfg.get("ssm_multipliers") or [1.0] * 5
        falcon = dict(
            out_bias=bool(cfg.get("projectors_bias", False)),
            gated_norm=bool(cfg.get("mamba_rms_norm", False)),
            norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
            in_multiplier=_float(cfg.get("ssm_in_multiplier", 1.0), "ssm_in_multiplier"),
            zxbcdt_multipliers=tuple(_float(m, "ssm_multipliers") for m in mults),
        )
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
        **falcon,
    )


#: the HF attribute name of each mixer kind per family (so checkpoint keys load as is)
_MIXER_NAMES: dict[str, dict[str, str]] = {
    "qwen3_next": {"attention": "self_attn", "gated_deltanet": "linear_attn"},
    "mamba2": {"mamba2": "mixer"},
    "nemotron_h": {"attention": "mixer", "mamba2": "mixer", "mlp": "mixer"},
    "granitemoehybrid": {"attention": "self_attn", "mamba2": "mamba"},
    "falcon_h1": {"attention": "self_attn", "mamba2": "mamba"},
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
        falcon = arch.model_type == "falcon_h1"
        if (len(mixers) > 1 and not falcon) or (not mixers and not self.single):
            raise ShapeError(f"layer {layer_id}: expected one mixer, got {mixers}")
        #: the layer's ops in HF's summation order (Falcon-H1: Mamba-2, then attention)
        self.kinds: tuple[str, ...] = tuple(sorted(mixers, key=lambda k: k != "mamba2")) or ("mlp",)
        names = _MIXER_NAMES[arch.model_type]
        #: (input scale, output scale) per op (Falcon-H1's multipliers; else 1, 1)
        self.scales: list[tuple[float, float]] = []
        for kind in self.kinds:
            op: nn.Module
            if kind == "attention":
                if attn_spec is None:
                    raise ShapeError(f"layer {layer_id}: expected an AttentionSpec, got None")
                op = PagedAttention(arch, attn_spec)
                km = _float(cfg.get("key_multiplier", 1.0), "key_multiplier") if falcon else 1.0
                op.key_multiplier = None if km == 1.0 else km
            elif kind == "gated_deltanet":
                op = gated_deltanet_from_hf(cfg, h, eps)
            elif kind == "mamba2":
                op = mamba2_from_hf(cfg, h, eps)
            else:  # Nemotron-H's MLP-only layer
                op = MLP(arch)
            self.add_module(names[kind], op)
            scale = (1.0, 1.0)
            if falcon and kind == "attention":
                scale = (
                    _float(cfg.get("attention_in_multiplier", 1.0), "attention_in_multiplier"),
                    _float(cfg.get("attention_out_multiplier", 1.0), "attention_out_multiplier"),
                )
            elif falcon:
                scale = (1.0, _float(cfg.get("ssm_out_multiplier", 1.0), "ssm_out_multiplier"))
            self.scales.append(scale)
        self.op_names = [names[k] for k in self.kinds]
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
            if falcon and isinstance(self.mlp, MLP):  # FalconH1MLP.mlp_multipliers
                gm, dm = cfg.get("mlp_multipliers") or (1.0, 1.0)
                self.mlp.multipliers = (
                    _float(gm, "mlp_multipliers"),
                    _float(dm, "mlp_multipliers"),
                )
        self.residual_fp32 = arch.model_type == "mamba2" and bool(cfg.get("residual_in_fp32", True))
        self.residual_multiplier = arch.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: KVCache | None,
        plan: StepPlan | None,
        backend: AttentionBackend[Any],
        ops: LayerOps | None,
        state: StateCache | None,
        batch: StateBatch | None,
    ) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> same (float32 with ``residual_fp32``).

        Mutates ``cache`` (attention: this step's K/V) and/or ``state`` (recurrent: the
        slots of ``batch.state_indices``).
        """
        dtype = self.input_layernorm.weight.dtype
        h = self.input_layernorm(x.to(dtype), ops)
        a: torch.Tensor | None = None
        for kind, name, (s_in, s_out) in zip(self.kinds, self.op_names, self.scales):
            op = getattr(self, name)
            hin = h * s_in if s_in != 1.0 else h
            if kind == "attention":
                assert cache is not None and plan is not None
                o = op(hin, cos, sin, cache, plan, backend, ops)
            elif kind == "mlp":
                o = op(hin, ops)
            else:
                assert state is not None and batch is not None
                o = op(hin, state, batch)
            if s_out != 1.0:
                o = o * s_out
            a = o if a is None else a + o
        assert a is not None
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
        out: torch.Tensor = x + (m * rm if rm is not None else m)
        return out


__all__ = ["HybridDecoderLayer", "gated_deltanet_from_hf", "mamba2_from_hf"]
