"""Test-only drivers: a backend adapter around the float64 reference, a minimal paged
step runner with random physical block ids, and an HF contiguous-cache greedy oracle."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_kv_cache
from kvpage.attention.plan import StepPlan, plan_step
from kvpage.attention.reference import reference_attention, reference_write_kv
from kvpage.models import ModelRunnerModel
from kvpage.specs import AttentionSpec


class ReferenceAdapter:
    """Just enough of the AttentionBackend protocol, computed by the float64 reference."""

    name = "reference-adapter"

    def plan(self, meta: AttentionMetadata) -> StepPlan:
        return plan_step(meta)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: StepPlan | None = None,  # the step's plan (the reference checks nothing)
    ) -> None:
        reference_write_kv(key, value, cache, slot_mapping)

    def forward(
        self, query: torch.Tensor, cache: KVCache, plan: StepPlan, spec: AttentionSpec
    ) -> torch.Tensor:
        return reference_attention(query, cache, plan.meta, spec).to(query.dtype)


def get_test_backend() -> Any:
    """The built-in torch backend (what the engine runs on CPU)."""
    from kvpage.backends import get_backend

    return get_backend("torch")


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    chunk: int
    arrival: int
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class PagedGreedyDriver:
    """Runs several sequences through ``model.forward`` on a NaN-poisoned paged cache:
    chunked prefill, late arrivals and decode mixed in one batch; block ids drawn from
    a random permutation per KV group (block 0 = null, never used)."""

    def __init__(
        self,
        model: ModelRunnerModel,
        backend: Any,
        block_size: int,
        num_blocks: int,
        seed: int,
        kv_dtype: Any = "auto",
    ) -> None:
        self.model, self.backend, self.block_size = model, backend, block_size
        self.spec = model.cache_spec(
            block_size=block_size, num_blocks=num_blocks, kv_dtype=kv_dtype
        )
        rng = random.Random(seed)
        self.free: list[list[int]] = []
        for _ in self.spec.kv_groups:
            ids = list(range(1, num_blocks))
            rng.shuffle(ids)
            self.free.append(ids)
        self.caches = [
            allocate_kv_cache(
                num_blocks,
                block_size,
                a.num_kv_heads,
                a.head_dim,
                dtype=model.dtype,
                kv_dtype=kv_dtype,
                fill=float("nan"),
            )
            for a in self.spec.layers
        ]
        self.seqs: list[_Seq] = []

    def add(self, prompt: list[int], chunk: int = 1 << 30, arrival: int = 0) -> None:
        groups = len(self.spec.kv_groups)
        self.seqs.append(_Seq(list(prompt), len(prompt), chunk, arrival, tables=[[]] * groups))

    def run(self, max_new_tokens: int) -> None:
        step = 0
        while any(len(s.tokens) - s.prompt_len < max_new_tokens for s in self.seqs):
            active = [
                s
                for s in self.seqs
                if s.arrival <= step and len(s.tokens) - s.prompt_len < max_new_tokens
            ]
            if active:
                self._step(active)
            step += 1

    def _step(self, active: list[_Seq]) -> None:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        qlens: list[int] = []
        last_rows: list[int] = []
        for s in active:
            n = min(s.chunk, len(s.tokens) - s.computed)
            end = s.computed + n
            need = -(-end // bs)
            s.tables = [
                t + [self.free[g].pop() for _ in range(need - len(t))]
                for g, t in enumerate(s.tables)
            ]
            ids += s.tokens[s.computed : end]
            pos += list(range(s.computed, end))
            qlens.append(n)
            last_rows.append(len(ids) - 1)
        metas = []
        for g in range(len(self.spec.kv_groups)):
            meta = AttentionMetadata.build(
                qlens,
                [s.computed + q for s, q in zip(active, qlens)],
                [s.tables[g] for s in active],
                bs,
            )
            metas.append(self.backend.plan(meta))
        logits = self.model(
            torch.tensor(ids),
            torch.tensor(pos),
            self.caches,
            metas,
            self.backend,
            torch.tensor(last_rows),
        )
        for i, (s, q) in enumerate(zip(active, qlens)):
            s.computed += q
            if s.computed == len(s.tokens):
                s.logits.append(logits[i])
                s.tokens.append(int(logits[i].argmax()))


def hf_teacher_forced_logits(hf: Any, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """HF logits (contiguous DynamicCache) after the prompt and after each later token
    of ``tokens``: ``[len(tokens) - prompt_len, vocab]``."""
    from transformers import DynamicCache

    out = []
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        r = hf(torch.tensor([tokens[:prompt_len]]), past_key_values=cache, use_cache=True)
        out.append(r.logits[0, -1])
        for p in range(prompt_len, len(tokens) - 1):
            r = hf(torch.tensor([[tokens[p]]]), past_key_values=r.past_key_values, use_cache=True)
            out.append(r.logits[0, -1])
    return torch.stack(out).float()


def hf_full_forward_logits(hf: Any, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """HF logits of one no-cache forward over all of ``tokens``, at the positions that
    predict ``tokens[prompt_len:]``: ``[len(tokens) - prompt_len, vocab]``.

    Same function as ``hf_teacher_forced_logits`` but through HF's masks only: HF's
    sliding-window cache layer keeps ``keys[-window + 1:]``, which for window 1 is
    ``keys[0:]`` (every key), so its cached decode is wrong for window 1 while the
    masked full forward is right (transformers 5.23).
    """
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=False).logits[0]
    return out[prompt_len - 1 : len(tokens) - 1].float()
