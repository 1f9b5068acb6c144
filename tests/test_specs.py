"""kvpage.specs: validation, byte arithmetic, HF config lowering, llama2.c header, presets."""

from __future__ import annotations

import json
import struct
from importlib import resources

import pytest

from kvpage.errors import SpecError
from kvpage.specs import (
    AttentionSpec,
    CacheSpec,
    list_presets,
    llama2c_header_to_hf,
    load_preset,
    make_attention_spec,
    make_cache_spec,
)
from kvpage.specs.state import attention_layer_ids

transformers = pytest.importorskip("transformers")

LAYER = dict(num_q_heads=8, num_kv_heads=2, head_dim=32)


# ---- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_q_heads=6, num_kv_heads=4, head_dim=8), "num_q_heads: expected a multiple"),
        (dict(num_q_heads=8, num_kv_heads=0, head_dim=8), "num_kv_heads"),
        (dict(num_q_heads=8, num_kv_heads=2, head_dim=0), "head_dim"),
        (dict(num_q_heads=8, num_kv_heads=2, head_dim=8, scale=-1.0), "scale: expected > 0"),
        (dict(num_q_heads=8, num_kv_heads=2, head_dim=8, sliding_window=0), "sliding_window"),
        (dict(num_q_heads=8, num_kv_heads=2, head_dim=8, logits_soft_cap=0.0), "logits_soft_cap"),
        (dict(num_q_heads=8, num_kv_heads=2, head_dim=8, bogus=1), "bogus"),
    ],
)
def test_attention_spec_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        make_attention_spec(**kwargs)


def test_attention_spec_defaults() -> None:
    a = make_attention_spec(num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert a.scale == pytest.approx(0.08838834764831845)  # 1/sqrt(128), not from head count
    assert a.num_queries_per_kv == 4 and a.sliding_window is None and a.logits_soft_cap is None
    assert make_attention_spec(num_q_heads=4, num_kv_heads=4, head_dim=8, scale=0.5).scale == 0.5
    with pytest.raises(Exception):  # frozen  # noqa: B017
        a.head_dim = 64  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_layers=2, layers=[LAYER]), "layers: expected num_layers=2 specs, got 1"),
        (dict(num_layers=1, layers=[LAYER], kv_dtype="int4"), "kv_dtype"),
        (dict(num_layers=1, layers=[LAYER], block_size=0), "block_size"),
        (dict(num_layers=1, layers=[LAYER], num_blocks=-1), "num_blocks"),
        (dict(num_layers=1, layers=[LAYER], dtype="float64"), "dtype"),
    ],
)
def test_cache_spec_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        make_cache_spec(**kwargs)


# ---- bytes --------------------------------------------------------------------------------
def test_bytes_per_token_and_block_hand_computed() -> None:
    # 3 layers x (K + V) x 2 kv heads x 32 head_dim x 2 bytes (float16) = 768 B/token
    s = make_cache_spec(
        num_layers=3, block_size=16, num_blocks=10, dtype="float16", layers=[LAYER] * 3
    )
    assert s.kv_element_bytes == 2
    assert s.layer_bytes_per_token(0) == 256
    assert s.bytes_per_token == 768
    assert s.bytes_per_block == 16 * 768 == 12288
    assert s.fixed_scale_bytes == 0 and s.total_bytes == 10 * 12288
    # int8: codes 2*2*32*1 = 128 + per-token float32 scales for K and V per kv head 2*2*4 = 16
    i8 = s.model_copy(update={"kv_dtype": "int8"})
    assert i8.layer_bytes_per_token(0) == 144 and i8.bytes_per_token == 432
    # fp8: 1 byte per element, plus fixed scales: K and V x float32 x (1 | num_kv_heads) per layer
    f8 = make_cache_spec(
        num_layers=3, block_size=16, num_blocks=10, kv_dtype="fp8_e4m3", layers=[LAYER] * 3
    )
    assert f8.bytes_per_token == 3 * 128 and f8.fixed_scale_bytes == 3 * 2 * 4
    assert f8.total_bytes == 10 * 16 * 384 + 24
    ph = make_cache_spec(
        num_layers=3,
        block_size=16,
        num_blocks=10,
        kv_dtype="fp8_e5m2",
        kv_scale_granularity="per_head",
        layers=[LAYER] * 3,
    )
    assert ph.fixed_scale_bytes == 3 * 2 * 2 * 4
    # float32 model dtype with auto kv
    f32 = make_cache_spec(num_layers=1, block_size=4, layers=[LAYER])
    assert f32.bytes_per_token == 2 * 2 * 32 * 4


