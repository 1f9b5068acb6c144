"""Test-only helpers of the engine tests: small random-weight HF model configs and the
transformers ``generate`` greedy oracle."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: generated tokens compared per prompt (the issue asks for >= 64)
NUM_NEW = 64

#: config fields shared by the random-weight models: 2-3 layers, GQA 4:2, head_dim 16,
#: initializer_range 0.1 so the top-1/top-2 logit margins are far above float noise
_COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

HF_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2)),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, sliding_window=8),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=3,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
        ),
    ),
}

#: mixed-length prompts for the random models (longer than the window of 8)
HF_PROMPTS = [
    [1, 5, 9, 33, 7, 12, 90, 4, 101, 55, 17, 3, 64, 8, 23, 11, 77],
    [1, 40],
    [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3],
    [1, 99, 98, 97, 96, 95],
]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run with one torch intra-op thread, then restore. The models here are tiny: on
    a shared 2-core machine extra threads cost far more than they save (measured 30x
    slower on a 256x64 matmul under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hf_greedy(hf: Any, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    """Greedy continuation by transformers' own ``generate`` (contiguous cache), EOS off."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad(), one_torch_thread():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_new,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


def make_hf_model(arch: str) -> Any:
    """A random-weight ``transformers`` model of ``arch`` (seeded, eager attention)."""
    import transformers

    cfg_name, model_name, extra = HF_ARCHS[arch]
    torch.manual_seed(1234)
    cfg = getattr(transformers, cfg_name)(**_COMMON, **extra)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).eval()
    model.generation_config.eos_token_id = None
    return model
