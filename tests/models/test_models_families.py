"""Dense families (Qwen3, Gemma-3, Phi-3, OLMo-2, Granite, GLM-4, Cohere, StarCoder2,
GPT-2) and RoPE variants (yarn, dynamic, longrope, partial rotary) against transformers.

Tiny random-weight models built offline from transformers' own config classes
(``CONFIG_MAPPING[model_type](**small sizes)``) with the family's features switched on
(q/k norms, windows shorter than the prompts, soft caps, multipliers, partial and
interleaved rotary, biases, learned positions), saved with ``save_pretrained`` (the
checkpoint's own weight names) and loaded by kvpage. The engine's greedy tokens equal
transformers' (no-cache full forwards) in float32 over three prompt lengths with
chunked prefill (a token budget of 7 splits every prompt); the log-probability error
of kvpage's tokens is bounded and printed. One case per family in the default run; the
wider matrix (more layers, windows, a second round that hits the prefix cache) under
``-m slow``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from family_harness import (
    GPT2_SMALL,
    SMALL,
    check_family,
    check_layouts_agree,
    transformers,
)

_LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],  # head_dim 16 -> 8 entries
    long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    original_max_position_embeddings=64,  # factor 512 / 64 = 8: attention factor > 1
)
_GEMMA3 = dict(
    query_pre_attn_scalar=24,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
    sliding_window=5,  # < every prompt
)

#: name -> (model_type, features): the default run, one per family and RoPE type
FAST: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", dict(attention_bias=True)),
    "gemma3_text": (
        "gemma3_text",
        dict(_GEMMA3, layer_types=["sliding_attention", "full_attention"]),
    ),
    "phi3-longrope": (  # Phi3Config reads the top-level original_max_position_embeddings
        "phi3",
        dict(rope_parameters=dict(_LONGROPE), original_max_position_embeddings=64),
    ),
    "olmo2": ("olmo2", {}),
    "granite": (
        "granite",
        dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.6,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        ),
    ),
    "glm4": ("glm4", {}),  # partial_rotary_factor 0.5, interleaved, q/k/v bias
    "cohere": ("cohere", dict(use_qk_norm=True, logit_scale=0.5)),
    "starcoder2": ("starcoder2", dict(sliding_window=5, norm_epsilon=1e-5)),
    "gpt2": ("gpt2", {}),
    "llama-yarn": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),  # fmt: skip
    "llama-dynamic": (
        "llama",
        dict(
            max_position_embeddings=24,  # prompts + tokens reach past it
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        ),
    ),
    "gpt_oss-yarn": (  # GptOssConfig's default rope_parameters: yarn, truncate false
        "gpt_oss",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5),
    ),
}
#: the wider matrix (``-m slow``)
SLOW: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-window": (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, num_hidden_layers=3),
    ),
    "gemma3_text-5to1": ("gemma3_text", dict(_GEMMA3, num_hidden_layers=6)),  # pattern 6
    "gemma3_text-scaled-global": (
        "gemma3_text",
        dict(
            _GEMMA3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            num_hidden_layers=3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "phi3-partial-window": (
        "phi3",
        dict(
            sliding_window=6,
            rope_parameters=dict(
                _LONGROPE,
                partial_rotary_factor=0.5,
                short_factor=[1.0, 1.2, 1.5, 2.0],
                long_factor=[1.0, 2.0, 4.0, 8.0],
            ),
            original_max_position_embeddings=64,
        ),
    ),  # fmt: skip
    "olmo2-mqa": ("olmo2", dict(num_key_value_heads=1, num_hidden_layers=3)),
    "granite-bias": ("granite", dict(attention_bias=True, mlp_bias=True, residual_multiplier=0.3)),
    "glm4-full-rotary": ("glm4", dict(partial_rotary_factor=1.0, num_hidden_layers=3)),
    "cohere-no-qk-norm": ("cohere", dict(use_qk_norm=False, logit_scale=0.25)),
    "starcoder2-no-bias": ("starcoder2", dict(use_bias=False, sliding_window=3)),
    "gpt2-3layers": ("gpt2", dict(n_layer=3, scale_attn_by_inverse_layer_idx=True)),
    "llama-longrope": ("llama", dict(rope_parameters=dict(_LONGROPE))),
}


@pytest.mark.parametrize("case", list(FAST))
def test_family_greedy_equals_transformers(case: str, tmp_path: Path) -> None:
    model_type, features = FAST[case]
    check_family(model_type, features, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", [*FAST, *SLOW])
def test_family_matrix_with_prefix_hits(case: str, tmp_path: Path) -> None:
    model_type, features = FAST[case] if case in FAST else SLOW[case]
    check_family(model_type, features, tmp_path, rounds=2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numba-cpu", "native-cpu"])
@pytest.mark.parametrize("case", ["gemma3_text", "glm4", "cohere", "gpt2", "phi3-longrope"])
def test_families_on_other_cpu_backends(case: str, backend: str, tmp_path: Path) -> None:
    """Windows, partial / interleaved RoPE, q/k norms and learned positions token-equal
    on the other CPU backends (their LayerOps and attention kernels)."""
    model_type, features = FAST[case]
    check_family(model_type, features, tmp_path, rounds=2, backend=backend)


@pytest.mark.parametrize("case", [*FAST, *SLOW])
def test_parameter_count_and_plan(case: str) -> None:
    """``kvpage plan``'s parameter count equals transformers' and the cache spec has
    the family's layers (windows, scale, soft cap) — from the config alone."""
    from kvpage.capacity import estimate_num_parameters
    from kvpage.specs import CacheSpec, hf_config_dict

    mt, feats = FAST[case] if case in FAST else SLOW[case]
    base = GPT2_SMALL if mt == "gpt2" else SMALL
    cfg = transformers.CONFIG_MAPPING[mt](**copy.deepcopy({**base, **feats}))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    d = hf_config_dict(cfg)
    assert estimate_num_parameters(d) == sum(p.numel() for p in hf.parameters()), case
    spec = CacheSpec.from_hf_config(d)
    layer_types = getattr(cfg, "layer_types", None)
    windows = [a.sliding_window for a in spec.layers]
    if layer_types is not None:
        w = getattr(cfg, "sliding_window", None)
        assert windows == [w if t == "sliding_attention" else None for t in layer_types]
    elif mt in ("starcoder2", "phi3"):
        assert windows == [feats.get("sliding_window")] * len(windows)
    else:
        assert windows == [None] * len(windows)
    if mt == "gemma3_text":  # Gemma3Attention ignores attn_logit_softcapping
        assert spec.layers[0].scale == pytest.approx(24**-0.5)
        assert spec.layers[0].logits_soft_cap is None
    if mt == "granite":
        assert spec.layers[0].scale == pytest.approx(cfg.attention_multiplier)


