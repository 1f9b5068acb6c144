"""Recurrent-state layers (Mamba-2, Gated DeltaNet): what a hybrid model's layers hold
per sequence instead of (or beside) a paged KV cache.

A recurrent layer keeps, per sequence, a fixed-size state that the next token updates
in place: the last ``conv_kernel - 1`` inputs of its causal depthwise conv1d (the *conv
state*, ``[conv_dim, conv_kernel - 1]``) and the recurrent matrix of its scan (the
*SSM state*): Mamba-2 ``[num_heads, head_dim, d_state]`` (Dao & Gu, "Transformers are
SSMs", arXiv:2405.21060; HF ``Mamba2Mixer``), Gated DeltaNet ``[num_v_heads,
head_k_dim, head_v_dim]`` (Yang et al., "Gated Delta Networks", arXiv:2412.06464; HF
``Qwen3NextGatedDeltaNet``). HF's caches keep ``conv_kernel`` conv columns; the newest
input is always the current token's, so ``conv_kernel - 1`` columns are the state.

Sizes follow transformers 5.23's modeling code of each family (``conv_dim`` =
``intermediate_size + 2 * n_groups * d_state`` for Mamba-2 mixers, ``2 * key_dim +
value_dim`` for Gated DeltaNet), read here once for the spec compiler, the planner and
the model code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from kvpage.errors import SpecError

StateKind = Literal["mamba2", "gated_deltanet"]
#: what one decoder layer mixes tokens with: ``attention`` (paged KV), a recurrent kind,
#: both in parallel (Falcon-H1), or nothing (Nemotron-H's MLP/MoE-only layers)
LayerMixer = Literal["attention", "mamba2", "gated_deltanet"]
StateDType = Literal["float32", "float16", "bfloat16"]

#: bytes per element of the state dtypes (the model dtypes)
_STATE_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

#: hybrid and pure recurrent model types whose layers the spec compiler lowers here
RECURRENT_MODEL_TYPES: tuple[str, ...] = (
    "mamba2",
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "qwen3_next",
)


class StateSpec(BaseModel):
    """Per-sequence recurrent state of one layer.

    Attributes:
        kind: ``mamba2`` (SSD scan) or ``gated_deltanet`` (gated delta rule).
        layer_id: the decoder layer it belongs to (0-based, in the model's layer order).
        conv_dim: channels of the causal conv1d.
        conv_kernel: the conv1d's kernel width (>= 2); the conv state holds
            ``conv_kernel - 1`` columns.
        ssm_shape: the recurrent state's shape per sequence: Mamba-2 ``(num_heads,
            head_dim, d_state)``; Gated DeltaNet ``(num_v_heads, head_k_dim, head_v_dim)``.
        dtype: the conv state's dtype (the model dtype).
        ssm_dtype: the recurrent state's dtype (Nemotron-H's ``mamba_ssm_cache_dtype``;
            otherwise the model dtype).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: StateKind
    layer_id: int = Field(ge=0)
    conv_dim: int = Field(ge=1)
    conv_kernel: int = Field(ge=2)
    ssm_shape: tuple[int, int, int]
    dtype: StateDType = "float32"
    ssm_dtype: StateDType = "float32"

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """``(conv_dim, conv_kernel - 1)``: the conv state of one sequence."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def conv_bytes(self) -> int:
        """Bytes of one sequence's conv state."""
        return self.conv_dim * (self.conv_kernel - 1) * _STATE_DTYPE_BYTES[self.dtype]

    @property
    def ssm_bytes(self) -> int:
        """Bytes of one sequence's recurrent (SSM / delta-rule) state."""
        return math.prod(self.ssm_shape) * _STATE_DTYPE_BYTES[self.ssm_dtype]

    @property
    def bytes(self) -> int:
        """Bytes of one sequence's whole state in this layer (conv + recurrent)."""
        return self.conv_bytes + self.ssm_bytes


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(f"config.{key}: expected a positive integer, got {v!r}")
    return v