def test_kv_groups_and_json_round_trip() -> None:
    layers = [dict(LAYER, sliding_window=w) for w in (8, None, 4, None, 8)]
    s = make_cache_spec(
        num_layers=5, block_size=4, num_blocks=3, layers=layers, kv_pool="per_group"
    )
    groups = [(g.group_id, g.layer_ids, g.sliding_window) for g in s.kv_groups]
    assert groups == [(0, (1, 3), None), (1, (2,), 4), (2, (0, 4), 8)]
    # unified: window groups split into groups of gcd(2, 1, 2) = 1 layer
    u = s.model_copy(update={"kv_pool": "unified"})
    groups = [(g.group_id, g.layer_ids, g.sliding_window) for g in u.kv_groups]
    assert groups == [(0, (1,), None), (1, (3,), None), (2, (2,), 4), (3, (0,), 8), (4, (4,), 8)]
    assert [u.layer_slot(i) for i in range(5)] == [0] * 5
    assert u.bytes_per_block == s.bytes_per_block // 5
    assert s.max_sliding_window is None
    assert CacheSpec.model_validate_json(s.to_json()) == s
    assert json.loads(s.to_json())["num_blocks"] == 3
    bigger = s.with_blocks(100, block_size=8)
    assert (bigger.num_blocks, bigger.block_size, s.num_blocks) == (100, 8, 3)
    with pytest.raises(SpecError):
        s.with_blocks(-1)


# ---- HF configs ---------------------------------------------------------------------------
def _rows(s: CacheSpec) -> list[tuple]:
    return [
        (
            a.num_q_heads,
            a.num_kv_heads,
            a.head_dim,
            round(a.scale, 6),
            a.sliding_window,
            a.logits_soft_cap,
        )
        for a in s.layers
    ]


def test_from_hf_llama_config() -> None:
    cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3
    )
    s = CacheSpec.from_hf_config(cfg, block_size=8, num_blocks=5)
    assert (s.num_layers, s.block_size, s.num_blocks) == (3, 8, 5)
    assert _rows(s) == [(8, 2, 32, round(32**-0.5, 6), None, None)] * 3
    assert len(s.kv_groups) == 1
    # the same fields as a plain config.json mapping give the same spec
    assert CacheSpec.from_hf_config(cfg.to_dict(), block_size=8, num_blocks=5) == s


def test_from_hf_mistral_config_slides_every_layer() -> None:
    cfg = transformers.MistralConfig(
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
        sliding_window=64,
    )
    s = CacheSpec.from_hf_config(cfg)
    assert [a.sliding_window for a in s.layers] == [64, 64]
    assert s.max_sliding_window == 64
    cfg_full = transformers.MistralConfig(
        hidden_size=256, num_attention_heads=8, num_hidden_layers=2, sliding_window=None
    )
    assert [a.sliding_window for a in CacheSpec.from_hf_config(cfg_full).layers] == [None, None]


def test_from_hf_qwen2_config_max_window_layers() -> None:
    cfg = transformers.Qwen2Config(
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=32,
        max_window_layers=2,
    )
    s = CacheSpec.from_hf_config(cfg)
    assert [a.sliding_window for a in s.layers] == [None, None, 32, 32]
    assert [(g.layer_ids, g.sliding_window) for g in s.kv_groups] == [((0, 1), None), ((2, 3), 32)]
    off = transformers.Qwen2Config(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4
    )
    assert all(a.sliding_window is None for a in CacheSpec.from_hf_config(off).layers)
    # a config.json mapping without layer_types follows the same rule
    raw = dict(
        model_type="qwen2",
        hidden_size=256,
        num_attention_heads=8,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=32,
        max_window_layers=3,
    )
    assert [a.sliding_window for a in CacheSpec.from_hf_config(raw).layers] == [None] * 3 + [32]


