"""The decoder families kvpage runs, one declarative row per HF ``model_type``.

A :class:`Family` row says how a family's decoder layer differs from Llama's: the norm
(RMSNorm, Gemma's ``1 + w`` RMSNorm, LayerNorm with or without bias), where the norms
sit in the block (pre-norm, Gemma's sandwich, OLMo-2's post-norms, Cohere's parallel
attention + MLP), the q/k norm (per head, over the whole projection, or a per-head
LayerNorm), the MLP (gated, fused gated, plain, mixture of experts), fused q/k/v, which
projections carry biases (and the config key that switches them), RoPE's layout
(rotate-half or interleaved pairs) or learned positions, the multipliers (embedding,
residual, logits) and the checkpoint's weight names. ``kvpage.models`` builds the model
from the row; :func:`count_parameters` counts its parameters from the same row, so
``kvpage plan`` and the model cannot disagree. The attention-layer rules (windows per
layer, scale, soft cap, sinks) stay in :mod:`kvpage.specs.hf`, which derives the cache
layout.

Each row's source is the family's transformers 5.23 modeling file
(``transformers/models/<model_type>/modeling_<model_type>.py``): ``LlamaDecoderLayer``,
``Qwen3Attention`` (``q_norm`` / ``k_norm`` over ``head_dim``), ``Gemma3DecoderLayer``,
``Phi3Attention`` (``qkv_proj``) / ``Phi3MLP`` (``gate_up_proj``), ``Olmo2DecoderLayer``
(norms after attention and MLP; ``q_norm`` over ``num_heads * head_dim``),
``GraniteModel`` / ``GraniteDecoderLayer`` (``embedding_multiplier``,
``residual_multiplier``, ``attention_multiplier``, ``logits_scaling``),
``Glm4DecoderLayer`` (``post_self_attn_layernorm``, ``post_mlp_layernorm``,
interleaved partial rotary), ``CohereDecoderLayer`` (one LayerNorm without bias feeding
attention and MLP in parallel, ``CohereLayerNorm`` q/k norm of shape
``[heads, head_dim]``, ``logit_scale``, interleaved RoPE), ``Starcoder2DecoderLayer``
(LayerNorm with bias, ``c_fc`` / ``c_proj`` MLP, ``use_bias``), ``GPT2Block`` (learned
positions ``wpe``, ``Conv1D`` weights stored ``[in, out]``, fused ``c_attn``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpage.errors import SpecError


@dataclass(frozen=True)
class Family:
    """How one ``model_type``'s decoder differs from Llama's.

    Attributes:
        model_type: the HF ``model_type``.
        norm: ``rms`` | ``rms_gemma`` (``x_hat * (1 + w)`` in float32) | ``layernorm``
            (weight and bias) | ``layernorm_nobias`` (Cohere: weight only).
        eps_keys: config keys of the norm epsilon, first present wins.
        block: ``pre`` (``x + attn(n1(x))``, ``x + mlp(n2(x))``) | ``sandwich``
            (Gemma-2/3, GLM-4: ``x + n2(attn(n1(x)))``, ``x + n4(mlp(n3(x)))``) |
            ``post`` (OLMo-2: ``x + n2(attn(x))``, ``x + n4(mlp(x))``) | ``parallel``
            (Cohere: ``x + attn(n1(x)) + mlp(n1(x))``).
        qk_norm: ``""`` | ``head`` (the family's norm of each head's q and k, weight
            ``[head_dim]``) | ``full`` (RMSNorm over the whole q / k projection) |
            ``head_ln`` (LayerNorm per head, weight ``[heads, head_dim]``); before RoPE.
        qk_norm_key: the config key that switches ``qk_norm`` on (None: always on).
        mlp: ``glu`` (``down(act(gate x) * up x)``) | ``fused_glu`` (the same with one
            ``gate_up_proj``, gate rows first) | ``plain`` (``down(act(up x))``) |
            ``moe`` (``kvpage.models.moe``) | ``none`` (Mamba-2: no MLP).
        fused_qkv: one ``qkv_proj`` instead of ``q_proj`` / ``k_proj`` / ``v_proj``.
        attn_bias_key, attn_bias_default: the config key switching the q/k/v/o biases
            and its default (None key: the default alone).
        qkv_bias, o_bias: a fixed answer overriding that key (Qwen2: q/k/v yes, o no).
        mlp_bias_key, mlp_bias_default: the same for the MLP.
        rope_interleaved: RoPE rotates pairs ``(2i, 2i + 1)`` (GLM-4, Cohere) instead of
            ``(i, i + rotary_dim / 2)``.
        learned_positions: a learned position embedding (GPT-2 ``wpe``) and no RoPE.
        embed_scale: ``""`` | ``sqrt_hidden`` (Gemma) | ``embedding_multiplier``
            (Granite: that config value).
        residual_multiplier: the block's outputs are scaled by the config's
            ``residual_multiplier`` before the residual add (Granite).
        logits: ``""`` | ``softcap`` (``final_logit_softcapping``) | ``divide``
            (``logits_scaling``, Granite) | ``multiply`` (``logit_scale``, Cohere).
        act_keys, act_default: config keys of the activation and its default.
        tie_default: ``tie_word_embeddings`` when the config leaves it out.
        renames: ``(hf_name, kvpage_name)`` templates of checkpoint keys (``{i}`` = a
            layer index); the first that matches a key's prefix applies.
        conv1d: kvpage weight names (suffixes) whose checkpoint tensor is stored
            transposed (GPT-2's ``Conv1D``: ``[in, out]``).
        sinks: attention sinks on every layer (gpt-oss).
        partial_rotary_default: ``partial_rotary_factor`` when the config leaves it out
            (GLM-4: 0.5, ``Glm4Config``; Qwen3-Next: 0.25).
        attn_output_gate: ``q_proj`` also yields a per-head output gate (each head's
            ``2 * head_dim`` rows: query then gate); the attention output is multiplied
            by ``sigmoid(gate)`` before ``o_proj`` (``Qwen3NextAttention``).
        recurrent: the layers are those of :func:`kvpage.specs.state.layer_mixers`
            (Mamba-2, Gated DeltaNet, attention), built by ``kvpage.models.hybrid``;
            ``block`` ``single`` there: ``x + op(input_layernorm(x))`` with one op per
            layer (the mixer, or the MLP on a mixer-less layer: Nemotron-H).
        rope: attention layers rotate q/k (Nemotron-H's have no positional encoding;
            Granite-4 hybrid's only with ``position_embedding_type: rope``).
        logit_scale_key: the config key of ``logits="multiply"`` (Falcon-H1:
            ``lm_head_multiplier``).
        skip_prefixes: checkpoint keys the model does not use (Qwen3-Next's multi-token
            prediction head ``mtp.*``, which transformers ignores at load too).
        attn: ``mha`` (q/k/v projections, K/V cache; GQA/MQA included) | ``mla``
            (multi-head latent attention, ``kvpage.models.mla``: a latent cache).
    """

    model_type: str
    norm: str = "rms"
    eps_keys: tuple[str, ...] = ("rms_norm_eps",)
    block: str = "pre"
    qk_norm: str = ""
    qk_norm_key: str | None = None
    mlp: str = "glu"
    fused_qkv: bool = False
    attn_bias_key: str | None = "attention_bias"
    attn_bias_default: bool = False
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias_key: str | None = None
    mlp_bias_default: bool = False
    rope_interleaved: bool = False
    learned_positions: bool = False
    embed_scale: str = ""
    residual_multiplier: bool = False
    logits: str = ""
    act_keys: tuple[str, ...] = ("hidden_act",)
    act_default: str = "silu"
    tie_default: bool = False
    renames: tuple[tuple[str, str], ...] = ()
    conv1d: tuple[str, ...] = ()
    sinks: bool = False
    partial_rotary_default: float = 1.0
    attn_output_gate: bool = False
    recurrent: bool = False
    rope: bool = True
    logit_scale_key: str = "logit_scale"
    skip_prefixes: tuple[str, ...] = ()
    attn: str = "mha"

    def biases(self, cfg: Mapping[str, Any]) -> tuple[bool, bool, bool]:
        """``(qkv_bias, o_bias, mlp_bias)`` of a config."""
        a = self.attn_bias_default
        if self.attn_bias_key is not None and cfg.get(self.attn_bias_key) is not None:
            a = bool(cfg[self.attn_bias_key])
        m = self.mlp_bias_default
        if self.mlp_bias_key is not None and cfg.get(self.mlp_bias_key) is not None:
            m = bool(cfg[self.mlp_bias_key])
        qkv = a if self.qkv_bias is None else self.qkv_bias
        o = a if self.o_bias is None else self.o_bias
        return qkv, o, m

    def has_qk_norm(self, cfg: Mapping[str, Any]) -> bool:
        """Whether a config's layers norm q and k (``qk_norm`` and its switch)."""
        if not self.qk_norm:
            return False
        return self.qk_norm_key is None or bool(cfg.get(self.qk_norm_key, False))

    def norm_eps(self, cfg: Mapping[str, Any]) -> float:
        """The norm epsilon (the first of ``eps_keys`` present, else 1e-6 / 1e-5)."""
        for k in self.eps_keys:
            if cfg.get(k) is not None:
                return float(cfg[k])
        return 1e-5 if self.norm.startswith("layernorm") else 1e-6

    def activation(self, cfg: Mapping[str, Any]) -> str:
        """The activation's HF name (``ACT2FN`` key)."""
        for k in self.act_keys:
            if cfg.get(k) is not None:
                return str(cfg[k])
        return self.act_default


_SANDWICH = ("input_layernorm", "post_attention_layernorm")
_GPT2_LAYER = "transformer.h.{i}."
_LAYER = "model.layers.{i}."

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", mlp_bias_key="mlp_bias"),
        Family("mistral"),
        Family("qwen2", qkv_bias=True, o_bias=False),
        Family(
            "gemma2",
            norm="rms_gemma",
            block="sandwich",
            embed_scale="sqrt_hidden",
            logits="softcap",
            act_keys=("hidden_activation",),
            act_default="gelu_pytorch_tanh",
            tie_default=True,
        ),
        Family("qwen3", qk_norm="head"),
        Family(
            "gemma3_text",
            norm="rms_gemma",
            block="sandwich",
            qk_norm="head",
            embed_scale="sqrt_hidden",
            logits="softcap",
            act_keys=("hidden_activation",),
            act_default="gelu_pytorch_tanh",
            tie_default=True,
        ),
        Family("phi3", fused_qkv=True, mlp="fused_glu", attn_bias_key=None),
        Family("olmo2", block="post", qk_norm="full"),
        Family(
            "granite",
            mlp_bias_key="mlp_bias",
            embed_scale="embedding_multiplier",
            residual_multiplier=True,
            logits="divide",
        ),
        Family(
            "glm4",
            block="sandwich",
            mlp="fused_glu",
            attn_bias_default=True,
            o_bias=False,
            rope_interleaved=True,
            partial_rotary_default=0.5,
            renames=(
                # Glm4DecoderLayer's names -> the sandwich slots (post-attention,
                # pre-MLP, post-MLP)
                (_LAYER + "post_self_attn_layernorm.", _LAYER + "post_attention_layernorm."),
                (_LAYER + "post_attention_layernorm.", _LAYER + "pre_feedforward_layernorm."),
                (_LAYER + "post_mlp_layernorm.", _LAYER + "post_feedforward_layernorm."),
            ),
        ),
        Family(
            "cohere",
            norm="layernorm_nobias",
            eps_keys=("layer_norm_eps",),
            block="parallel",
            qk_norm="head_ln",
            qk_norm_key="use_qk_norm",
            rope_interleaved=True,
            logits="multiply",
            tie_default=True,
        ),
        Family(
            "starcoder2",
            norm="layernorm",
            eps_keys=("norm_epsilon",),
            mlp="plain",
            attn_bias_key="use_bias",
            attn_bias_default=True,
            mlp_bias_key="use_bias",
            mlp_bias_default=True,
            act_default="gelu_pytorch_tanh",
            tie_default=True,
            renames=(
                (_LAYER + "mlp.c_fc.", _LAYER + "mlp.up_proj."),
                (_LAYER + "mlp.c_proj.", _LAYER + "mlp.down_proj."),
            ),
        ),
        Family(
            "gpt2",
            norm="layernorm",
            eps_keys=("layer_norm_epsilon",),
            mlp="plain",
            fused_qkv=True,
            attn_bias_key=None,
            attn_bias_default=True,
            mlp_bias_default=True,
            learned_positions=True,
            act_keys=("activation_function",),
            act_default="gelu_new",
            tie_default=True,
            renames=(
                ("transformer.wte.", "model.embed_tokens."),
                ("transformer.wpe.", "model.embed_positions."),
                ("transformer.ln_f.", "model.norm."),
                (_GPT2_LAYER + "ln_1.", _LAYER + "input_layernorm."),
                (_GPT2_LAYER + "ln_2.", _LAYER + "post_attention_layernorm."),
                (_GPT2_LAYER + "attn.c_attn.", _LAYER + "self_attn.qkv_proj."),
                (_GPT2_LAYER + "attn.c_proj.", _LAYER + "self_attn.o_proj."),
                (_GPT2_LAYER + "mlp.c_fc.", _LAYER + "mlp.up_proj."),
                (_GPT2_LAYER + "mlp.c_proj.", _LAYER + "mlp.down_proj."),
            ),
            conv1d=(
                "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ),
        ),
        Family("mixtral", mlp="moe"),
        Family("qwen3_moe", mlp="moe", qk_norm="head"),
        Family("gpt_oss", mlp="moe", attn_bias_default=True, sinks=True),
        # Qwen3NextDecoderLayer: Gated DeltaNet or gated attention, then the MLP (MoE
        # with a shared expert, or dense); every norm is the zero-centred (1 + w) one
        Family(
            "qwen3_next",
            norm="rms_gemma",
            qk_norm="head",
            mlp="moe",
            attn_output_gate=True,
            partial_rotary_default=0.25,
            recurrent=True,
            skip_prefixes=("mtp.",),
        ),
        # Mamba2Block: x + mixer(norm(x)), no MLP; Mamba2Model's names
        Family(
            "mamba2",
            eps_keys=("layer_norm_epsilon",),
            block="single",
            mlp="none",
            recurrent=True,
            renames=(
                ("backbone.embeddings.", "model.embed_tokens."),
                ("backbone.embedding.", "model.embed_tokens."),
                ("backbone.norm_f.", "model.norm."),
                ("backbone.layers.{i}.norm.", _LAYER + "input_layernorm."),
                ("backbone.layers.", "model.layers."),
            ),
        ),
        # NemotronHBlock: x + mixer(norm(x)), the mixer Mamba-2, attention without
        # positions, or a relu2 MLP (up/down)
        Family(
            "nemotron_h",
            eps_keys=("layer_norm_epsilon",),
            block="single",
            mlp="plain",
            attn_bias_key=None,
            mlp_bias_key="mlp_bias",
            act_keys=("mlp_hidden_act",),
            act_default="relu2",
            recurrent=True,
            rope=False,
            renames=(  # transformers' in-memory names, then the hub's backbone.*
                ("model.embeddings.", "model.embed_tokens."),
                ("model.norm_f.", "model.norm."),
                (_LAYER + "norm.", _LAYER + "input_layernorm."),
                ("model.layers.", "model.layers."),  # back to transformers: model.*
                ("backbone.embeddings.", "model.embed_tokens."),
                ("backbone.norm_f.", "model.norm."),
                ("backbone.layers.{i}.norm.", _LAYER + "input_layernorm."),
                ("backbone.layers.", "model.layers."),
            ),
        ),
        # GraniteMoeHybridDecoderLayer: x + rm * mixer(n1(x)) (Mamba-2 or attention),
        # x + rm * (moe(n2(x)) + shared_mlp(n2(x))); Granite's multipliers
        Family(
            "granitemoehybrid",
            mlp="moe",
            embed_scale="embedding_multiplier",
            residual_multiplier=True,
            logits="divide",
            recurrent=True,
            renames=(
                (_LAYER + "block_sparse_moe.router.", _LAYER + "mlp.gate."),
                (_LAYER + "block_sparse_moe.", _LAYER + "mlp."),
                (_LAYER + "shared_mlp.input_linear.", _LAYER + "shared_mlp.gate_up_proj."),
                (_LAYER + "shared_mlp.output_linear.", _LAYER + "shared_mlp.down_proj."),
            ),
        ),
        # FalconH1DecoderLayer: h = n1(x); x + m_ssm * mamba(h) + m_out * attn(m_in * h),
        # then x + mlp(n2(x)); its muP multipliers (kvpage.models.hybrid)
        Family(
            "falcon_h1",
            mlp_bias_key="mlp_bias",
            embed_scale="embedding_multiplier",
            logits="multiply",
            logit_scale_key="lm_head_multiplier",
            recurrent=True,
            renames=(
                ("model.final_layernorm.", "model.norm."),
                (_LAYER + "feed_forward.", _LAYER + "mlp."),
                (_LAYER + "pre_ff_layernorm.", _LAYER + "post_attention_layernorm."),
            ),
        ),
        # DeepseekV3DecoderLayer: pre-norm, MLA attention (kvpage.models.mla; its
        # q_a/kv_a projections and o_proj switch their biases by attention_bias), a
        # dense SwiGLU MLP on the first first_k_dense_replace layers, then the MoE
        Family("deepseek_v3", mlp="moe", attn="mla"),
    )
}


def family_of(cfg: Mapping[str, Any]) -> Family:
    """The row of a config's ``model_type``.

    Raises:
        SpecError: a model type without a row (check the architecture first:
            ``kvpage.specs.architectures.check_architecture``).
    """
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in FAMILIES:
        raise SpecError(f"config.model_type: expected one of {', '.join(FAMILIES)}, got {mt!r}")
    return FAMILIES[mt]


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)"))


