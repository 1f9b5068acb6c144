"""Reading model configs: Hugging Face ``config.json`` mappings and llama2.c headers.

The one reader of HF configs in kvpage: ``CacheSpec.from_hf_config`` (the cache
layout), ``kvpage.models`` (the architecture it runs) and capacity planning (a
``config.json`` path) all read them here. :func:`hf_attention_shape` is the single
source of layer count, head counts and ``head_dim``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpage.errors import SpecError
from kvpage.specs.architectures import PLAN_MODEL_TYPES, check_architecture
from kvpage.specs.state import attention_layer_ids, layer_mixers

#: model dtypes kvpage runs (the ``ModelDType`` values)
_DTYPES = ("float32", "float16", "bfloat16")
#: PretrainedConfig attributes computed at init that ``to_dict`` may leave out
_COMPUTED_KEYS = ("head_dim", "layer_types", "sliding_window", "rope_parameters")


def hf_config_dict(config: Any) -> dict[str, Any]:
    """An HF config as a plain ``config.json``-style dict.

    Args:
        config: a mapping (copied) or a ``transformers.PretrainedConfig`` (``to_dict()``
            plus the attributes computed at init: head_dim, layer_types, sliding_window,
            rope_parameters).

    Raises:
        SpecError: anything else.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        d = dict(config.to_dict())
        for k in _COMPUTED_KEYS:
            v = getattr(config, k, None)
            if v is not None:
                d[k] = v
        return d
    raise SpecError(f"config: expected a mapping or PretrainedConfig, got {type(config).__name__}")


def read_hf_config_file(path: str | Path, what: str = "config") -> dict[str, Any]:
    """Read an HF ``config.json`` file.

    Args:
        path: the file.
        what: how errors name it (e.g. ``"model llama/config.json"``).

    Raises:
        SpecError: unreadable, invalid JSON, or not a JSON object.
    """
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        why = f"invalid JSON ({e})" if isinstance(e, ValueError) else str(e)
        raise SpecError(f"{what}: expected a readable JSON config, got {why}") from None
    if not isinstance(cfg, dict):
        raise SpecError(
            f"{what}: expected a JSON object (HF config.json), got a JSON {type(cfg).__name__}"
        )
    return cfg


def dtype_from_config(cfg: Mapping[str, Any]) -> Any:
    """The model dtype a config names (``dtype``/``torch_dtype``), float32 when it names
    none or one kvpage does not run (a ``ModelDType``)."""
    raw = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    name = str(raw).removeprefix("torch.")
    return name if name in _DTYPES else "float32"


def _req(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise SpecError(f"config.{key}: expected a value, got nothing")
    return cfg[key]


#: HF config keys that must be positive ints when present (sizes, counts, lengths)
_INT_KEYS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
    "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
    "sliding_window", "n_layer", "n_head", "n_embd", "n_positions", "n_inner",
)  # fmt: skip
#: ... that must be finite positive numbers when present
_POSITIVE_KEYS = (
    "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta",
    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
)  # fmt: skip