def layer_mixers(cfg: Mapping[str, Any]) -> tuple[tuple[LayerMixer, ...], ...] | None:
    """What each decoder layer of a recurrent/hybrid config mixes tokens with, or None
    for a model type outside :data:`RECURRENT_MODEL_TYPES` (every layer attention).

    Rules (transformers 5.23 configuration classes): ``mamba2`` every layer Mamba-2;
    ``qwen3_next`` ``layer_types`` ``linear_attention`` = Gated DeltaNet,
    ``full_attention`` = attention; ``nemotron_h`` ``layers_block_type`` (or the legacy
    ``hybrid_override_pattern``: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE;
    MLP and MoE blocks mix nothing); ``granitemoehybrid`` ``layer_types`` (or
    ``layers_block_type``) ``linear_attention``/``mamba`` = Mamba-2, else attention;
    ``falcon_h1`` attention and Mamba-2 in parallel in every layer.

    Raises:
        SpecError: a layer list of the wrong length or with an unknown entry.
    """
    mt = cfg.get("model_type")
    if mt not in RECURRENT_MODEL_TYPES:
        return None
    if mt == "nemotron_h":  # num_hidden_layers is len(layers_block_type) there
        n = 0
    else:
        n = _int(cfg, "num_hidden_layers")
    if mt == "mamba2":
        return tuple(("mamba2",) for _ in range(n))
    if mt == "falcon_h1":
        return tuple(("attention", "mamba2") for _ in range(n))
    if mt == "nemotron_h":
        types = cfg.get("layers_block_type") or cfg.get("layer_types")
        if not types and isinstance(cfg.get("hybrid_override_pattern"), str):
            legacy = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
            types = [legacy.get(c, c) for c in cfg["hybrid_override_pattern"]]
        table: dict[str, tuple[LayerMixer, ...]] = {
            "linear_attention": ("mamba2",),
            "mamba": ("mamba2",),
            "full_attention": ("attention",),
            "attention": ("attention",),
            "mlp": (),
            "moe": (),
        }
        key = "layers_block_type"
    elif mt == "granitemoehybrid":
        types = cfg.get("layer_types") or cfg.get("layers_block_type")
        table = {
            "linear_attention": ("mamba2",),
            "mamba": ("mamba2",),
            "full_attention": ("attention",),
            "attention": ("attention",),
        }
        key = "layer_types"
    else:  # qwen3_next
        types = cfg.get("layer_types")
        table = {"linear_attention": ("gated_deltanet",), "full_attention": ("attention",)}
        key = "layer_types"
    if not types:
        raise SpecError(f"config.{key}: expected one entry per layer, got nothing")
    if mt != "nemotron_h" and len(types) != n:
        raise SpecError(f"config.{key}: expected {n} entries, got {len(types)}")
    out: list[tuple[LayerMixer, ...]] = []
    for t in types:
        if t not in table:
            raise SpecError(f"config.{key}: expected entries of {sorted(table)}, got {t!r}")
        out.append(table[t])
    return tuple(out)


def _state_dtypes(cfg: Mapping[str, Any], dtype: str) -> tuple[StateDType, StateDType]:
    if dtype not in _STATE_DTYPE_BYTES:
        raise SpecError(f"dtype: expected one of {sorted(_STATE_DTYPE_BYTES)}, got {dtype!r}")
    ssm = cfg.get("mamba_ssm_cache_dtype")
    ssm = ssm if ssm in _STATE_DTYPE_BYTES else dtype
    return cast(StateDType, dtype), cast(StateDType, ssm)


