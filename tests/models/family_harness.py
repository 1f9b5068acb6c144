"""Shared pieces of the model-family tests (``test_models_families.py``,
``test_models_moe.py``): tiny random-weight transformers models built offline from
their config classes, transformers' greedy tokens as the oracle, and the check that
kvpage's engine (folder load, chunked prefill, optionally a prefix-cache rerun) gives
the same tokens with a bounded log-probability error."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpage.engine import LLM, SamplingParams
from kvpage.models import load_model

transformers = pytest.importorskip("transformers")

#: small sizes every family's config takes (GPT-2 has its own names)
SMALL: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,  # the default 0.02 gives near-tied logits
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
GPT2_SMALL: dict[str, Any] = dict(
    vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.3,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
PROMPTS = [
    [5, 17, 99, 3, 200, 41, 7, 8, 9, 10, 11, 12, 13],
    [250, 1, 33, 44, 55, 66, 77, 90],
    list(range(30, 51)),
]
NUM_NEW = 8


def make_hf(model_type: str, features: dict[str, Any], seed: int = 0) -> Any:
    """A random-weight transformers model of ``model_type`` (eager attention) with
    non-trivial norms and biases."""
    torch.manual_seed(seed)
    base = GPT2_SMALL if model_type == "gpt2" else SMALL
    cfg = transformers.CONFIG_MAPPING[model_type](**copy.deepcopy({**base, **features}))
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gemma = model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                if name.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def hf_greedy(hf: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (no-cache full forwards) and their log-probabilities."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            t = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    return ids[len(prompt) :], lps


def hf_cached_greedy(hf: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens decoding one token at a time with its cache (what
    position-dependent RoPE frequencies, ``dynamic``, mean for a KV cache)."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        cache = transformers.DynamicCache(config=hf.config)
        r = hf(torch.tensor([prompt[:1]]), past_key_values=cache, use_cache=True)
        for tok in prompt[1:]:  # one token per step: each key rotated at its own length
            r = hf(torch.tensor([[tok]]), past_key_values=r.past_key_values, use_cache=True)
        for _ in range(n):
            logits = r.logits[0, -1].float()
            t = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
            r = hf(torch.tensor([[t]]), past_key_values=r.past_key_values, use_cache=True)
    return ids[len(prompt) :], lps


def run_greedy(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[float(d[t].logprob) for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]  # fmt: skip
    return toks, lps


def check_family(
    model_type: str,
    features: dict[str, Any],
    tmp_path: Path,
    rounds: int = 1,
    backend: str = "auto",
    num_blocks: int = 160,
    max_num_seqs: int = 3,
    check_model: Callable[[Any], bool] | None = None,
    prepare: Callable[[Any], None] | None = None,
) -> float:
    """Greedy equality with transformers (folder load, chunked prefill; ``rounds=2``:
    the rerun hits the prefix cache); returns the largest log-probability error.
    ``check_model`` asserts something of the loaded kvpage model (e.g. its MLP kind);
    ``prepare`` changes the transformers model before it is saved (e.g. its buffers)."""
    hf = make_hf(model_type, features)
    if prepare is not None:
        with torch.no_grad():
            prepare(hf)
    hf.save_pretrained(tmp_path)  # the family's checkpoint names
    dynamic = "dynamic" in str(features.get("rope_parameters"))
    oracle = hf_cached_greedy if dynamic else hf_greedy
    refs = [oracle(hf, p, NUM_NEW) for p in PROMPTS]
    want = [r[0] for r in refs]
    assert len({t for r in want for t in r}) > 4  # not a degenerate constant output
    model = load_model(tmp_path)
    assert model.config["model_type"] == model_type
    assert check_model is None or check_model(model)
    # chunked prefill: a token budget of 7 splits every prompt (dynamic RoPE: one token
    # per step, as the oracle feeds transformers)
    budget = 1 if dynamic else 7
    llm = LLM(
        model,
        block_size=4,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        backend=backend,
    )
    err = 0.0
    for rnd in range(rounds):
        got, lps = run_greedy(llm)
        assert got == want, f"{model_type} round {rnd}: {got} != {want}"
        for (_, ref_lp), mine in zip(refs, lps):
            err = max(err, max(abs(a - b) for a, b in zip(ref_lp, mine)))
    if rounds > 1:
        assert llm.get_metrics()["kvpage:prefix_cache_hits_total"] > 0
    llm.llm_engine.kv_cache_manager.check_integrity()
    assert err < 1e-4, err
    print(f"{model_type} {features}: tokens equal, max |logprob error| {err:.2e}")
    return err


def check_layouts_agree(model_type: str, features: dict[str, Any], tmp_path: Path) -> Any:
    """An in-memory transformers model and its saved folder load to the same kvpage
    weights, and ``to_transformers`` writes them back with equal logits; returns the
    kvpage model loaded from memory."""
    from kvpage.models import to_transformers

    hf = make_hf(model_type, features, seed=1)
    hf.save_pretrained(tmp_path)
    a, b = load_model(hf), load_model(tmp_path)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    back = to_transformers(a)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)
    return a
