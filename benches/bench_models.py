"""Model forward benchmark: one decode step of stories260K on the paged cache.

For batch sizes 1, 16, 64 and 256 (every sequence at context 128, block_size 16,
float32, CPU, torch single-threaded), one decode step is timed three ways in the same
process:

* ``kvpage``: ``ModelRunnerModel.forward`` with the built-in torch attention backend;
* ``model-only``: the same forward with attention replaced by a stub returning the
  query (the share of the step that is the model's own code, not attention);
* ``hf``: transformers' ``LlamaForCausalLM`` (eager attention) with a contiguous
  ``DynamicCache`` of the same batch and context (cropped back after each step).

Run: ``.venv/bin/python benches/bench_models.py`` (table), or
``.venv/bin/python -m pytest benches/bench_models.py --benchmark-enable -p no:xdist``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.attention.plan import StepPlan, plan_step
from kvpage.backends import get_backend
from kvpage.models import ModelRunnerModel, load_model, to_transformers

CONTEXT = 128
BLOCK_SIZE = 16
BATCHES = (1, 16, 64, 256)


class _StubAttention:
    """Attention that costs nothing: isolates the model's own code."""

    def plan(self, meta: AttentionMetadata) -> StepPlan:
        return plan_step(meta)

    def write_kv(self, *args: Any, **kwargs: Any) -> None:  # kwargs: plan=
        return None

    def forward(self, query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return query


def paged_step(model: ModelRunnerModel, batch: int, backend: Any) -> Callable[[], Any]:
    """A closure running one decode step of ``batch`` sequences at ``CONTEXT``."""
    per_seq = -(-CONTEXT // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    spec = model.cache_spec(BLOCK_SIZE, num_blocks)
    caches = [
        allocate_kv_cache(num_blocks, BLOCK_SIZE, a.num_kv_heads, a.head_dim, dtype=model.dtype)
        for a in spec.layers
    ]
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [CONTEXT] * batch, tables, BLOCK_SIZE)
    plan = backend.plan(meta)
    ids = torch.randint(0, model.vocab_size, (batch,))
    pos = torch.full((batch,), CONTEXT - 1)
    rows = torch.arange(batch)

    def run() -> Any:
        with torch.inference_mode():
            return model(ids, pos, caches, [plan], backend, rows)

    return run


def hf_step(hf: Any, batch: int) -> Callable[[], Any]:
    """One batched decode step of transformers' model over a contiguous cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(torch.randint(0, 512, (batch, CONTEXT - 1)), past_key_values=cache, use_cache=True)
    ids = torch.randint(0, 512, (batch, 1))

    def run() -> Any:
        with torch.inference_mode():
            out = hf(ids, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the token just appended: context stays CONTEXT
        return out

    return run


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    torch.set_num_threads(ap.parse_args().threads)
    torch.manual_seed(0)
    model = load_model("stories260K")
    hf = to_transformers(model)
    backend = get_backend("torch")
    print(f"stories260K decode step, context {CONTEXT}, block_size {BLOCK_SIZE}, float32")
    print("batch | kvpage ms | model-only ms | model share | hf ms | kvpage tok/s | kvpage/hf")
    for b in BATCHES:
        rep = 30 if b < 256 else 10
        # interleave the three so that machine noise hits them alike
        k, s, h = [], [], []
        for _ in range(3):
            k.append(_median_ms(paged_step(model, b, backend), rep))
            s.append(_median_ms(paged_step(model, b, _StubAttention()), rep))
            h.append(_median_ms(hf_step(hf, b), rep))
        km, sm, hm = min(k), min(s), min(h)
        print(
            f"{b:5d} | {km:9.2f} | {sm:13.2f} | {sm / km:11.0%} | {hm:5.2f} | "
            f"{b / km * 1e3:12.0f} | {hm / km:9.2f}x"
        )


@pytest.fixture(scope="module")
def stories() -> ModelRunnerModel:
    torch.set_num_threads(1)
    return load_model("stories260K")


@pytest.mark.parametrize("batch", [1, 64])
def test_bench_paged_decode_step(benchmark: Any, stories: ModelRunnerModel, batch: int) -> None:
    benchmark(paged_step(stories, batch, get_backend("torch")))


@pytest.mark.parametrize("batch", [1, 64])
def test_bench_hf_decode_step(benchmark: Any, stories: ModelRunnerModel, batch: int) -> None:
    benchmark(hf_step(to_transformers(stories), batch))


if __name__ == "__main__":
    main()