def _mamba2_sizes(cfg: Mapping[str, Any]) -> tuple[int, int, int, int, int, int]:
    """``(num_heads, head_dim, d_state, n_groups, conv_kernel, intermediate_size)`` of
    a family's Mamba-2 mixer (key names and intermediate rule per family)."""
    mt = cfg.get("model_type")
    hidden = _int(cfg, "hidden_size")
    if mt == "mamba2":  # Mamba2Mixer
        heads, hd = _int(cfg, "num_heads"), _int(cfg, "head_dim")
        d_state, groups = _int(cfg, "state_size"), _int(cfg, "n_groups", 1)
        kernel = _int(cfg, "conv_kernel", 4)
        inter = int(float(cfg.get("expand", 2)) * hidden)
    elif mt == "nemotron_h":  # NemotronHMamba2Mixer: heads x head_dim
        heads, hd = _int(cfg, "mamba_num_heads"), _int(cfg, "mamba_head_dim")
        d_state, groups = _int(cfg, "ssm_state_size"), _int(cfg, "n_groups", 1)
        kernel = _int(cfg, "conv_kernel", 4)
        inter = heads * hd
    else:  # granitemoehybrid, falcon_h1 (mamba_d_ssm when set)
        heads, hd = _int(cfg, "mamba_n_heads"), _int(cfg, "mamba_d_head")
        d_state, groups = _int(cfg, "mamba_d_state"), _int(cfg, "mamba_n_groups", 1)
        kernel = _int(cfg, "mamba_d_conv", 4)
        d_ssm = cfg.get("mamba_d_ssm") if mt == "falcon_h1" else None
        inter = int(d_ssm) if d_ssm else int(float(cfg.get("mamba_expand", 2)) * hidden)
    if heads * hd != inter:
        raise SpecError(
            f"config: Mamba-2 heads x head_dim: expected the mixer width {inter}, "
            f"got {heads} x {hd}"
        )
    return heads, hd, d_state, groups, kernel, inter


def state_layers_from_hf(cfg: Mapping[str, Any], dtype: str = "float32") -> list[StateSpec]:
    """One :class:`StateSpec` per recurrent mixer of a config, in layer order (empty for
    a model without recurrent layers).

    Args:
        cfg: an HF ``config.json`` mapping.
        dtype: the model dtype (the states' dtype unless the config names another for
            the SSM state).

    Raises:
        SpecError: missing or inconsistent sizes.
    """
    mixers = layer_mixers(cfg)
    if mixers is None:
        return []
    conv_dtype, ssm_dtype = _state_dtypes(cfg, dtype)
    out: list[StateSpec] = []
    for lid, kinds in enumerate(mixers):
        for kind in kinds:
            if kind == "mamba2":
                heads, hd, d_state, groups, kernel, inter = _mamba2_sizes(cfg)
                conv_dim = inter + 2 * groups * d_state
                ssm: tuple[int, int, int] = (heads, hd, d_state)
            elif kind == "gated_deltanet":  # Qwen3NextGatedDeltaNet
                k_heads = _int(cfg, "linear_num_key_heads")
                v_heads = _int(cfg, "linear_num_value_heads")
                dk, dv = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
                if v_heads % k_heads:
                    raise SpecError(
                        "config.linear_num_value_heads: expected a multiple of "
                        f"linear_num_key_heads={k_heads}, got {v_heads}"
                    )
                conv_dim = 2 * k_heads * dk + v_heads * dv
                kernel = _int(cfg, "linear_conv_kernel_dim", 4)
                ssm = (v_heads, dk, dv)
            else:
                continue
            out.append(
                StateSpec(
                    kind=kind,
                    layer_id=lid,
                    conv_dim=conv_dim,
                    conv_kernel=kernel,
                    ssm_shape=ssm,
                    dtype=conv_dtype,
                    ssm_dtype=ssm_dtype,
                )
            )
    return out


def attention_layer_ids(cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The decoder layers with an attention mixer (their order is ``CacheSpec.layers``'),
    or None for a model type outside :data:`RECURRENT_MODEL_TYPES` (every layer)."""
    mixers = layer_mixers(cfg)
    if mixers is None:
        return None
    return tuple(i for i, m in enumerate(mixers) if "attention" in m)


__all__ = [
    "RECURRENT_MODEL_TYPES",
    "LayerMixer",
    "StateKind",
    "StateSpec",
    "attention_layer_ids",
    "layer_mixers",
    "state_layers_from_hf",
]
