"""Fixtures of the engine tests: the bundled model and its transformers ``generate``
greedy references (computed once per session)."""

from __future__ import annotations

from typing import Any

import pytest
from engine_harness import hf_greedy, one_torch_thread


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    """Every engine test runs with one torch thread (see ``one_torch_thread``)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def stories_hf() -> Any:
    """stories260K as a transformers LlamaForCausalLM (same weights)."""
    pytest.importorskip("transformers")
    from kvpage.models import load_model, to_transformers

    hf = to_transformers(load_model("stories260K"))
    hf.generation_config.eos_token_id = None
    return hf


@pytest.fixture(scope="session")
def stories_prompts() -> list[list[int]]:
    """Mixed-length stories260K prompts (token ids with BOS)."""
    from kvpage.models import load_model

    tok = load_model("stories260K").tokenizer
    texts = [
        "Once upon a time, there was a little dog named Max who loved to run in the big park",
        "Lily",
        "The sun was hot. Tom and his sister went to the sea to swim and play with a ball.",
        "One day",
    ]
    return [tok.encode(t, bos=True) for t in texts]


@pytest.fixture(scope="session")
def stories_reference(stories_hf: Any, stories_prompts: list[list[int]]) -> list[list[int]]:
    """HF ``generate`` greedy continuations of ``stories_prompts``."""
    return [hf_greedy(stories_hf, p) for p in stories_prompts]
