"""Architecture settings read from a Hugging Face ``config.json`` mapping.

One ``ArchConfig`` covers the decoder families kvpage runs with its own model code;
how each family differs from Llama is its row in ``kvpage.specs.families`` (the one
table), the numbers come from the config here. Each field's source is the
corresponding HF modeling / configuration file (transformers 5.23).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvpage.errors import SpecError
from kvpage.models.rope import ROPE_TYPES
from kvpage.specs.architectures import MODEL_TYPES, check_architecture
from kvpage.specs.families import FAMILIES, Family
from kvpage.specs.hf import MLA_MODEL_TYPES, HFAttentionShape, hf_attention_shape
from kvpage.specs.moe import MoEParams, moe_params_from_hf
from kvpage.specs.state import attention_layer_ids, layer_mixers

SUPPORTED_MODEL_TYPES = MODEL_TYPES  # kvpage.specs.architectures: the one list
#: activation name (HF ``ACT2FN`` key) -> our name
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "relu2": "relu2",
}


@dataclass(frozen=True)
class MLAParams:
    """The sizes of an MLA attention layer (HF ``DeepseekV3Attention``; DeepSeek-V2,
    arXiv:2405.04434, section 2.1).

    Attributes:
        q_lora_rank: the query's low-rank width (``q_a_proj``/``q_b_proj``), None =
            one ``q_proj``.
        kv_lora_rank: the cached latent's width (``kv_a_proj_with_mqa`` output minus
            the RoPE key).
        qk_nope_head_dim, qk_rope_head_dim: per head, the query/key parts without and
            with RoPE (the key's RoPE part is shared by all heads).
        v_head_dim: per head, the value width.
        rope_interleave: the RoPE part is rotated in interleaved pairs and laid out
            de-interleaved (``apply_rotary_pos_emb_interleave``), else rotate-half.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


def mla_params_from_hf(cfg: Mapping[str, Any]) -> MLAParams | None:
    """The MLA sizes of a ``deepseek_v3`` config, None for other model types.

    Raises:
        SpecError: a size missing or not a positive integer.
    """
    if cfg.get("model_type") not in MLA_MODEL_TYPES:
        return None
    sizes = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        v = _req(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(f"config.{key}: expected a positive integer, got {v!r}")
        sizes[key] = v
    q = cfg.get("q_lora_rank")
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        raise SpecError(f"config.q_lora_rank: expected a positive integer or null, got {q!r}")
    return MLAParams(
        q_lora_rank=q,
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        **sizes,
    )


@dataclass(frozen=True)
class ArchConfig:
    """Normalised architecture of one decoder model.

    Attributes:
        model_type: one of :data:`SUPPORTED_MODEL_TYPES`.
        family: the family's row (``kvpage.specs.families``): norm kind, block layout,
            q/k norm, MLP kind, fused q/k/v, RoPE layout, multipliers, weight names.
        vocab_size, hidden_size, intermediate_size, num_layers: sizes.
        num_q_heads, num_kv_heads, head_dim: attention shape (``head_dim`` defaults to
            ``hidden_size // num_attention_heads``); all 0 for a model without attention
            layers (``mamba2``).
        rms_norm_eps: the norm epsilon (RMSNorm or LayerNorm: the family's key).
        rope_theta: RoPE base (``rope_parameters.rope_theta`` in transformers 5,
            ``rope_theta`` before).
        rope_scaling: None, or the RoPE variant's parameters (``rope_params``).
        rotary_dim: rotated dimensions per head (``head_dim * partial_rotary_factor``).
        rope_local: ``(theta, scaling)`` of the sliding layers when they differ from the
            full ones (Gemma-3's ``rope_local_base_freq``), else None.
        qkv_bias / o_bias / mlp_bias: which projections carry a bias.
        activation: ``silu`` | ``gelu_tanh`` | ``gelu`` (the MLP's activation).
        tie_word_embeddings: the classifier reuses the embedding matrix.
        embed_scale: the embedding output is multiplied by this (Gemma: sqrt(hidden),
            Granite: ``embedding_multiplier``), or None.
        residual_multiplier: each block output is scaled by this before the residual
            add (Granite), or None.
        logit_multiplier: the logits are multiplied by this (Cohere ``logit_scale``,
            Granite ``1 / logits_scaling``), or None.
        final_logit_softcap: ``c * tanh(logits / c)`` on the logits, or None.
        max_position_embeddings: the context length (GPT-2: ``n_positions``, the size
            of its learned position table).
        moe: the mixture-of-experts settings (Mixtral, Qwen3-MoE, gpt-oss:
            ``kvpage.models.moe``), None for a dense MLP.
        qk_norm: the layers norm q and k before RoPE (``family.qk_norm`` says how).
        sinks: every attention layer has a learned sink logit per query head
            (gpt-oss ``self_attn.sinks``).
        use_rope: the attention layers rotate q/k (``family.rope``; Granite-4 hybrid:
            ``position_embedding_type == "rope"``).
        mla: the MLA sizes (DeepSeek-V3: ``kvpage.models.mla``), None for K/V
            attention; then ``head_dim`` and ``rotary_dim`` are ``qk_rope_head_dim``
            (the RoPE tables' width, HF ``DeepseekV3Config.head_dim``).
    """

    model_type: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    activation: str
    tie_word_embeddings: bool
    embed_scale: float | None
    final_logit_softcap: float | None
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    rotary_dim: int = 0
    rope_local: tuple[float, dict[str, Any] | None] | None = None
    residual_multiplier: float | None = None
    logit_multiplier: float | None = None
    moe: MoEParams | None = None
    qk_norm: bool = False
    sinks: bool = False
    use_rope: bool = True
    mla: MLAParams | None = None

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model is meant for: ``max_position_embeddings``,
        times ``factor`` for ``dynamic`` RoPE (which extends past it; vLLM's
        ``_get_and_verify_max_len`` does the same)."""
        sc = self.rope_scaling
        if sc is not None and sc["rope_type"] == "dynamic":
            return int(self.max_position_embeddings * float(sc["factor"]))
        return self.max_position_embeddings

    @property
    def gemma_norm(self) -> bool:
        """The norms are Gemma's ``(1 + w)`` RMSNorm in float32."""
        return self.family.norm == "rms_gemma"


def _req(cfg: Mapping[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise SpecError(f"config.{key}: expected a value, got nothing")
    return cfg[key]


def _rope_source(cfg: Mapping[str, Any], layer_type: str) -> tuple[dict[str, Any], bool]:
    """The RoPE entries of one layer type: transformers 5's ``rope_parameters`` (flat, or
    one dict per layer type as Gemma-3 writes it) merged over the older top-level
    ``rope_theta`` / ``rope_scaling`` (``rope_local_base_freq`` for Gemma-3's sliding
    layers); the flag says whether the config has per-layer-type entries."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise SpecError(f"config.rope_parameters: expected a mapping, got {params!r}")
    per_type = bool(params) and all(isinstance(v, Mapping) for v in params.values())
    if per_type:
        src = dict(params.get(layer_type) or params.get("full_attention") or {})
    else:
        src = dict(params)
    scaling = cfg.get("rope_scaling") or {}
    # Gemma3TextConfig.convert_rope_params_to_dict: an old top-level rope_scaling
    # scales the full-attention layers only
    local_only = per_type or cfg.get("model_type") == "gemma3_text"
    if isinstance(scaling, Mapping) and not (local_only and layer_type == "sliding_attention"):
        for k, v in scaling.items():
            src.setdefault(k, v)
    if "rope_theta" not in src:
        local = layer_type == "sliding_attention" and (
            cfg.get("rope_local_base_freq")
            or (10000.0 if cfg.get("model_type") == "gemma3_text" else None)
        )
        # Gemma3TextConfig.default_theta: 1e6 global, 1e4 local
        default = 1_000_000.0 if cfg.get("model_type") == "gemma3_text" else 10000.0
        src["rope_theta"] = local or cfg.get("rope_theta", default)
    return src, per_type


def rope_params(
    cfg: Mapping[str, Any], head_dim: int, layer_type: str = "full_attention"
) -> tuple[float, dict[str, Any] | None, int]:
    """RoPE base, variant parameters and rotated width of an HF config's layers of
    ``layer_type`` (``full_attention`` | ``sliding_attention``).

    Returns:
        ``(theta, scaling, rotary_dim)``: ``scaling`` is None for plain RoPE, else a
        dict with ``rope_type`` (one of :data:`ROPE_TYPES`) and its parameters, with
        ``original_max_position_embeddings`` (``config.original_max_position_embeddings``
        or ``max_position_embeddings``) and ``max_position_embeddings`` filled in;
        ``rotary_dim = int(head_dim * partial_rotary_factor)``.

    Raises:
        SpecError: another rope type, a variant without its parameters (``factor``;
            longrope's ``short_factor`` / ``long_factor`` of ``rotary_dim / 2``
            entries), or a ``partial_rotary_factor`` outside ``(0, 1]`` or giving an
            odd width.
    """
    src, _ = _rope_source(cfg, layer_type)
    fam = FAMILIES.get(str(cfg.get("model_type")))
    theta = float(src["rope_theta"])
    kind = src.get("rope_type", src.get("type", "default")) or "default"
    if fam is not None and fam.model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config: the old names of longrope
    if kind not in ROPE_TYPES:
        raise SpecError(
            f"config.rope_parameters.rope_type: expected one of {ROPE_TYPES}, got {kind!r}"
        )
    prf = src.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
    if prf is None:
        prf = fam.partial_rotary_default if fam is not None else 1.0
    prf = float(prf)
    rotary_dim = int(head_dim * prf)
    if not 0 < prf <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise SpecError(
            f"config.partial_rotary_factor: expected a factor in (0, 1] giving an even "
            f"rotary width of head_dim={head_dim}, got {prf}"
        )
    if kind == "default":
        return theta, None, rotary_dim
    found = {
        k: v for k, v in src.items() if k not in ("type", "rope_theta", "partial_rotary_factor")
    }
    found["rope_type"] = kind
    max_pos = int(cfg.get("max_position_embeddings") or 4096)
    found.setdefault("max_position_embeddings", max_pos)
    orig = found.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    if orig is None:
        orig = 8192 if kind == "llama3" and not cfg.get("max_position_embeddings") else max_pos
    found["original_max_position_embeddings"] = int(orig)
    if kind in ("linear", "llama3", "dynamic") and found.get("factor") is None:
        raise SpecError(f"config.rope_scaling.factor: expected a number, got {found!r}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            v = found.get(key)
            if not isinstance(v, (list, tuple)) or len(v) != rotary_dim // 2:
                raise SpecError(
                    f"config.rope_parameters.{key}: expected {rotary_dim // 2} numbers, got {v!r}"
                )
    return theta, found, rotary_dim


def rope_of(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` of :func:`rope_params` for the full-attention layers."""
    hd = cfg.get("head_dim") or int(cfg.get("hidden_size") or 64) // int(
        cfg.get("num_attention_heads") or 1
    )
    theta, scaling, _ = rope_params(cfg, int(hd))
    return theta, scaling


def _positive(cfg: Mapping[str, Any], key: str) -> float | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SpecError(f"config.{key}: expected a finite number > 0, got {v!r}")
    return float(v)


def arch_from_hf(cfg: Mapping[str, Any]) -> ArchConfig:
    """Read an HF ``config.json`` mapping (the family's rules: ``kvpage.specs.families``).

    Raises:
        SpecError: unsupported ``model_type`` (one line naming what is missing, see
            ``kvpage.specs.architectures``), activation or rope type, or missing sizes.
    """
    mt = check_architecture(cfg, SUPPORTED_MODEL_TYPES)
    fam = FAMILIES[mt]
    attention_free = attention_layer_ids(cfg) == ()  # mamba2: no attention sizes
    if mt == "nemotron_h" and "moe" in str(cfg.get("layers_block_type") or ""):
        raise SpecError(
            "config.layers_block_type: expected mamba/attention/mlp layers, got 'moe' "
            "(Nemotron-H's MoE: sigmoid group routing with relu2 experts, not implemented)"
        )
    if attention_free:
        mixers = layer_mixers(cfg) or ()
        shape = HFAttentionShape(mt, len(mixers), int(_req(cfg, "hidden_size")), 0, 0, 0)
    else:
        shape = hf_attention_shape(cfg)  # the one reader of layer and head sizes
    mla = mla_params_from_hf(cfg)
    if mla is not None:  # RoPE runs on the qk_rope_head_dim part (DeepseekV3Config.head_dim)
        shape = replace(shape, head_dim=mla.qk_rope_head_dim, num_kv_heads=1)
    hidden = shape.hidden_size
    act_name = fam.activation(cfg)
    if act_name not in ACTIVATIONS:
        raise SpecError(
            f"config.{fam.act_keys[0]}: expected one of {sorted(ACTIVATIONS)}, got {act_name!r}"
        )
    if cfg.get("use_bidirectional_attention"):
        raise SpecError(
            "config.use_bidirectional_attention: expected false (kvpage runs causal decoders), "
            "got true"
        )
    qkv_b, o_b, mlp_b = fam.biases(cfg)
    if fam.learned_positions:
        inter = int(cfg.get("n_inner") or 4 * hidden)
        vocab = int(_req(cfg, "vocab_size"))
        max_pos = int(_req(cfg, "n_positions"))
        theta, scaling, rotary_dim, local = 0.0, None, shape.head_dim, None
    elif attention_free:  # no positions at all (the recurrence orders the tokens)
        inter = int(cfg.get("intermediate_size") or 0)
        vocab = int(_req(cfg, "vocab_size"))
        max_pos = int(cfg.get("max_position_embeddings") or 1 << 16)
        theta, scaling, rotary_dim, local = 0.0, None, 0, None
    else:
        inter = int(_req(cfg, "intermediate_size"))
        vocab = int(_req(cfg, "vocab_size"))
        max_pos = int(cfg.get("max_position_embeddings") or 4096)
        theta, scaling, rotary_dim = rope_params(cfg, shape.head_dim)
        lt, ls, lr = rope_params(cfg, shape.head_dim, "sliding_attention")
        if lr != rotary_dim:
            raise SpecError(
                f"config.rope_parameters: expected one partial_rotary_factor, got {lr} "
                f"and {rotary_dim} rotated dims"
            )
        local = (lt, ls) if (lt, ls) != (theta, scaling) else None
    embed: float | None = None
    if fam.embed_scale == "sqrt_hidden":
        embed = float(hidden) ** 0.5
    elif fam.embed_scale == "embedding_multiplier":
        embed = _positive(cfg, "embedding_multiplier")
    logit_mult: float | None = None
    if fam.logits == "divide":
        ls_ = _positive(cfg, "logits_scaling")
        logit_mult = None if ls_ is None else 1.0 / ls_
    elif fam.logits == "multiply":
        logit_mult = _positive(cfg, fam.logit_scale_key)
    cap = cfg.get("final_logit_softcapping") if fam.logits == "softcap" else None
    return ArchConfig(
        model_type=mt,
        family=fam,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=shape.num_layers,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=fam.norm_eps(cfg),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        rope_local=local,
        qkv_bias=qkv_b,
        o_bias=o_b,
        mlp_bias=mlp_b,
        activation=ACTIVATIONS[act_name],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tie_default)),
        embed_scale=embed,
        residual_multiplier=(
            _positive(cfg, "residual_multiplier") if fam.residual_multiplier else None
        ),
        logit_multiplier=logit_mult,
        final_logit_softcap=float(cap) if cap else None,
        max_position_embeddings=max_pos,
        moe=moe_params_from_hf(cfg, shape.num_layers),
        qk_norm=fam.has_qk_norm(cfg),
        sinks=fam.sinks,
        use_rope=not attention_free
        and fam.rope
        and (mt != "granitemoehybrid" or cfg.get("position_embedding_type") == "rope"),
        mla=mla,
    )


__all__ = [
    "ROPE_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "ArchConfig",
    "MLAParams",
    "mla_params_from_hf",
    "arch_from_hf",
    "rope_of",
    "rope_params",
]
