"""Random-weight Llama / Mistral / Qwen2 / Gemma-2: the paged forward of kvpage's own
model code equals transformers' forward with a contiguous cache (logits within 1e-4,
identical greedy tokens over 64 generated tokens, mixed-length batches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import PagedGreedyDriver, get_test_backend, hf_teacher_forced_logits

from kvpage.errors import SpecError
from kvpage.models import ByteTokenizer, HFTokenizer, load_model
from kvpage.specs import CacheSpec

transformers = pytest.importorskip("transformers")

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,  # default 0.02 gives near-tied logits
    bos_token_id=1,
    eos_token_id=2,
)

ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, rope_theta=500.0)),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, sliding_window=6),  # window < every prompt
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2, num_key_value_heads=1)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=5,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,  # small enough to bend the logits
            final_logit_softcapping=3.0,
        ),
    ),
}


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    cfg_name, model_name, extra = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # non-trivial norm weights and biases (HF initialises them to 1/0)
            if "norm" in name:
                base = 0.0 if arch == "gemma2" else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


PROMPTS = [
    [5, 17, 99, 3, 200, 41, 7, 8, 9, 10, 11, 12, 13],
    [250, 1, 33, 44, 55, 66, 77],
    list(range(30, 51)),
]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_paged_greedy_equals_transformers(arch: str) -> None:
    hf = make_hf_model(arch)
    model = load_model(hf)
    assert model.config["model_type"] == arch
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    d = PagedGreedyDriver(model, get_test_backend(), block_size=4, num_blocks=64, seed=3)
    d.add(PROMPTS[0])  # one-shot prefill
    d.add(PROMPTS[1], chunk=3)  # chunked prefill mixed with decodes
    d.add(PROMPTS[2], chunk=8, arrival=5)  # joins while the others decode
    d.run(64)
    for s in d.seqs:
        ref = hf_teacher_forced_logits(hf, s.tokens, s.prompt_len)
        got = torch.stack(s.logits)
        assert got.shape == (64, 256)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        # HF's greedy choice after every prefix equals ours, so HF greedy decoding
        # produces the same 64 tokens
        assert ref.argmax(-1).tolist() == s.tokens[s.prompt_len :]
        top2 = ref.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # equality is not luck of a tie


@pytest.mark.parametrize(("arch", "block_size"), [("mistral", 1), ("gemma2", 16), ("llama", 64)])
def test_block_size_does_not_change_logits(arch: str, block_size: int) -> None:
    hf = make_hf_model(arch, seed=5)
    model = load_model(hf)
    num_blocks = 3 * (-(-(len(PROMPTS[2]) + 16) // block_size)) + 1
    d = PagedGreedyDriver(model, get_test_backend(), block_size, num_blocks, seed=block_size)
    d.add(PROMPTS[2], chunk=5)
    d.add(PROMPTS[1])
    d.add(PROMPTS[0], chunk=2, arrival=2)
    d.run(16)
    for s in d.seqs:
        ref = hf_teacher_forced_logits(hf, s.tokens, s.prompt_len)
        torch.testing.assert_close(torch.stack(s.logits), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cache_spec_from_config(arch: str) -> None:
    hf = make_hf_model(arch)
    model = load_model(hf)
    spec = model.cache_spec(block_size=8, num_blocks=10, kv_dtype="fp8_e4m3")
    assert spec == CacheSpec.from_hf_config(
        hf.config, block_size=8, num_blocks=10, kv_dtype="fp8_e4m3", dtype="float32"
    )
    groups = spec.kv_groups
    assert model.num_kv_groups == len(groups)
    if arch == "gemma2":
        assert [a.sliding_window for a in spec.layers] == [5, None, 5, None]
        assert spec.layers[0].scale == pytest.approx(24**-0.5)
        assert spec.layers[0].logits_soft_cap == 2.0
        assert model.layer_groups == [1, 0, 1, 0]
    if arch == "mistral":
        assert all(a.sliding_window == 6 for a in spec.layers)


ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,  # puts head_dim 16's bands on all 3 sides
        "rope_theta": 500.0,
    },
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_scaled_rope_equals_transformers(rope: str) -> None:
    hf = make_hf_model("llama", seed=4, rope_parameters=dict(ROPES[rope]))
    model = load_model(hf)
    assert model.arch.rope_scaling is not None
    assert model.arch.rope_scaling["rope_type"] == rope
    d = PagedGreedyDriver(model, get_test_backend(), block_size=8, num_blocks=24, seed=2)
    d.add(PROMPTS[2], chunk=6)
    d.add(PROMPTS[0])
    d.run(40)  # positions up to 60
    for s in d.seqs:
        ref = hf_teacher_forced_logits(hf, s.tokens, s.prompt_len)
        torch.testing.assert_close(torch.stack(s.logits), ref, atol=1e-4, rtol=0)


def test_rope_config_forms() -> None:
    from kvpage.models.config import rope_of, rope_params

    assert rope_of({"rope_theta": 5e5, "rope_scaling": None}) == (5e5, None)
    assert rope_of({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}) == (7.0, None)
    theta, sc = rope_of({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert theta == 1e4 and sc is not None
    assert sc["rope_type"] == "linear" and sc["factor"] == 2.0
    with pytest.raises(SpecError, match="factor"):
        rope_of({"rope_scaling": {"rope_type": "linear"}})
    with pytest.raises(SpecError, match="partial_rotary_factor"):
        rope_params({"partial_rotary_factor": 0.3}, 10)  # int(3.0): odd
    with pytest.raises(SpecError, match="rope_type"):
        rope_of({"rope_scaling": {"rope_type": "mrope"}})
    with pytest.raises(SpecError, match="long_factor"):
        rope_params({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, 16)
    assert rope_params({"partial_rotary_factor": 0.5}, 16)[2] == 8
    # Gemma-3: one entry per layer type
    per_type = {
        "model_type": "gemma3_text",
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert rope_params(per_type, 16, "sliding_attention") == (1e4, None, 16)
    assert rope_params(per_type, 16)[1]["factor"] == 8.0  # type: ignore[index]
    # an old Gemma-3 config.json: rope_scaling scales the global layers only
    old = {"model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    assert rope_params(old, 16, "sliding_attention") == (1e4, None, 16)
    assert rope_params(old, 16)[0] == 1e6
    assert rope_params(old, 16)[1]["factor"] == 8.0  # type: ignore[index]


def test_hf_folder_round_trip(tmp_path: Path) -> None:
    hf = make_hf_model("llama", seed=1)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert isinstance(model.tokenizer, ByteTokenizer)
    ref = load_model(hf)
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_hf_folder_with_tokenizer(tmp_path: Path) -> None:
    from test_models_tokenizer import _tiny_hf_tokenizer

    hf = make_hf_model("qwen2", seed=2)
    hf.save_pretrained(tmp_path)
    _tiny_hf_tokenizer().save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="bfloat16")
    assert isinstance(model.tokenizer, HFTokenizer)
    assert model.dtype == torch.bfloat16
    assert model.tokenizer.decode(model.tokenizer.encode("a cat")) == "a cat"


def test_unsupported_configs_are_refused(tmp_path: Path) -> None:
    hf = make_hf_model("llama")
    hf.config.rope_parameters = {"rope_type": "mrope", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(SpecError, match="rope"):
        load_model(hf)
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(SpecError, match="model_type"):
        load_model(tmp_path)
    with pytest.raises(SpecError, match="config.json"):
        load_model(tmp_path / "..")


def test_hf_folder_bare_tokenizer_json_and_eos_list(tmp_path: Path) -> None:
    from test_models_tokenizer import _tiny_hf_tokenizer

    hf = make_hf_model("llama", seed=2, eos_token_id=[2, 3])
    hf.save_pretrained(tmp_path)
    _tiny_hf_tokenizer().backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    model = load_model(tmp_path)
    tok = model.tokenizer
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 2 and tok.stop_token_ids == (2, 3)
    assert tok.decode(tok.encode("a cat", bos=False)) == "a cat"
    # without a tokenizer: bytes, and every EOS id of the config stops
    byte_tok = load_model(hf).tokenizer
    assert isinstance(byte_tok, ByteTokenizer) and byte_tok.stop_token_ids == (2, 3)


def test_weights_are_copied_and_forward_checks_inputs() -> None:
    from kvpage.attention.metadata import AttentionMetadata
    from kvpage.errors import ShapeError

    hf = make_hf_model("gemma2", seed=6)
    model = load_model(hf)
    before = model.model.embed_tokens.weight.clone()
    with torch.no_grad():
        hf.model.embed_tokens.weight.add_(1.0)
    assert torch.equal(model.model.embed_tokens.weight, before)
    d = PagedGreedyDriver(model, get_test_backend(), block_size=4, num_blocks=8, seed=0)
    meta = get_test_backend().plan(AttentionMetadata.build([2], [2], [[1]], 4))
    args = (torch.tensor([3, 4]), torch.tensor([0, 1]), d.caches)
    with pytest.raises(ShapeError, match="plans"):
        model(*args, [meta], get_test_backend(), torch.tensor([1]))  # gemma2 has 2 groups
    with pytest.raises(ShapeError, match="kv_caches"):
        model(args[0], args[1], d.caches[:1], [meta, meta], get_test_backend(), torch.tensor([1]))
    with pytest.raises(ShapeError, match="positions"):
        model(args[0], args[1][:1], d.caches, [meta, meta], get_test_backend(), torch.tensor([1]))
    # nothing was written by the refused calls
    assert all(torch.isnan(c.kv).all() for c in d.caches)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_to_transformers_round_trip(arch: str) -> None:
    from kvpage.models import to_transformers

    hf = make_hf_model(arch, seed=8)
    back = to_transformers(load_model(hf))
    assert type(back) is type(hf)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
