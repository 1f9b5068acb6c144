"""Mixture-of-experts families (Mixtral, Qwen3-MoE, gpt-oss) against transformers.

Tiny random-weight models built offline from transformers' own config classes
(``CONFIG_MAPPING[model_type](**small sizes)``), several experts, top-k > 1, the
family's features switched on (Qwen3-MoE q/k norm and a dense layer, gpt-oss router
bias, expert biases, a SwiGLU clamp that binds, attention sinks, alternating
sliding/full layers with a window shorter than every prompt), saved with
``save_pretrained`` (the hub checkpoint layout) and loaded by kvpage. Greedy tokens of
the engine equal transformers' greedy tokens in float32 over several prompt lengths,
with chunked prefill (a token budget smaller than every prompt) and prefix-cache hits
(the rerun); the log-probability error of kvpage's tokens against transformers' is
bounded and printed. One case per family in the default run, the wider matrix under
``-m slow``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from family_harness import SMALL, check_family, check_layouts_agree, transformers

from kvpage.models.moe import MoEMLP, moe_weights_from_hf, moe_weights_to_hf

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

#: (model_type, features) in the default run: one per family
FAST: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # layer 1 keeps a dense MLP (Qwen3MoeDecoderLayer)
    ),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,  # layer 0 slides, layer 1 is full: window < every prompt
        swiglu_limit=0.6,  # binds: gate/up values reach ~±2 at these sizes
        rope_parameters=_DEFAULT_ROPE,  # plain RoPE here; its default yarn: test_models_families.py
    ),
}
#: the wider matrix (``-m slow``)
SLOW: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-window-top3": (
        "mixtral",
        dict(num_local_experts=8, num_experts_per_tok=3, sliding_window=6, num_hidden_layers=3),
    ),
    "qwen3_moe-unnormalised-sparse-step": (
        "qwen3_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            decoder_sparse_step=2,  # layers 1, 3 sparse; 0, 2 dense
            num_hidden_layers=4,
        ),
    ),
    "gpt_oss-4layers-top3": (
        "gpt_oss",
        dict(
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=3,
            swiglu_limit=1.0,
            num_hidden_layers=4,
            num_key_value_heads=1,
            rope_parameters=_DEFAULT_ROPE,
        ),
    ),
}


def check_moe_family(
    model_type: str, features: dict[str, Any], tmp_path: Path, backend: str = "auto"
) -> float:
    """:func:`family_harness.check_family` with a prefix-cache rerun, on a model whose
    layers have the MoE MLP."""
    return check_family(
        model_type,
        features,
        tmp_path,
        rounds=2,
        backend=backend,
        num_blocks=120,
        max_num_seqs=256,
        check_model=lambda m: any(isinstance(layer.mlp, MoEMLP) for layer in m.model.layers),
    )


@pytest.mark.parametrize("model_type", list(FAST))
def test_moe_family_greedy_equals_transformers(model_type: str, tmp_path: Path) -> None:
    check_moe_family(model_type, FAST[model_type], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_moe_family_matrix(case: str, tmp_path: Path) -> None:
    model_type, features = SLOW[case]
    check_moe_family(model_type, features, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "numba-cpu", "native-cpu"])
def test_gpt_oss_sinks_on_every_cpu_backend(backend: str, tmp_path: Path) -> None:
    """gpt-oss (attention sinks, sliding/full layers) token-equal on each backend that
    implements sinks."""
    check_moe_family("gpt_oss", FAST["gpt_oss"], tmp_path, backend=backend)


@pytest.mark.parametrize("model_type", list(FAST))
def test_in_memory_and_folder_layouts_agree(model_type: str, tmp_path: Path) -> None:
    """The in-memory transformers model (fused expert tensors) and its saved folder
    (the hub layout) load to the same kvpage weights; ``to_transformers`` writes them
    back in transformers' in-memory form (logits equal)."""
    a = check_layouts_agree(model_type, FAST[model_type], tmp_path)
    params = a.arch.moe
    assert params is not None
    round_trip = moe_weights_from_hf(moe_weights_to_hf(a.hf_state_dict(), params), params)
    own = a.hf_state_dict()
    assert round_trip.keys() == own.keys()
    assert all(torch.equal(round_trip[k], own[k]) for k in own)