def test_from_hf_gemma2_config() -> None:
    cfg = transformers.Gemma2Config(
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=4,
        sliding_window=128,
        query_pre_attn_scalar=144,
        attn_logit_softcapping=50.0,
        dtype="bfloat16",
    )
    s = CacheSpec.from_hf_config(cfg)
    assert s.dtype == "bfloat16"
    # even layers slide; scale from query_pre_attn_scalar (1/12), not head_dim (1/8)
    assert (
        _rows(s)
        == [
            (8, 4, 64, round(1 / 12, 6), 128, 50.0),
            (8, 4, 64, round(1 / 12, 6), None, 50.0),
        ]
        * 2
    )
    assert [(g.layer_ids, g.sliding_window) for g in s.kv_groups] == [((1, 3), None), ((0, 2), 128)]
    d = transformers.Gemma2Config()  # library defaults (gemma-2-2b shapes)
    assert CacheSpec.from_hf_config(d).layers[0].scale == pytest.approx(
        d.query_pre_attn_scalar**-0.5
    )


def test_from_hf_gpt2_config() -> None:
    s = CacheSpec.from_hf_config(transformers.GPT2Config(n_embd=128, n_head=4, n_layer=2))
    assert _rows(s) == [(4, 4, 32, round(32**-0.5, 6), None, None)] * 2
    inv = transformers.GPT2Config(
        n_embd=128, n_head=4, n_layer=2, scale_attn_by_inverse_layer_idx=True
    )
    scales = [a.scale for a in CacheSpec.from_hf_config(inv).layers]
    assert scales == pytest.approx([32**-0.5, 32**-0.5 / 2])
    off = transformers.GPT2Config(n_embd=128, n_head=4, n_layer=1, scale_attn_weights=False)
    assert CacheSpec.from_hf_config(off).layers[0].scale == 1.0


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (dict(model_type="bert"), "model_type"),
        (dict(model_type="llama", num_attention_heads=8, hidden_size=64), "num_hidden_layers"),
        (
            dict(model_type="llama", num_hidden_layers=1, num_attention_heads=6, hidden_size=64),
            "hidden_size: expected a multiple",
        ),
        (
            dict(
                model_type="llama",
                num_hidden_layers=2,
                num_attention_heads=4,
                hidden_size=64,
                layer_types=["full_attention"],
            ),
            "layer_types: expected 2",
        ),
        (
            dict(
                model_type="llama",
                num_hidden_layers=1,
                num_attention_heads=4,
                hidden_size=64,
                layer_types=["sliding_attention"],
            ),
            "sliding_window",
        ),
        (
            dict(
                model_type="llama",
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=3,
                hidden_size=64,
            ),
            "num_q_heads",
        ),
        (dict(model_type="gpt2", n_layer=1, n_head=3, n_embd=64), "n_embd"),
        (42, "config: expected a mapping"),
    ],
)
def test_from_hf_config_errors(cfg: object, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        CacheSpec.from_hf_config(cfg)


# ---- llama2.c header and presets ----------------------------------------------------------
def test_llama2c_header_of_bundled_model() -> None:
    path = resources.files("kvpage") / "models" / "data" / "stories260K.bin"
    raw = path.read_bytes()[:28]
    assert struct.unpack("<7i", raw) == (64, 172, 5, 8, 4, 512, 512)
    cfg = llama2c_header_to_hf(raw)
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 512
    s = CacheSpec.from_llama2c_header(str(path), block_size=4, num_blocks=7)
    assert _rows(s) == [(8, 4, 8, round(8**-0.5, 6), None, None)] * 5
    # 5 layers x 2 x 4 kv heads x 8 head_dim x 4 bytes
    assert s.bytes_per_token == 1280 and s.bytes_per_block == 5120
    assert load_preset("stories260K").cache_spec(block_size=4, num_blocks=7) == s
    untied = struct.pack("<7i", 64, 172, 5, 8, 4, -512, 512)
    assert llama2c_header_to_hf(untied)["tie_word_embeddings"] is False
    with pytest.raises(SpecError, match="expected 28 bytes"):
        llama2c_header_to_hf(raw[:20])
    with pytest.raises(SpecError, match="positive sizes"):
        llama2c_header_to_hf(struct.pack("<7i", 64, 172, 0, 8, 4, 512, 512))


# bytes per token (all layers, K+V, bf16) from the published configs
PRESET_BYTES = {
    "llama-3-8b": 32 * 2 * 8 * 128 * 2,
    "mistral-7b": 32 * 2 * 8 * 128 * 2,
    "qwen2-7b": 28 * 2 * 4 * 128 * 2,
    "gemma-2-9b": 42 * 2 * 8 * 256 * 2,
    "stories260K": 5 * 2 * 4 * 8 * 4,
    "gpt-oss-120b": 36 * 2 * 8 * 64 * 2,
    "gpt-oss-20b": 24 * 2 * 8 * 64 * 2,
    # hybrids: the attention layers only
    "qwen3-next-80b-a3b": 12 * 2 * 2 * 256 * 2,
    "nemotron-h-8b": 4 * 2 * 8 * 128 * 2,
    "granite-4.0-h-tiny": 4 * 2 * 4 * 128 * 2,
    "gemma-3-27b": 62 * 2 * 16 * 128 * 2,
    "deepseek-v3": 61 * 576 * 2,  # MLA: one latent (kv_lora_rank 512 + rope 64) per token
}


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads(name: str) -> None:
    p = load_preset(name)
    assert p.name == name and p.num_parameters > 0 and p.max_model_len > 0
    s = p.cache_spec(num_blocks=4)
    attn = attention_layer_ids(p.hf_config)  # hybrids: only the attention layers
    n_layers = p.hf_config.get("num_hidden_layers", s.num_layers)
    assert s.num_layers == (n_layers if attn is None else len(attn))
    if name in PRESET_BYTES:
        assert s.bytes_per_token == PRESET_BYTES[name]


def test_required_presets_exist_and_unknown_fails() -> None:
    assert set(PRESET_BYTES) <= set(list_presets())
    assert [a.sliding_window for a in load_preset("mistral-7b").cache_spec().layers] == [4096] * 32
    g = load_preset("gemma-2-9b").cache_spec()
    assert [len(x.layer_ids) for x in g.kv_groups] == [21, 21]
    with pytest.raises(SpecError, match="preset"):
        load_preset("no-such-model")


def test_attention_spec_is_json_serialisable() -> None:
    a = AttentionSpec(num_q_heads=4, num_kv_heads=1, head_dim=16, sliding_window=8)
    assert AttentionSpec.model_validate_json(a.model_dump_json()) == a


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rms_norm_eps", float("nan")),
        ("rope_theta", -1.0),
        ("rope_theta", float("inf")),
        ("hidden_size", "64"),
        ("hidden_size", True),
        ("max_position_embeddings", 256.7),
        ("num_hidden_layers", -1),
    ],
)
def test_hf_config_numbers_are_checked(key, value):
    """A config with NaN/negative/non-integer numbers is refused by name instead of
    building a model that emits garbage (fresh-user finding: NaN rms_norm_eps ran)."""
    from kvpage.errors import SpecError
    from kvpage.models.config import arch_from_hf

    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        key: value,
    }
    with pytest.raises(SpecError, match=rf"config\.{key}: expected"):
        arch_from_hf(cfg)