def test_position_dependent_rope_tables_follow_transformers() -> None:
    """dynamic / longrope rows past the pretraining length: the frequencies
    transformers computes for that sequence length (``ROPE_INIT_FUNCTIONS``), and yarn's
    frequencies and attention factor equal transformers'."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvpage.models.config import rope_params
    from kvpage.models.rope import RotaryEmbedding, rope_frequencies

    cases = {
        "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        "longrope": dict(_LONGROPE),
        "yarn": dict(rope_type="yarn", rope_theta=500.0, factor=8.0, beta_fast=16,
                     original_max_position_embeddings=32, truncate=False),
    }  # fmt: skip
    for kind, rp in cases.items():
        cfg = transformers.LlamaConfig(
            **{**SMALL, "max_position_embeddings": 48}, rope_parameters=rp
        )
        theta, scaling, rd = rope_params(hf_config_json(cfg), 16)
        rot = RotaryEmbedding(16, theta, 200, scaling, rd)
        for p in (0, 20, 47, 48, 63, 64, 65, 150):
            inv, att = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=p + 1)
            mine, my_att = rope_frequencies(16, theta, scaling, p + 1)
            torch.testing.assert_close(mine, inv, rtol=1e-6, atol=0)
            assert my_att == pytest.approx(att)
            if kind == "longrope" and p + 1 > 64 or kind == "dynamic" and p + 1 > 48:
                angle = p * inv
            elif kind == "longrope" or kind == "dynamic":
                angle = p * ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")[0]
            else:
                angle = p * inv
            want = torch.cat([angle, angle]).cos() * att
            torch.testing.assert_close(rot.cos_table[p], want, rtol=1e-5, atol=1e-6)


def hf_config_json(cfg: Any) -> dict[str, Any]:
    from kvpage.specs import hf_config_dict

    return hf_config_dict(cfg)


@pytest.mark.parametrize("case", list(FAST))
def test_in_memory_and_folder_layouts_agree(case: str, tmp_path: Path) -> None:
    """An in-memory transformers model and its saved folder load to the same kvpage
    weights; ``to_transformers`` writes them back under the family's names (logits
    equal)."""
    check_layouts_agree(*FAST[case], tmp_path)


def test_family_configs_refused_by_name() -> None:
    """What is still missing is named: multimodal Gemma-3, MLA, a bidirectional
    Gemma-3, an unknown rope type."""
    from kvpage.errors import SpecError
    from kvpage.specs import CacheSpec

    with pytest.raises(SpecError, match="gemma3.*multimodal.*gemma3_text"):
        CacheSpec.from_hf_config({"model_type": "gemma3"})
    with pytest.raises(SpecError, match="kimi_k2.*MLA"):
        CacheSpec.from_hf_config({"model_type": "kimi_k2", "kv_lora_rank": 512})
    with pytest.raises(SpecError, match="use_bidirectional_attention"):
        load_cfg({**SMALL, "model_type": "gemma3_text", "use_bidirectional_attention": True})
    with pytest.raises(SpecError, match="rope_type"):
        load_cfg({**SMALL, "model_type": "qwen3", "rope_scaling": {"rope_type": "mrope"}})


def load_cfg(cfg: dict[str, Any]) -> Any:
    from kvpage.models import ModelRunnerModel

    with torch.device("meta"):
        return ModelRunnerModel(cfg)


@pytest.mark.parametrize("case", list(FAST))
def test_kvpage_plan_of_each_family(case: str, tmp_path: Path) -> None:
    """``kvpage plan`` on the family's ``config.json``: exact KV bytes per token (the
    sum over the layers' K and V rows) and weight bytes from the parameter count."""
    from kvpage.capacity import plan_capacity

    mt, feats = FAST[case]
    base = GPT2_SMALL if mt == "gpt2" else SMALL
    cfg = transformers.CONFIG_MAPPING[mt](**copy.deepcopy({**base, **feats}))
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
    plan = plan_capacity(str(tmp_path / "config.json"), device_bytes="64MiB", dtype="float32")
    shape = (cfg.num_key_value_heads if mt != "gpt2" else cfg.n_head, 16)
    layers = cfg.num_hidden_layers if mt != "gpt2" else cfg.n_layer
    assert plan.bytes_per_token == layers * 2 * shape[0] * shape[1] * 4
    assert plan.weight_bytes == n * 4
