"""DeepSeek-V3 (MLA attention + DeepSeek MoE) against transformers.

Tiny random-weight ``deepseek_v3`` models built offline from transformers'
``DeepseekV3Config`` (float32), saved with ``save_pretrained`` and loaded by kvpage's
loader: the latent cache (``kvpage.models.mla``), W_UK absorbed into the query, W_UV
after, interleaved RoPE on the rope part, ``noaux_tc`` routing with a non-zero
``e_score_correction_bias`` and group limiting, a shared expert, one dense layer
(``first_k_dense_replace=1``). Greedy tokens of the engine equal transformers' with
chunked prefill (a 7-token budget) and a prefix-cache rerun, on the torch and native-cpu
backends; the engine's pool holds exactly ``layers x (kv_lora_rank + qk_rope_head_dim)
x 4`` bytes per token slot.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from family_harness import PROMPTS, SMALL, check_family, make_hf, transformers

from kvpage.models.mla import MLAAttention
from kvpage.models.moe import MoEMLP

#: the sizes of every case: latent 16 + rope 8 = 24 elements per token and layer
BASE: dict[str, Any] = dict(
    head_dim=8,  # DeepseekV3Config.head_dim = qk_rope_head_dim (transformers' RoPE width)
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    moe_intermediate_size=20,
    n_shared_experts=1,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
    routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0,
}  # fmt: skip
#: the default run: q_a/q_b with plain RoPE; q_proj with yarn (its mscale ** 2 in the
#: softmax scale, DeepseekV3Attention.scaling)
CASES: dict[str, dict[str, Any]] = {
    "q_lora": dict(q_lora_rank=24),
    "q_proj-yarn": dict(q_lora_rank=None, rope_parameters=_YARN),
}
SLOW_CASES: dict[str, dict[str, Any]] = {
    "rotate_half-3layers": dict(q_lora_rank=24, rope_interleave=False, num_hidden_layers=3),
    "q_proj": dict(q_lora_rank=None),
}


def _bias(hf: Any) -> None:
    """A non-zero selection bias (zeros from init would not test it)."""
    for name, b in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))


def _is_deepseek(m: Any) -> bool:
    layers = m.model.layers
    return (
        all(isinstance(layer.self_attn, MLAAttention) for layer in layers)
        and not isinstance(layers[0].mlp, MoEMLP)
        and all(isinstance(layer.mlp, MoEMLP) for layer in layers[1:])
    )


def check_deepseek(features: dict[str, Any], tmp_path: Path, backend: str = "auto") -> float:
    return check_family(
        "deepseek_v3",
        {**BASE, **features},
        tmp_path,
        rounds=2,
        backend=backend,
        num_blocks=120,
        max_num_seqs=256,
        check_model=_is_deepseek,
        prepare=_bias,
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "backend", ["torch", "native-cpu", pytest.param("numba-cpu", marks=pytest.mark.slow)]
)
def test_deepseek_v3_greedy_equals_transformers(case: str, backend: str, tmp_path: Path) -> None:
    check_deepseek(CASES[case], tmp_path, backend)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_deepseek_v3_matrix(case: str, tmp_path: Path) -> None:
    check_deepseek(SLOW_CASES[case], tmp_path)


def test_pool_bytes_per_token_equal_the_formula(tmp_path: Path) -> None:
    """The engine's allocated cache: layers x (kv_lora_rank + qk_rope_head_dim) x 4
    bytes per token slot (float32), no V plane; int8 adds one float32 scale."""
    from kvpage.attention.metadata import kv_caches_nbytes
    from kvpage.engine import LLM, SamplingParams
    from kvpage.models import load_model

    hf = make_hf("deepseek_v3", {**BASE, **CASES["q_lora"]})
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    layers, d = 2, 16 + 8
    for kv_dtype, per in (("auto", d * 4), ("int8", d + 4)):
        llm = LLM(model, block_size=4, num_blocks=30, kv_cache_dtype=kv_dtype, backend="torch")
        spec = llm.llm_engine.kv_cache_manager.spec
        assert spec.bytes_per_token == layers * per
        caches = llm.llm_engine.runner.kv_caches
        assert [tuple(c.kv.shape) for c in caches] == [(1, 30, 4, 1, d)] * layers
        assert kv_caches_nbytes(caches) == 30 * 4 * layers * per == spec.total_bytes
    # every kv dtype runs end to end on the latent cache, every block free at the end
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for kv_dtype in ("int8", "fp8_e4m3"):
        llm = LLM(model, block_size=4, num_blocks=40, kv_cache_dtype=kv_dtype, backend="torch")
        outs = llm.generate(PROMPTS, params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4] * len(PROMPTS)
        mgr = llm.llm_engine.kv_cache_manager
        mgr.check_integrity()


def test_router_equals_transformers() -> None:
    """``MoEMLP.route`` (noaux_tc) picks transformers' experts with its weights."""
    from kvpage.models.moe import moe_params_from_hf
    from kvpage.specs import hf_config_dict

    cfg = transformers.CONFIG_MAPPING["deepseek_v3"](**{**SMALL, **BASE, "n_group": 4,
                                                         "topk_group": 2, "n_routed_experts": 12,
                                                         "num_experts_per_tok": 3})  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.normal_()
        hf.e_score_correction_bias.normal_()
    params = moe_params_from_hf(hf_config_dict(cfg), 2)
    assert params is not None and (params.n_group, params.topk_group) == (4, 2)
    mlp = MoEMLP(cfg.hidden_size, params)
    x = torch.randn(9, cfg.hidden_size)
    with torch.no_grad():
        mlp.gate.weight.copy_(hf.weight)
        mlp.gate.get_buffer("e_score_correction_bias").copy_(hf.e_score_correction_bias)
        _, w_hf, idx_hf = hf(x)
        w, idx = mlp.route(x)
    order_hf, order = idx_hf.sort(-1), idx.sort(-1)
    assert torch.equal(order.values, order_hf.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_hf.gather(1, order_hf.indices))