def rename_weights(names: list[str], family: Family, to_kvpage: bool = True) -> dict[str, str]:
    """Checkpoint key -> kvpage key (or back, ``to_kvpage=False``) under the family's
    ``renames``; keys no template matches are kept."""
    pairs = [(a, b) if to_kvpage else (b, a) for a, b in family.renames]
    pats = [(_pattern(src), dst.replace("{i}", r"\1")) for src, dst in pairs]
    out: dict[str, str] = {}
    for n in names:
        new = n
        for pat, dst in pats:
            if pat.match(n):
                new = pat.sub(dst, n, count=1)
                break
        out[n] = new
    return out


def _mla_parameters(cfg: Mapping[str, Any], h: int, hq: int, bias: bool) -> int:
    """One ``DeepseekV3Attention``'s parameters: ``q_proj`` (or ``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj`` (the a-projections and ``o_proj`` with biases when
    ``attention_bias``)."""
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    r, v, q = int(cfg["kv_lora_rank"]), int(cfg["v_head_dim"]), cfg.get("q_lora_rank")
    qk = nope + rope
    n = h * q + (q if bias else 0) + q + q * hq * qk if q else h * hq * qk
    n += h * (r + rope) + (r + rope if bias else 0) + r + r * hq * (nope + v)
    return n + hq * v * h + (h if bias else 0)


