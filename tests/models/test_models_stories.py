"""stories260K: llama2.c loader, golden greedy text, paged forward equals HF Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import (
    PagedGreedyDriver,
    ReferenceAdapter,
    get_test_backend,
    hf_teacher_forced_logits,
)

from kvpage.errors import SpecError
from kvpage.models import (
    Llama2cTokenizer,
    ModelRunnerModel,
    bundled_model_path,
    load_model,
    read_llama2c,
)
from kvpage.models.llama2c import halves_permutation, permute_rope_rows
from kvpage.specs import CacheSpec

# Greedy decoding from BOS, 200 positions, decoded with tok512.bin. The first sentences
# are what /work/shared/models/stories260K/README.md states for llama2.c's test_all.py;
# the whole string is our golden output (the HF cross-check below proves the math).
GOLDEN = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in "
    "the park. One day, she saw a big, red ball. She wanted to play with it, but it was "
    "too high.\nLily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't "
    'know what to do. She said, "I want to play with your ball, but I can\'t find it."\n'
    "Lily was sad and didn't know what to do. She said, \"I'm sorry, Lily. I didn't know "
    "what to do.\"\nLily didn't want to help her mom, so"
)


@pytest.fixture(scope="module")
def stories() -> ModelRunnerModel:
    return load_model("stories260K")


def test_bundled_files_and_config(stories: ModelRunnerModel) -> None:
    path = bundled_model_path()
    assert path.is_file() and path.stat().st_size == 1_056_540
    cfg = stories.config
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 172, 5)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
        8,
        4,
        512,
    )
    assert stories.lm_head is None  # positive vocab_size: classifier tied to the embedding
    assert isinstance(stories.tokenizer, Llama2cTokenizer)
    tensors = [*stories.parameters(), *stories.buffers()]
    assert all(t.device.type == "cpu" and not t.requires_grad for t in tensors)
    n_params = sum(p.numel() for p in stories.parameters())
    assert n_params == 260_032  # README: parameters counting the tied embedding once


def test_rope_permutation() -> None:
    assert halves_permutation(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    # adjacent-pair RoPE on x equals rotate-half RoPE on the permuted x
    hd, pos, theta = 8, 5, 10000.0
    x = torch.randn(2 * hd)
    w = torch.eye(2 * hd)
    freqs = pos * theta ** (-torch.arange(0, hd, 2).float() / hd)
    pairs = x.view(2, hd // 2, 2)
    adj = torch.stack(
        [
            pairs[..., 0] * freqs.cos() - pairs[..., 1] * freqs.sin(),
            pairs[..., 0] * freqs.sin() + pairs[..., 1] * freqs.cos(),
        ],
        -1,
    ).reshape(2, hd)
    xp = (permute_rope_rows(w, 2) @ x).view(2, hd)
    c, s = torch.cat([freqs, freqs]).cos(), torch.cat([freqs, freqs]).sin()
    half = torch.cat([-xp[:, hd // 2 :], xp[:, : hd // 2]], -1)
    assert torch.allclose(xp * c + half * s, adj[:, halves_permutation(hd)], atol=1e-6)


def test_greedy_from_bos_is_golden(stories: ModelRunnerModel) -> None:
    d = PagedGreedyDriver(stories, get_test_backend(), block_size=16, num_blocks=16, seed=1)
    d.add([stories.tokenizer.bos_id or 1])
    d.run(199)
    ids = d.seqs[0].tokens
    assert not set(ids[1:]) & set(stories.tokenizer.stop_token_ids)
    text = stories.tokenizer.decode(ids)
    assert text.startswith(
        "Once upon a time, there was a little girl named Lily. She loved to play outside "
        "in the park."
    )
    assert text == GOLDEN
    pytest.importorskip("transformers")
    from kvpage.models import to_transformers

    # transformers' own generate (contiguous cache) on the converted weights agrees
    hf = to_transformers(stories)
    out = hf.generate(
        torch.tensor([ids[:1]]),
        max_new_tokens=199,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out[0].tolist() == ids


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_paged_mixed_batch_equals_transformers(stories: ModelRunnerModel, backend: str) -> None:
    pytest.importorskip("transformers")
    from kvpage.models import to_transformers

    hf = to_transformers(stories)
    tok = stories.tokenizer
    be = get_test_backend() if backend == "torch" else ReferenceAdapter()
    d = PagedGreedyDriver(stories, be, block_size=4, num_blocks=160, seed=7)
    d.add(tok.encode("Once upon a time, there was a boy"), chunk=3)
    d.add(tok.encode("Lily liked cats."), arrival=4)
    d.add([1])
    d.run(64)
    for s in d.seqs:
        ref = hf_teacher_forced_logits(hf, s.tokens, s.prompt_len)
        got = torch.stack(s.logits)
        assert got.shape == (64, 512)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist() == s.tokens[s.prompt_len :]


def test_cache_spec_matches_header(stories: ModelRunnerModel) -> None:
    spec = stories.cache_spec(block_size=16, num_blocks=32)
    assert spec == CacheSpec.from_hf_config(stories.config, block_size=16, num_blocks=32)
    assert spec == CacheSpec.from_llama2c_header(bundled_model_path(), block_size=16, num_blocks=32)
    assert spec.layers[0].num_q_heads == 8 and spec.layers[0].head_dim == 8
    assert stories.cache_spec(kv_dtype="int8").kv_dtype == "int8"


def test_llama2c_file_errors(tmp_path: Path) -> None:
    raw = bundled_model_path().read_bytes()
    short = tmp_path / "short.bin"
    short.write_bytes(raw[:-4])
    with pytest.raises(SpecError, match="bytes"):
        read_llama2c(short)
    with pytest.raises(SpecError, match="expected a file"):
        read_llama2c(tmp_path / "missing.bin")
    # a .bin path loads too (vocab 512 without a tokenizer.bin beside it: the bundled one)
    (tmp_path / "m.bin").write_bytes(raw)
    m = load_model(tmp_path / "m.bin")
    assert m.tokenizer.encode("Once") == [1, 403]


def test_load_model_errors() -> None:
    with pytest.raises(SpecError, match="stories260K"):
        load_model("no-such-model")
    with pytest.raises(SpecError, match="dtype"):
        load_model("stories260K", dtype="float64")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="model"):
        load_model(42)


def test_half_precision_load(stories: ModelRunnerModel) -> None:
    m = load_model("stories260K", dtype="bfloat16")
    assert m.dtype == torch.bfloat16 and m.cache_spec().dtype == "bfloat16"
    assert m.rotary.inv_freq.dtype == torch.float32
    d = PagedGreedyDriver(m, get_test_backend(), block_size=16, num_blocks=8, seed=0)
    d.add(m.tokenizer.encode("Once upon a time"))
    d.run(4)
    assert torch.isfinite(torch.stack(d.seqs[0].logits)).all()


def test_rotary_tables_grow_on_demand() -> None:
    from kvpage.models.layers import RotaryEmbedding

    rot = RotaryEmbedding(8, 10000.0, max_positions=4)
    pos = torch.tensor([0, 3, 9])
    cos, sin = rot(pos, torch.float32, 9)
    assert rot.cos_table.shape[0] >= 10
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    ang = pos[:, None].float() * torch.cat([inv, inv])[None, :]
    assert cos.shape == (3, 1, 8)
    torch.testing.assert_close(cos[:, 0], ang.cos())
    torch.testing.assert_close(sin[:, 0], ang.sin())
    cos2, _ = RotaryEmbedding(8, 10000.0, max_positions=4)(pos, torch.float32)  # bound from data
    torch.testing.assert_close(cos2, cos)


#: max |logit difference| of a quantized KV cache vs float32 over 24 greedy steps
#: (measured 0.6 / 2.0 / 7.6: int8 keeps ~8 bits per element, e4m3 3 mantissa bits, e5m2 2)
QUANT_LOGIT_BOUND = {"int8": 1.0, "fp8_e4m3": 3.0, "fp8_e5m2": 10.0}


@pytest.mark.parametrize("kv_dtype", sorted(QUANT_LOGIT_BOUND))
def test_quantized_kv_cache_keeps_the_story(stories: ModelRunnerModel, kv_dtype: str) -> None:
    full = PagedGreedyDriver(stories, get_test_backend(), block_size=16, num_blocks=8, seed=0)
    quant = PagedGreedyDriver(
        stories, get_test_backend(), block_size=16, num_blocks=8, seed=0, kv_dtype=kv_dtype
    )
    for d in (full, quant):
        d.add([1])
        d.run(24)
    a, b = torch.stack(full.seqs[0].logits), torch.stack(quant.seqs[0].logits)
    assert torch.isfinite(b).all()
    assert 0 < (a - b).abs().max() < QUANT_LOGIT_BOUND[kv_dtype]  # quantized, and bounded
    # the trained model's margins are wide: the story does not change
    assert quant.seqs[0].tokens == full.seqs[0].tokens