def test_parameter_count_and_plan() -> None:
    """``kvpage plan``'s count equals transformers' parameters plus the routers'
    ``e_score_correction_bias`` buffers (resident weights); the cache spec is MLA with
    transformers' softmax scale (``DeepseekV3Attention.scaling``)."""
    from kvpage.capacity import estimate_num_parameters
    from kvpage.specs import CacheSpec, hf_config_dict, load_preset

    for case in (*CASES.values(), *SLOW_CASES.values()):
        cfg = transformers.CONFIG_MAPPING["deepseek_v3"](**{**SMALL, **BASE, **case})
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(cfg)
        d = hf_config_dict(cfg)
        n_bias = sum(b.numel() for n, b in hf.named_buffers() if "e_score_correction" in n)
        assert estimate_num_parameters(d) == sum(p.numel() for p in hf.parameters()) + n_bias
        spec = CacheSpec.from_hf_config(d)
        a = spec.layers[0]
        assert (a.num_kv_heads, a.head_dim, a.kv_lora_rank) == (1, 24, 16)
        assert spec.num_layers == cfg.num_hidden_layers
        assert a.scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    pr = load_preset("deepseek-v3")
    assert estimate_num_parameters(pr.hf_config) == pr.num_parameters
    m = 0.1 * math.log(40) + 1
    assert pr.cache_spec().layers[0].scale == pytest.approx(192**-0.5 * m * m)


def test_in_memory_and_folder_layouts_agree(tmp_path: Path) -> None:
    """transformers' in-memory model (fused expert tensors, the router's selection
    bias buffer, shared experts) and its saved folder load to the same kvpage weights,
    and ``to_transformers`` writes them back (logits equal)."""
    from family_harness import check_layouts_agree

    a = check_layouts_agree("deepseek_v3", {**BASE, **CASES["q_lora"]}, tmp_path)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in a.state_dict()
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in a.state_dict()


def test_bfloat16_keeps_the_selection_bias_in_float32(tmp_path: Path) -> None:
    """A bf16 model keeps ``e_score_correction_bias`` in float32 (transformers'
    ``_keep_in_fp32_modules_strict``) and runs on the latent cache."""
    from kvpage.engine import LLM, SamplingParams
    from kvpage.models import load_model

    make_hf("deepseek_v3", {**BASE, **CASES["q_lora"]}).save_pretrained(tmp_path)
    m = load_model(tmp_path, dtype="bfloat16")
    gate = m.model.layers[1].mlp.gate
    assert gate.get_buffer("e_score_correction_bias").dtype == torch.float32
    assert gate.weight.dtype == torch.bfloat16
    llm = LLM(m, block_size=4, num_blocks=60, backend="torch")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_preemption_on_a_small_latent_pool(tmp_path: Path) -> None:
    """A pool of 9 usable blocks of 4 for three prompts (up to 29 tokens each):
    preemption and recompute over the latent cache, tokens still transformers', every
    block free at the end."""
    from family_harness import hf_greedy

    from kvpage.engine import LLM, SamplingParams
    from kvpage.models import load_model

    hf = make_hf("deepseek_v3", {**BASE, **CASES["q_lora"]})
    hf.save_pretrained(tmp_path)
    want = [hf_greedy(hf, p, 8)[0] for p in PROMPTS]
    llm = LLM(load_model(tmp_path), block_size=4, num_blocks=10, max_num_batched_tokens=7)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_metrics()["kvpage:num_preemptions_total"] >= 1
    mgr = llm.llm_engine.kv_cache_manager
    mgr.check_integrity()
    assert mgr.num_free_blocks == 9
