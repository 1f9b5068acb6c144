"""Architecture settings read from a Hugging Face ``config.json`` mapping.

One ``ArchConfig`` covers the decoder families kvpage runs with its own model code:
Llama (GQA), Mistral (sliding window), Qwen2 (q/k/v bias) and Gemma-2 (alternating
sliding/global layers, soft caps, ``query_pre_attn_scalar``, ``(1 + w)`` RMSNorm,
embedding scaled by ``sqrt(hidden_size)``, pre/post norms, tanh-approximated GELU).
Each field's source is the corresponding HF modeling file (transformers 5.x).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpage.errors import SpecError
from kvpage.specs.architectures import MODEL_TYPES, check_architecture
from kvpage.specs.hf import hf_attention_shape
from kvpage.specs.moe import MoEParams, moe_params_from_hf

SUPPORTED_MODEL_TYPES = MODEL_TYPES  # kvpage.specs.architectures: the one list
#: activation name (HF ``ACT2FN`` key) -> our name
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}


@dataclass(frozen=True)
class ArchConfig:
    """Normalised architecture of one decoder model.

    Attributes:
        model_type: ``llama`` | ``mistral`` | ``qwen2`` | ``gemma2``.
        vocab_size, hidden_size, intermediate_size, num_layers: sizes.
        num_q_heads, num_kv_heads, head_dim: attention shape (``head_dim`` defaults to
            ``hidden_size // num_attention_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base (``rope_parameters.rope_theta`` in transformers 5,
            ``rope_theta`` before).
        rope_scaling: None, or ``linear`` / ``llama3`` scaling parameters (``rope_of``).
        qkv_bias / o_bias / mlp_bias: which projections carry a bias (Qwen2: q, k, v
            only; Llama: ``attention_bias`` for all four, ``mlp_bias``).
        activation: ``silu`` | ``gelu_tanh`` | ``gelu`` (gate activation of the GLU MLP).
        tie_word_embeddings: the classifier reuses the embedding matrix.
        gemma_norm: RMSNorm multiplies by ``1 + w`` and computes in float32 (Gemma).
        sandwich_norm: extra post-attention / pre- and post-feedforward norms (Gemma-2).
        embed_scale: the embedding output is multiplied by this (Gemma: sqrt(hidden)).
        final_logit_softcap: ``c * tanh(logits / c)`` on the logits, or None.
        moe: the mixture-of-experts settings (Mixtral, Qwen3-MoE, gpt-oss:
            ``kvpage.models.moe``), None for a dense MLP.
        qk_norm: RMSNorm of each head's query and key (weight ``[head_dim]``) before
            RoPE (Qwen3-MoE ``q_norm`` / ``k_norm``).
        sinks: every attention layer has a learned sink logit per query head
            (gpt-oss ``self_attn.sinks``).
    """

    model_type: str
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
    gemma_norm: bool
    sandwich_norm: bool
    embed_scale: float | None
    final_logit_softcap: float | None
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    moe: MoEParams | None = None
    qk_norm: bool = False
    sinks: bool = False


def _req(cfg: Mapping[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise SpecError(f"config.{key}: expected a value, got nothing")
    return cfg[key]


#: RoPE variants implemented (HF ``rope_type`` names)
ROPE_TYPES = ("default", "linear", "llama3")


def rope_of(cfg: Mapping[str, Any]) -> tuple[float, dict[str, float] | None]:
    """RoPE base and scaling of an HF config (transformers 5 ``rope_parameters`` or the
    older top-level ``rope_theta`` + ``rope_scaling``).

    Returns:
        ``(theta, scaling)``; ``scaling`` is None for plain RoPE, else a dict with
        ``rope_type`` (``linear`` | ``llama3``) and its parameters.

    Raises:
        SpecError: a rope type other than default/linear/llama3 (dynamic, yarn, longrope
            ... are not implemented), or ``partial_rotary_factor`` != 1.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    if theta is None:
        theta = cfg.get("rope_theta", 10000.0)
    found: dict[str, Any] | None = None
    for src in (params, scaling):
        if not isinstance(src, Mapping):
            continue
        kind = src.get("rope_type", src.get("type", "default")) or "default"
        if kind not in ROPE_TYPES:
            raise SpecError(
                f"config.rope_scaling: expected rope_type in {ROPE_TYPES}, got {kind!r}"
            )
        if kind != "default" and found is None:
            found = {k: v for k, v in src.items() if k not in ("type", "rope_theta")}
            found["rope_type"] = kind
    prf = (params.get("partial_rotary_factor") if isinstance(params, Mapping) else None) or cfg.get(
        "partial_rotary_factor", 1.0
    )
    if float(prf) != 1.0:
        raise SpecError(f"config.partial_rotary_factor: expected 1.0, got {prf}")
    if found is not None and found.get("factor") is None:
        raise SpecError(f"config.rope_scaling.factor: expected a number, got {found!r}")
    if found is not None and found["rope_type"] == "llama3":
        found.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings") or 8192
        )
    return float(theta), found


def arch_from_hf(cfg: Mapping[str, Any]) -> ArchConfig:
    """Read an HF ``config.json`` mapping.

    Raises:
        SpecError: unsupported ``model_type`` (one line naming what is missing, see
            ``kvpage.specs.architectures``), activation or rope type, or missing sizes.
    """
    mt = check_architecture(cfg, SUPPORTED_MODEL_TYPES)
    shape = hf_attention_shape(cfg)  # the one reader of layer and head sizes
    hidden = shape.hidden_size
    act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if mt == "gemma2" and cfg.get("hidden_activation") is None:
        act_name = "gelu_pytorch_tanh"  # HF Gemma2Config default
    if act_name not in ACTIVATIONS:
        raise SpecError(
            f"config.hidden_act: expected one of {sorted(ACTIVATIONS)}, got {act_name!r}"
        )
    attn_bias = bool(cfg.get("attention_bias", mt == "gpt_oss"))  # GptOssConfig: True
    is_gemma = mt == "gemma2"
    cap = cfg.get("final_logit_softcapping") if is_gemma else None
    rope = rope_of(cfg)
    return ArchConfig(
        model_type=mt,
        vocab_size=int(_req(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_req(cfg, "intermediate_size")),
        num_layers=shape.num_layers,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope[0],
        rope_scaling=rope[1],
        qkv_bias=True if mt == "qwen2" else attn_bias,
        o_bias=False if mt == "qwen2" else attn_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if mt == "llama" else False,
        activation=ACTIVATIONS[act_name],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
        gemma_norm=is_gemma,
        sandwich_norm=is_gemma,
        embed_scale=float(hidden) ** 0.5 if is_gemma else None,
        final_logit_softcap=float(cap) if cap else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        moe=moe_params_from_hf(cfg, shape.num_layers),
        qk_norm=mt == "qwen3_moe",
        sinks=mt == "gpt_oss",
    )


__all__ = [
    "ROPE_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "ArchConfig",
    "arch_from_hf",
    "rope_of",
]