def check_hf_numbers(cfg: Mapping[str, Any]) -> None:
    """Refuse a config whose sizes are not positive ints (``"64"``, ``256.7``, ``true``,
    ``-1``) or whose epsilons, RoPE base and soft caps are not finite positive numbers
    (``NaN``, ``Infinity`` — Python's JSON reader accepts both): a model built from them
    would run and emit garbage. Keys that are absent or null are left to the readers.

    Raises:
        SpecError: ``"config.<key>: expected ..., got ..."``.
    """
    for key in _INT_KEYS:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise SpecError(f"config.{key}: expected a positive integer, got {v!r}")
    for key in _POSITIVE_KEYS:
        v = cfg.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok or not math.isfinite(v) or v <= 0:
            raise SpecError(f"config.{key}: expected a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class HFAttentionShape:
    """Attention sizes of an HF config (GPT-2 and Llama-family key names).

    Attributes:
        model_type: the config's ``model_type``.
        num_layers: decoder layers.
        hidden_size: model width.
        num_q_heads, num_kv_heads: query and KV heads (KV = query heads without GQA).
        head_dim: ``head_dim`` when given, else ``hidden_size // num_q_heads``.
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def hf_attention_shape(cfg: Mapping[str, Any]) -> HFAttentionShape:
    """Read the attention sizes of an HF config (every model type of
    ``kvpage.specs.architectures.PLAN_MODEL_TYPES``; GPT-2's own key names).

    Raises:
        SpecError: another model_type, a missing size, or a width that is not a
            multiple of the head count (without an explicit ``head_dim``).
    """
    mt = cfg.get("model_type")
    if mt == "gpt2":
        check_hf_numbers(cfg)
        n_layers = int(_req(cfg, "n_layer"))
        heads = int(_req(cfg, "n_head"))
        hidden = int(_req(cfg, "n_embd"))
        if hidden % heads:
            raise SpecError(f"config.n_embd: expected a multiple of n_head={heads}, got {hidden}")
        return HFAttentionShape(mt, n_layers, hidden, heads, heads, hidden // heads)
    mt = check_architecture(cfg, PLAN_MODEL_TYPES)  # one line naming what is missing
    check_hf_numbers(cfg)
    mixers = layer_mixers(cfg)
    if mixers is not None and cfg.get("num_hidden_layers") is None:
        n_layers = len(mixers)  # Nemotron-H: one decoder layer per layers_block_type entry
    else:
        n_layers = int(_req(cfg, "num_hidden_layers"))
    heads = int(_req(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(_req(cfg, "hidden_size"))
    hd_raw = cfg.get("head_dim")
    if hd_raw is None:
        if hidden % heads:
            raise SpecError(
                f"config.hidden_size: expected a multiple of num_attention_heads={heads}, "
                f"got {hidden}"
            )
        hd_raw = hidden // heads
    return HFAttentionShape(mt, n_layers, hidden, heads, kv_heads, int(hd_raw))


def attention_layers_from_hf(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per-layer AttentionSpec fields from an HF ``config.json`` mapping (see
    ``CacheSpec.from_hf_config`` for the rules). A recurrent/hybrid model
    (``kvpage.specs.state``) gets one entry per attention decoder layer, in layer
    order (none for ``mamba2``)."""
    attn_ids = attention_layer_ids(cfg)
    if attn_ids == ():
        check_architecture(cfg, PLAN_MODEL_TYPES)
        return []
    if cfg.get("model_type") in MLA_MODEL_TYPES:
        check_architecture(cfg, PLAN_MODEL_TYPES)
        return mla_layers_from_hf(cfg)
    shape = hf_attention_shape(cfg)
    mt, n_layers, hd = shape.model_type, shape.num_layers, shape.head_dim
    heads, kv_heads = shape.num_q_heads, shape.num_kv_heads
    if mt == "gpt2":
        out = []
        for i in range(n_layers):
            scale = hd**-0.5 if cfg.get("scale_attn_weights", True) else 1.0
            if cfg.get("scale_attn_by_inverse_layer_idx", False):
                scale /= float(i + 1)
            out.append(dict(num_q_heads=heads, num_kv_heads=heads, head_dim=hd, scale=scale))
        return out
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    sliding: list[bool]
    if layer_types:
        if len(layer_types) != n_layers:
            raise SpecError(
                f"config.layer_types: expected {n_layers} entries, got {len(layer_types)}"
            )
        sliding = [t == "sliding_attention" for t in layer_types]
    elif mt == "mistral":
        sliding = [window is not None] * n_layers
    elif mt in ("mistral", "mixtral", "phi3", "starcoder2"):
        # MistralAttention, MixtralAttention, Phi3Attention, Starcoder2Attention:
        # config.sliding_window on every layer when set
        sliding = [window is not None] * n_layers
    elif mt in ("qwen2", "qwen3"):  # Qwen2Config / Qwen3Config.layer_types rule
        use = bool(cfg.get("use_sliding_window", False))
        mwl = int(cfg.get("max_window_layers", n_layers) or n_layers)
        sliding = [use and i >= mwl for i in range(n_layers)]
    elif mt in ("gemma2", "gpt_oss"):  # GptOssConfig too: even layers without layer_types
        sliding = [i % 2 == 0 for i in range(n_layers)]
    elif mt == "gemma3_text":  # Gemma3TextConfig: every sliding_window_pattern-th is full
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        sliding = [bool((i + 1) % pattern) for i in range(n_layers)]
    elif mt == "qwen3_moe":  # Qwen3MoeConfig: the window only with use_sliding_window
        sliding = [bool(cfg.get("use_sliding_window", False)) and window is not None] * n_layers
    else:
        sliding = [False] * n_layers
    if any(sliding) and not window:
        raise SpecError("config.sliding_window: expected a window for sliding layers, got None")
    scale = None
    cap = None
    if mt in ("gemma2", "gemma3_text"):  # Gemma2Attention / Gemma3Attention.scaling
        scale = float(cfg.get("query_pre_attn_scalar") or hd) ** -0.5
        # Gemma3Attention never passes attn_logit_softcapping to the attention (q/k
        # norm replaced it; transformers 5.23): only Gemma-2 caps the scores
        cap = cfg.get("attn_logit_softcapping") if mt == "gemma2" else None
    elif mt in ("granite", "granitemoehybrid") and cfg.get("attention_multiplier") is not None:
        scale = float(cfg["attention_multiplier"])  # GraniteAttention.scaling
    if attn_ids is not None:  # hybrid: only the attention layers hold KV
        sliding = [False] * len(attn_ids)
    return [
        dict(
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hd,
            scale=scale,
            sliding_window=int(window) if s and window else None,
            logits_soft_cap=float(cap) if cap else None,
            sinks=mt == "gpt_oss",  # GptOssAttention.sinks on every layer
        )
        for s in sliding
    ]


#: model types whose attention is MLA (multi-head latent attention): the same config
#: keys and softmax scale in transformers' DeepseekV2Attention and DeepseekV3Attention
#: (deepseek_v2 is planned only: kvpage does not run its routing and RoPE)
MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


def rope_parameters_of(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config: ``rope_parameters`` (transformers 5) or the
    older ``rope_scaling`` key, as a dict (empty when neither is set)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return dict(rp) if isinstance(rp, Mapping) else {}


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention-temperature factor ``0.1 * mscale * ln(factor) + 1`` (1 for
    ``factor <= 1``; Peng et al. 2023, arXiv:2309.00071; HF ``yarn_get_mscale`` in
    transformers/models/deepseek_v3/modeling_deepseek_v3.py)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg: Mapping[str, Any]) -> float:
    """The softmax scale of an MLA layer: ``qk_head_dim ** -0.5`` with ``qk_head_dim =
    qk_nope_head_dim + qk_rope_head_dim``, times ``yarn_mscale(factor,
    mscale_all_dim) ** 2`` when the RoPE type is not ``default`` and
    ``mscale_all_dim`` is set (HF ``DeepseekV3Attention.scaling`` /
    ``yarn_apply_mscale``)."""
    qk_head_dim = int(_req(cfg, "qk_nope_head_dim")) + int(_req(cfg, "qk_rope_head_dim"))
    scale = 1.0 / math.sqrt(qk_head_dim)
    rp = rope_parameters_of(cfg)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default" and rp.get("mscale_all_dim"):
        m = yarn_mscale(float(rp["factor"]), float(rp["mscale_all_dim"]))
        scale *= m * m
    return scale


def mla_layers_from_hf(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """AttentionSpec fields of every layer of an MLA config (``deepseek_v3``,
    ``deepseek_v2``): one KV
    head of ``head_dim = kv_lora_rank + qk_rope_head_dim`` (the cached latent), the
    config's query heads, :func:`mla_softmax_scale`. (HF's ``head_dim`` attribute of
    these configs is ``qk_rope_head_dim`` and is not read.)

    Raises:
        SpecError: a size missing or not a positive integer.
    """
    for key in ("num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):  # fmt: skip
        v = _req(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(f"config.{key}: expected a positive integer, got {v!r}")
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    layer = dict(
        num_q_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=1,
        head_dim=rank + rope,
        scale=mla_softmax_scale(cfg),
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )
    return [dict(layer) for _ in range(int(cfg["num_hidden_layers"]))]


def llama2c_header_to_hf(source: str | Path | bytes) -> dict[str, Any]:
    """Read a llama2.c header and return the equivalent HF Llama ``config.json`` fields.

    The sign of ``vocab_size`` flags a separate classifier (negative) versus one tied to
    the embedding (positive); ``tie_word_embeddings`` records it.
    """
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            raw = f.read(28)
    else:
        raw = bytes(source[:28])
    if len(raw) < 28:
        raise SpecError(f"llama2.c header: expected 28 bytes, got {len(raw)}")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = struct.unpack("<7i", raw)
    if min(dim, hidden, n_layers, n_heads, n_kv_heads, seq_len) <= 0 or vocab == 0:
        raise SpecError(
            "llama2.c header: expected positive sizes, got "
            f"dim={dim} hidden_dim={hidden} n_layers={n_layers} n_heads={n_heads} "
            f"n_kv_heads={n_kv_heads} vocab_size={vocab} seq_len={seq_len}"
        )
    return {
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "vocab_size": abs(vocab),
        "max_position_embeddings": seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": vocab > 0,
        "torch_dtype": "float32",
    }


__all__ = [
    "MLA_MODEL_TYPES",
    "HFAttentionShape",
    "mla_layers_from_hf",
    "mla_softmax_scale",
    "rope_parameters_of",
    "yarn_mscale",
    "attention_layers_from_hf",
    "dtype_from_config",
    "hf_attention_shape",
    "hf_config_dict",
    "llama2c_header_to_hf",
    "read_hf_config_file",
]