def test_routing_rules_per_family() -> None:
    """The router's weights: Mixtral renormalises the softmax top-k, Qwen3-MoE only with
    norm_topk_prob, gpt-oss takes the softmax of the top-k logits (router bias added)."""
    from kvpage.models.moe import moe_params_from_hf

    torch.manual_seed(0)
    x = torch.randn(5, 8)
    for mt, extra in (
        ("mixtral", dict(num_local_experts=4)),
        ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=6, norm_topk_prob=False)),
        ("gpt_oss", dict(num_local_experts=4)),
    ):
        cfg = dict(model_type=mt, intermediate_size=6, num_experts_per_tok=2, **extra)
        params = moe_params_from_hf(cfg, 1)
        assert params is not None
        mlp = MoEMLP(8, params)
        with torch.no_grad():
            mlp.gate.weight.normal_()
            if mlp.gate.bias is not None:
                mlp.gate.bias.normal_()
        w, idx = mlp.route(x)
        logits = torch.nn.functional.linear(x, mlp.gate.weight, mlp.gate.bias)
        if mt == "gpt_oss":
            top = logits.topk(2, -1)
            torch.testing.assert_close(w, top.values.softmax(-1))
        else:
            top = logits.softmax(-1).topk(2, -1)
            expect = (
                top.values / top.values.sum(-1, keepdim=True) if mt == "mixtral" else top.values
            )
            torch.testing.assert_close(w, expect)
        assert torch.equal(idx, top.indices)


def test_moe_configs_refused_by_name() -> None:
    """top_k above the expert count, missing expert counts and a gpt-oss activation
    other than SiLU are refused by name; Qwen2-MoE (shared expert) stays refused."""
    from kvpage.errors import SpecError
    from kvpage.specs import CacheSpec

    base = {**SMALL, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}
    with pytest.raises(SpecError, match="num_experts_per_tok: expected <= 2 experts, got 3"):
        load_model_cfg(base)
    with pytest.raises(SpecError, match="config.num_local_experts: expected a value"):
        load_model_cfg({**SMALL, "model_type": "mixtral", "num_experts_per_tok": 2})
    with pytest.raises(SpecError, match="hidden_act: expected silu for gpt_oss"):
        load_model_cfg(
            {**SMALL, "model_type": "gpt_oss", "num_local_experts": 2, "num_experts_per_tok": 1,
             "hidden_act": "gelu", "rope_parameters": _DEFAULT_ROPE}
        )  # fmt: skip
    with pytest.raises(SpecError, match="qwen2_moe.*shared expert"):
        CacheSpec.from_hf_config({**SMALL, "model_type": "qwen2_moe", "num_experts": 4})


def load_model_cfg(cfg: dict[str, Any]) -> Any:
    from kvpage.models import ModelRunnerModel

    with torch.device("meta"):
        return ModelRunnerModel(cfg)


@pytest.mark.parametrize("case", [*FAST, *SLOW])
def test_parameter_count_and_plan(case: str, tmp_path: Path) -> None:
    """``kvpage plan``'s parameter count equals transformers' (every expert resident)
    and the cache spec has the family's layers (windows, sinks) — from the config
    alone."""
    from kvpage.capacity import estimate_num_parameters
    from kvpage.specs import CacheSpec, hf_config_dict

    mt, feats = (case, FAST[case]) if case in FAST else SLOW[case]
    torch.manual_seed(0)
    cfg = transformers.CONFIG_MAPPING[mt](**{**SMALL, **feats})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    d = hf_config_dict(cfg)
    assert estimate_num_parameters(d) == sum(p.numel() for p in hf.parameters())
    spec = CacheSpec.from_hf_config(d)
    assert all(a.sinks == (mt == "gpt_oss") for a in spec.layers)
    if mt == "gpt_oss":  # alternating sliding / full layers
        assert [a.sliding_window for a in spec.layers][:2] == [feats["sliding_window"], None]


def test_sink_model_refused_by_backends_without_sinks() -> None:
    """A gpt-oss cache spec (sinks on every layer) is refused by name by the GPU
    plugins (here on the CPU, where they otherwise run under their simulators)."""
    from kvpage.backends import backend_reasons
    from kvpage.specs import CacheSpec

    cfg = {**SMALL, **FAST["gpt_oss"], "model_type": "gpt_oss"}
    spec = CacheSpec.from_hf_config(cfg, num_blocks=16)
    for name in ("triton", "cupy", "numba"):
        why = backend_reasons(name, spec, "cpu")
        assert any("layers[0].sinks: expected no attention sinks" in w for w in why), why
    assert backend_reasons("torch", spec, "cpu") == []
