"""Which model architectures kvpage runs, and one-line refusals for the others.

kvpage's KV cache holds, per attention layer, the keys and values of every token (paged
in blocks). Models whose layers keep something else cannot be served by it:

* **state-space / recurrent layers** other than Mamba-2 and Gated DeltaNet (Mamba-1,
  RWKV, Griffin): a fixed-size per-sequence recurrent state kvpage's models lack; the
  hybrids built on them (Jamba, Zamba, Bamba). Mamba-2 and Gated DeltaNet run, alone
  (``mamba2``) or beside attention (``qwen3_next``, ``nemotron_h``, ``granitemoehybrid``,
  ``falcon_h1``: ``kvpage.models.hybrid``, state slots of ``kvpage.specs.state``);
* **multi-head latent attention** (MLA) beyond DeepSeek-V3 (``deepseek_v3`` runs: its
  latent cache is ``AttentionSpec.kv_lora_rank``, ``kvpage.models.mla``): DeepSeek-V2's
  routing and RoPE, Kimi-K2's ``model_type``;
* **mixture-of-experts MLPs** beyond the families kvpage runs (Mixtral, Qwen3-MoE,
  gpt-oss, DeepSeek-V3, Qwen3-Next, Granite-4 hybrid: ``kvpage.models.moe``): Qwen2-MoE's
  shared expert with its gate and Nemotron-H's MoE layers are refused.

:func:`check_architecture` names the architecture and what is missing, so ``kvpage
plan``, ``generate`` and ``serve`` refuse such a ``config.json`` in one line before
anything else (parameter counting, weight loading) can fail in a misleading way. The
supported set is documented in docs/models.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpage.errors import SpecError
from kvpage.specs.state import RECURRENT_MODEL_TYPES

__all__ = [
    "MODEL_TYPES",
    "MLA_ARCH_TYPES",
    "MOE_MODEL_TYPES",
    "PLAN_MODEL_TYPES",
    "UNSUPPORTED_ARCHITECTURES",
    "check_architecture",
    "missing_features",
]

#: model types kvpage runs (``kvpage generate`` / ``serve`` / the ``LLM`` class)
MODEL_TYPES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "gemma2", "qwen3", "gemma3_text", "phi3", "olmo2",
    "granite", "glm4", "cohere", "starcoder2", "gpt2", "mixtral", "qwen3_moe", "gpt_oss",
    "qwen3_next", "mamba2", "nemotron_h", "granitemoehybrid", "falcon_h1", "deepseek_v3",
)  # fmt: skip
#: the MoE model types among them (``kvpage.models.moe``): their expert keys are expected
MOE_MODEL_TYPES: tuple[str, ...] = (
    "mixtral", "qwen3_moe", "gpt_oss", "qwen3_next", "granitemoehybrid", "deepseek_v3",
)  # fmt: skip
#: model types ``kvpage plan`` can size a cache for: every one kvpage runs, and the
#: recurrent/hybrid ones whose layers ``kvpage.specs.state`` lowers, and DeepSeek-V2
#: (its MLA cache layout is DeepSeek-V3's; its routing and RoPE do not run)
PLAN_MODEL_TYPES: tuple[str, ...] = (
    MODEL_TYPES + tuple(t for t in RECURRENT_MODEL_TYPES if t not in MODEL_TYPES) + ("deepseek_v2",)
)
#: model types with MLA attention (``kv_lora_rank`` and expert counts are their own keys)
MLA_ARCH_TYPES: tuple[str, ...] = ("deepseek_v3", "deepseek_v2")

_SSM = "SSM state (a per-sequence recurrent state instead of a KV cache)"
_HYBRID = "hybrid SSM state (Mamba layers beside the attention layers)"
_MLA = "MLA (multi-head latent attention: a compressed latent KV, kv_lora_rank)"
_MOE = "MoE (mixture-of-experts routing of this family)"
_MM = "multimodal input (a vision encoder and image tokens in the prompt)"

#: config keys that say a model routes over experts
_MOE_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")

#: known HF ``model_type`` -> what kvpage lacks to run it
UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    "mamba": f"Mamba {_SSM}",
    "falcon_mamba": f"Mamba {_SSM}",
    "rwkv": f"RWKV {_SSM}",
    "recurrent_gemma": "RG-LRU recurrent state beside the KV cache",
    "jamba": f"{_HYBRID} and {_MOE}",
    "zamba": _HYBRID,
    "zamba2": _HYBRID,
    "bamba": _HYBRID,
    "lfm2": "hybrid short-convolution state beside the attention layers",
    "deepseek_v2": (
        "DeepSeek-V2's MoE routing (softmax, group_limited_greedy) and RoPE layout (its "
        "MLA cache is planned by kvpage plan; deepseek_v3 runs)"
    ),
    "kimi_k2": f"{_MLA} and {_MOE}",
    "qwen2_moe": f"{_MOE} with a shared expert",
    "olmoe": _MOE,
    "granitemoe": _MOE,
    "phimoe": _MOE,
    "gemma3": f"{_MM}; its text decoder runs as model_type gemma3_text",
    "llava": _MM,
    "mllama": f"{_MM} and cross-attention layers",
    "qwen2_vl": f"{_MM} and M-RoPE (3-D rotary positions)",
    "qwen2_5_vl": f"{_MM} and M-RoPE (3-D rotary positions)",
    "paligemma": _MM,
    "idefics3": _MM,
    "cohere2": "Cohere-2's global layers without RoPE beside its sliding RoPE layers",
    "phi3small": "blocksparse attention and mup scalings (Phi-3-small)",
}


def missing_features(cfg: Mapping[str, Any]) -> str | None:
    """What an architecture outside the supported set needs, from its ``model_type``
    (:data:`UNSUPPORTED_ARCHITECTURES`) or, for an unknown one, from tell-tale config
    keys (``kv_lora_rank`` = MLA; ``ssm_state_size``/``state_size``/``mamba_d_state`` =
    SSM state; ``num_local_experts``/``n_routed_experts``/``num_experts`` = MoE); None
    when nothing is recognised."""
    mt = cfg.get("model_type")
    if isinstance(mt, str) and mt in UNSUPPORTED_ARCHITECTURES:
        return UNSUPPORTED_ARCHITECTURES[mt]
    found = []
    if cfg.get("kv_lora_rank"):
        found.append(_MLA)
    if any(cfg.get(k) for k in ("ssm_state_size", "state_size", "mamba_d_state", "d_state")):
        found.append(_SSM)
    if any(cfg.get(k) for k in _MOE_KEYS):
        found.append(_MOE)
    return " and ".join(found) or None


def _architecture_clash(arch: object, mt: str | None = None) -> str | None:
    """What an ``architectures`` entry of a known unsupported family (``JambaForCausalLM``
    -> ``jamba``) needs, or None: a config may carry a supported ``model_type`` beside
    such a class name, and the class is what transformers would build. A MoE class
    (``MixtralForCausalLM``) beside another ``model_type`` (``mt``) clashes too: the
    experts would be missing from the model kvpage builds."""
    if not isinstance(arch, list):
        return None
    families = {k.replace("_", ""): v for k, v in UNSUPPORTED_ARCHITECTURES.items()}
    for moe in MOE_MODEL_TYPES:
        if moe != mt:
            families.setdefault(moe.replace("_", ""), f"{_MOE} as {moe}")
    for a in arch:
        stem = str(a).lower()
        for suffix in ("forcausallm", "forconditionalgeneration", "lmheadmodel", "model"):
            stem = stem.removesuffix(suffix)
        if mt is not None and str(a).lower().endswith("forcausallm") and mt.startswith(stem):
            continue  # the family's own text class (Gemma3ForCausalLM of gemma3_text)
        if stem in families:
            return families[stem]
    return None


def check_architecture(cfg: Mapping[str, Any], supported: Sequence[str] = MODEL_TYPES) -> str:
    """Refuse a config whose ``model_type`` is not in ``supported``, in one line that
    names the architecture and what kvpage lacks to run it.

    Args:
        cfg: an HF ``config.json`` mapping.
        supported: the model types the caller handles (:data:`MODEL_TYPES` to run,
            :data:`PLAN_MODEL_TYPES` to plan).

    Returns:
        The ``model_type``.

    Raises:
        SpecError: ``"config.model_type: expected one of llama, ..., got 'jamba'
            (JambaForCausalLM): it needs hybrid SSM state ... and MoE ..., which kvpage
            does not implement (supported architectures: docs/models.md)"``; also for a
            supported ``model_type`` beside an ``architectures`` class of an unsupported
            family (``llama`` with ``JambaForCausalLM``) or tell-tale keys of one
            (``num_local_experts`` on a ``llama`` config).
    """
    mt = cfg.get("model_type")
    arch = cfg.get("architectures")
    if isinstance(mt, str) and mt in supported:
        if mt in RECURRENT_MODEL_TYPES:  # state sizes and experts are their own keys
            return mt
        rest = {k: v for k, v in cfg.items() if k != "model_type"}
        if mt in MOE_MODEL_TYPES or mt in MLA_ARCH_TYPES:  # this family's own keys
            rest = {k: v for k, v in rest.items() if k not in _MOE_KEYS}
        if mt in MLA_ARCH_TYPES:
            rest.pop("kv_lora_rank", None)
        clash = _architecture_clash(arch, mt) or missing_features(rest)
        if clash is None:
            return mt
        raise SpecError(
            f"config: model_type {mt!r} with architectures {arch!r}: it needs {clash}, which "
            "kvpage does not implement (supported architectures: docs/models.md)"
        )
    name = f" ({', '.join(map(str, arch))})" if isinstance(arch, list) and arch else ""
    got = f"{mt!r}{name}" if mt is not None else f"no model_type{name}"
    need = missing_features(cfg)
    why = f": it needs {need}, which kvpage does not implement" if need else ""
    raise SpecError(
        f"config.model_type: expected one of {', '.join(supported)}, got {got}{why} "
        "(supported architectures: docs/models.md)"
    )