@pytest.mark.parametrize(
    ("extra", "needs"),
    [
        ({"architectures": ["JambaForCausalLM"]}, "hybrid SSM state"),
        ({"architectures": ["MixtralForCausalLM"]}, "MoE"),
        ({"architectures": ["LlamaForCausalLM"], "num_local_experts": 8}, "MoE"),
        ({"architectures": ["LlamaForCausalLM"], "kv_lora_rank": 512}, "MLA"),
    ],
)
def test_supported_model_type_beside_an_unsupported_architecture_is_refused(extra, needs):
    from kvpage.specs.architectures import check_architecture

    cfg = {"model_type": "llama", **extra}
    with pytest.raises(SpecError, match=f"model_type 'llama' with architectures .*{needs}"):
        check_architecture(cfg)
    assert check_architecture({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


# ---- MLA (multi-head latent attention) ------------------------------------------------------
def test_mla_attention_spec_validation() -> None:
    a = make_attention_spec(
        num_q_heads=8, num_kv_heads=1, head_dim=40, kv_lora_rank=32, qk_rope_head_dim=8, scale=0.1
    )
    assert a.is_mla and a.value_dim == 32 and a.kv_planes == 1
    assert not make_attention_spec(num_q_heads=8, num_kv_heads=2, head_dim=16).is_mla
    with pytest.raises(SpecError, match="num_kv_heads: expected 1 for an MLA layer"):
        make_attention_spec(num_q_heads=8, num_kv_heads=2, head_dim=40, kv_lora_rank=32,
                            qk_rope_head_dim=8)  # fmt: skip
    with pytest.raises(
        SpecError, match="head_dim: expected kv_lora_rank \\+ qk_rope_head_dim = 40"
    ):
        make_attention_spec(num_q_heads=8, num_kv_heads=1, head_dim=32, kv_lora_rank=32,
                            qk_rope_head_dim=8)  # fmt: skip
    with pytest.raises(SpecError, match="qk_rope_head_dim: expected 0 without kv_lora_rank"):
        make_attention_spec(num_q_heads=8, num_kv_heads=1, head_dim=8, qk_rope_head_dim=8)


@pytest.mark.parametrize(
    ("kv_dtype", "per_token", "fixed"),
    [("auto", 40 * 4, 0), ("int8", 40 + 4, 0), ("fp8_e4m3", 40, 4)],
)
def test_mla_bytes_per_token(kv_dtype: str, per_token: int, fixed: int) -> None:
    cfg = {
        "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 4,
        "hidden_size": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "vocab_size": 100, "intermediate_size": 64,
    }  # fmt: skip
    s = CacheSpec.from_hf_config(cfg, kv_dtype=kv_dtype, num_blocks=5, block_size=4)  # type: ignore[arg-type]
    assert s.bytes_per_token == 3 * per_token
    assert s.fixed_scale_bytes == 3 * fixed
    assert s.total_bytes == 5 * 4 * 3 * per_token + 3 * fixed
    assert s.layers[0].scale == pytest.approx((16 + 8) ** -0.5)


def test_mla_scale_with_yarn_mscale() -> None:
    """HF DeepseekV3Attention.scaling: qk_head_dim ** -0.5 * yarn_get_mscale(40, 1) ** 2."""
    import math

    a = load_preset("deepseek-v3").cache_spec().layers[0]
    m = 0.1 * math.log(40) + 1.0
    assert a.scale == pytest.approx(192**-0.5 * m * m)
    assert (a.num_q_heads, a.num_kv_heads, a.head_dim, a.kv_lora_rank) == (128, 1, 576, 512)


def test_mla_deepseek_v2_is_planned_and_sliding_mla_refused() -> None:
    """DeepSeek-V2 has DeepSeek-V3's MLA keys and scale (DeepseekV2Attention): planned;
    running it is refused by name; a sliding window on an MLA layer is refused."""
    from kvpage.specs.architectures import MODEL_TYPES, check_architecture

    cfg = {
        "model_type": "deepseek_v2", "num_hidden_layers": 2, "num_attention_heads": 4,
        "hidden_size": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
    }  # fmt: skip
    s = CacheSpec.from_hf_config(cfg, dtype="bfloat16")
    assert s.bytes_per_token == 2 * 40 * 2 and s.layers[0].kv_lora_rank == 32
    with pytest.raises(SpecError, match="deepseek_v2.*group_limited_greedy"):
        check_architecture(cfg, MODEL_TYPES)
    with pytest.raises(SpecError, match="sliding_window: expected None on an MLA layer"):
        make_attention_spec(num_q_heads=4, num_kv_heads=1, head_dim=40, kv_lora_rank=32,
                            qk_rope_head_dim=8, sliding_window=16)  # fmt: skip
