"""Hypothesis over model shapes and schedules: for random small configs of every
architecture (head_dim, GQA ratio, window, soft caps, block size, chunking, arrival),
the paged forward gives the logits of transformers' masked full forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from models_harness import PagedGreedyDriver, get_test_backend, hf_full_forward_logits

from kvpage.models import load_model

transformers = pytest.importorskip("transformers")

NAMES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
}


@st.composite
def model_cases(draw: Any) -> dict[str, Any]:
    arch = draw(st.sampled_from(sorted(NAMES)))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 16, 24]))
    cfg: dict[str, Any] = dict(
        vocab_size=97,
        hidden_size=48,  # HF wants a multiple of the head count (1..12 here)
        intermediate_size=64,
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=kv_heads * group,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        initializer_range=0.1,
        rope_theta=draw(st.sampled_from([100.0, 10000.0])),
    )
    window = draw(st.integers(1, 12))
    if arch == "mistral":
        cfg["sliding_window"] = window
    if arch == "gemma2":
        cfg.update(
            sliding_window=window,
            query_pre_attn_scalar=draw(st.sampled_from([head_dim, 10])),
            attn_logit_softcapping=draw(st.sampled_from([None, 1.5])),
            final_logit_softcapping=draw(st.sampled_from([None, 4.0])),
        )
    if arch == "llama":
        cfg["attention_bias"] = draw(st.booleans())
    prompts = draw(
        st.lists(st.lists(st.integers(0, 96), min_size=1, max_size=14), min_size=1, max_size=3)
    )
    schedule = [(draw(st.integers(1, 6)), draw(st.integers(0, 3))) for _ in prompts]
    return dict(
        arch=arch,
        cfg=cfg,
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        prompts=prompts,
        schedule=schedule,
        seed=draw(st.integers(0, 2**16)),
    )


W1_CASE = dict(
    arch="mistral",
    cfg=dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        initializer_range=0.1,
        rope_theta=100.0,
        sliding_window=1,  # a query sees only itself (HF's cached path gets this wrong)
    ),
    block_size=1,
    prompts=[[0], [5, 6, 7]],
    schedule=[(1, 0), (2, 1)],
    seed=0,
)


@settings(max_examples=12)
@example(W1_CASE)
@given(model_cases())
def test_random_configs_match_transformers(case: dict[str, Any]) -> None:
    cfg_name, model_name = NAMES[case["arch"]]
    torch.manual_seed(case["seed"])
    config = getattr(transformers, cfg_name)(**case["cfg"])
    config._attn_implementation = "eager"
    hf = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(
                    (0.0 if "gemma" in case["arch"] or "bias" in name else 1.0)
                    + 0.2 * torch.randn_like(p)
                )
    model = load_model(hf)
    bs = case["block_size"]
    new = 6
    blocks = sum(-(-(len(p) + new) // bs) for p in case["prompts"]) + 1
    d = PagedGreedyDriver(model, get_test_backend(), bs, blocks, seed=case["seed"])
    for prompt, (chunk, arrival) in zip(case["prompts"], case["schedule"]):
        d.add(prompt, chunk=chunk, arrival=arrival)
    d.run(new)
    for s in d.seqs:
        ref = hf_full_forward_logits(hf, s.tokens, s.prompt_len)
        torch.testing.assert_close(torch.stack(s.logits), ref, atol=1e-4, rtol=0)
