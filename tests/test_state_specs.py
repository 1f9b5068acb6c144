"""The spec compiler's recurrent-state layers (kvpage.specs.state): layer kinds and
exact state bytes per family, checked against transformers' own config classes."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING

from kvpage.attention.state import StateCache
from kvpage.errors import ShapeError, SpecError
from kvpage.specs import CacheSpec
from kvpage.specs.hf import hf_config_dict
from kvpage.specs.state import layer_mixers, state_layers_from_hf


def _cfg(mt: str, **kw: object) -> dict[str, object]:
    return hf_config_dict(CONFIG_MAPPING[mt](**kw))


def test_qwen3_next_layers_and_bytes() -> None:
    cfg = _cfg("qwen3_next", num_hidden_layers=8)
    spec = CacheSpec.from_hf_config(cfg, dtype="bfloat16")
    # every 4th layer is full attention (Qwen3NextConfig default layer_types)
    assert spec.num_layers == 2 and len(spec.state_layers) == 6
    s = spec.state_layers[0]
    assert s.kind == "gated_deltanet" and s.layer_id == 0
    # conv_dim = 2 * 16 * 128 + 32 * 128; ssm = 32 heads x 128 x 128
    assert s.conv_dim == 2 * 16 * 128 + 32 * 128 and s.ssm_shape == (32, 128, 128)
    assert s.bytes == (s.conv_dim * 3 + 32 * 128 * 128) * 2
    assert spec.state_bytes_per_sequence == 6 * s.bytes
    assert spec.layers[0].head_dim == 256 and spec.layers[0].num_kv_heads == 2


def test_mamba2_has_no_attention_layers() -> None:
    cfg = _cfg("mamba2", num_hidden_layers=3, hidden_size=64, num_heads=8, head_dim=16,
               state_size=16, n_groups=2, expand=2)  # fmt: skip
    spec = CacheSpec.from_hf_config(cfg)
    assert spec.num_layers == 0 and spec.kv_groups == () and len(spec.state_layers) == 3
    s = spec.state_layers[2]
    assert (s.conv_dim, s.conv_kernel, s.ssm_shape) == (128 + 2 * 2 * 16, 4, (8, 16, 16))
    assert spec.bytes_per_token == 0


def test_nemotron_h_pattern_and_ssm_dtype() -> None:
    cfg = _cfg("nemotron_h", layers_block_type=["mamba", "moe", "attention", "mlp"])
    assert layer_mixers(cfg) == (("mamba2",), (), ("attention",), ())
    spec = CacheSpec.from_hf_config(cfg, dtype="bfloat16")
    assert spec.num_layers == 1 and [s.layer_id for s in spec.state_layers] == [0]
    s = spec.state_layers[0]
    assert s.dtype == "bfloat16" and s.ssm_dtype == "float32"  # mamba_ssm_cache_dtype
    assert s.ssm_shape == (128, 64, 128) and s.conv_dim == 128 * 64 + 2 * 8 * 128


def test_falcon_h1_has_both_mixers_per_layer() -> None:
    cfg = _cfg("falcon_h1", num_hidden_layers=2)
    spec = CacheSpec.from_hf_config(cfg)
    assert spec.num_layers == 2 and [s.layer_id for s in spec.state_layers] == [0, 1]
    assert spec.state_layers[0].conv_dim == 1024 + 2 * 1 * 256  # mamba_d_ssm


def test_granite_hybrid_scale_and_layers() -> None:
    cfg = _cfg("granitemoehybrid", num_hidden_layers=3,
               layer_types=["mamba", "attention", "mamba"], attention_multiplier=0.25)  # fmt: skip
    spec = CacheSpec.from_hf_config(cfg)
    assert spec.num_layers == 1 and spec.layers[0].scale == 0.25
    assert len(spec.state_layers) == 2


def test_bad_layer_list_is_refused_by_name() -> None:
    cfg = _cfg("qwen3_next", num_hidden_layers=4)
    cfg["layer_types"] = ["linear_attention", "full_attention", "conv"]
    with pytest.raises(SpecError, match="layer_types: expected 4 entries"):
        state_layers_from_hf(cfg)


def test_state_cache_copy_slots() -> None:
    cfg = _cfg("qwen3_next", num_hidden_layers=4, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
    spec = state_layers_from_hf(cfg)[0]
    sc = StateCache.allocate(spec, 3, torch.device("cpu"))
    assert tuple(sc.conv.shape) == (3, 2 * 2 * 8 + 4 * 8, 3)
    assert tuple(sc.ssm.shape) == (3, 4, 8, 8)
    sc.ssm[0].fill_(2.0)
    sc.copy_slots(torch.tensor([[0, 2]]))
    assert float(sc.ssm[2].sum()) == 2.0 * 4 * 8 * 8 and float(sc.ssm[1].sum()) == 0.0
    with pytest.raises(ShapeError, match="expected slots in"):
        sc.copy_slots(torch.tensor([[0, 3]]))