def count_parameters(
    cfg: Mapping[str, Any],
    *,
    hidden: int,
    num_layers: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    moe_layers: int = 0,
    moe_layer_params: int = 0,
) -> int:
    """Parameters of a model of ``cfg``'s family (the modules ``kvpage.models`` builds
    from the same row, equal to transformers' count): embeddings (and learned
    positions), per layer q/k/v/o (+ biases), q/k norms, sinks, the block's norms
    (LayerNorm: + bias), the MLP (dense or ``moe_layer_params`` on ``moe_layers``
    layers), the final norm and the LM head unless tied."""
    fam = family_of(cfg)
    if fam.recurrent:
        raise SpecError(
            f"config.model_type: expected an attention-only family to count parameters "
            f"from the row, got {fam.model_type!r} (recurrent layers: count the model's)"
        )
    h, hq, hk, d, i = hidden, num_q_heads, num_kv_heads, head_dim, intermediate
    qkv_b, o_b, mlp_b = fam.biases(cfg)
    attn = 2 * h * hq * d + 2 * h * hk * d
    attn += (hq * d + 2 * hk * d if qkv_b else 0) + (h if o_b else 0)
    if fam.attn == "mla":
        attn = _mla_parameters(cfg, h, hq, qkv_b)
    if fam.has_qk_norm(cfg):
        attn += 2 * d if fam.qk_norm == "head" else (hq + hk) * d
    if fam.sinks:
        attn += hq
    norm = 2 * h if fam.norm == "layernorm" else h
    per_block = {"pre": 2, "sandwich": 4, "post": 2, "parallel": 1}[fam.block]
    if fam.mlp == "plain":
        mlp = 2 * h * i + (i + h if mlp_b else 0)
    else:
        mlp = 3 * h * i + (2 * i + h if mlp_b else 0)
    dense_layers = num_layers - moe_layers
    total = vocab * h + num_layers * (attn + per_block * norm) + norm
    total += dense_layers * mlp + moe_layers * moe_layer_params
    if fam.learned_positions:
        total += int(cfg.get("n_positions") or cfg.get("max_position_embeddings") or 0) * h
    if not bool(cfg.get("tie_word_embeddings", fam.tie_default)):
        total += vocab * h
    return total


__all__ = ["FAMILIES", "Family", "count_parameters", "family_of", "rename_weights"]
