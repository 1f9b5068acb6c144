"""Test-only driver of kvpage's hybrid models: paged KV for the attention layers and
state slots for the recurrent ones, with chunked prefill, a prefix hit at a snapshot
(``copy_slots`` of the prefix's state + the prefix's KV blocks shared) and
recompute after preemption; transformers' greedy ``generate`` as the oracle."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.attention.state import StateBatch, StateCache
from kvpage.models import ModelRunnerModel


@dataclass
class Seq:
    """One sequence: its tokens, how many are computed, its block table per KV group
    and its state slot."""

    tokens: list[int]
    prompt_len: int
    slot: int
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class HybridDriver:
    """Steps sequences through ``model.forward`` with NaN-poisoned KV blocks and state
    slots (a slot or block read before it is written shows up as NaN logits)."""

    def __init__(
        self,
        model: ModelRunnerModel,
        backend: Any,
        block_size: int = 4,
        num_blocks: int = 96,
        num_slots: int = 6,
    ) -> None:
        self.model, self.backend, self.bs = model, backend, block_size
        self.spec = model.cache_spec(block_size=block_size, num_blocks=num_blocks)
        rng = random.Random(0)
        self.free: list[list[int]] = []
        for _ in self.spec.kv_groups:
            ids = list(range(1, num_blocks))
            rng.shuffle(ids)
            self.free.append(ids)
        nan = float("nan")
        self.kv = [
            allocate_kv_cache(
                num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=model.dtype, fill=nan
            )  # fmt: skip
            for a in self.spec.layers
        ]
        self.states = [
            StateCache.allocate(s, num_slots, torch.device("cpu")) for s in self.spec.state_layers
        ]
        for s in self.states:
            s.conv.fill_(nan)
            s.ssm.fill_(nan)

    def new(self, prompt: list[int], slot: int) -> Seq:
        return Seq(list(prompt), len(prompt), slot, tables=[[] for _ in self.spec.kv_groups])

    def step(self, work: list[tuple[Seq, int]]) -> None:
        """One forward over ``(sequence, new tokens)`` pairs (packed in that order); a
        sequence whose tokens are all computed after the step gets its greedy token."""
        ids: list[int] = []
        pos: list[int] = []
        qlens: list[int] = []
        last: list[int] = []
        for s, n in work:
            end = s.computed + n
            need = -(-end // self.bs)
            for g, t in enumerate(s.tables):
                t.extend(self.free[g].pop() for _ in range(need - len(t)))
            ids += s.tokens[s.computed : end]
            pos += range(s.computed, end)
            qlens.append(n)
            last.append(len(ids) - 1)
        plans = [
            self.backend.plan(
                AttentionMetadata.build(
                    qlens,
                    [s.computed + q for (s, _), q in zip(work, qlens)],
                    [s.tables[g] for s, _ in work],
                    self.bs,
                )
            )
            for g in range(len(self.spec.kv_groups))
        ]
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        batch = StateBatch(
            state_indices=torch.tensor([s.slot for s, _ in work], dtype=torch.int64),
            has_initial_state=torch.tensor([s.computed > 0 for s, _ in work]),
            query_start_loc=torch.tensor(qsl, dtype=torch.int64),
            is_decode=all(q == 1 for q in qlens),
        )
        logits = self.model(
            torch.tensor(ids),
            torch.tensor(pos),
            self.kv,
            plans,
            self.backend,
            torch.tensor(last),
            state_caches=self.states,
            state_batch=batch,
        )
        assert torch.isfinite(logits).all()
        for i, ((s, _), q) in enumerate(zip(work, qlens)):
            s.computed += q
            if s.computed == len(s.tokens):
                s.logits.append(logits[i])
                s.tokens.append(int(logits[i].argmax()))

    def run(self, seqs: list[Seq], num_new: int, chunk: int = 1 << 30) -> None:
        """Chunked prefill (``chunk`` tokens per sequence per step) and decode, all
        sequences in one batch, until each has ``num_new`` generated tokens."""
        while True:
            work = []
            for s in seqs:
                if len(s.generated) >= num_new:
                    continue
                work.append((s, min(chunk, len(s.tokens) - s.computed)))
            if not work:
                return
            self.step(work)

    def snapshot(self, src: int, dst: int) -> None:
        """Slot ``dst`` := slot ``src`` in every state layer (a prefix-cache snapshot)."""
        pairs = torch.tensor([[src, dst]], dtype=torch.int64)
        for s in self.states:
            s.copy_slots(pairs)

    def drop(self, seq: Seq) -> None:
        """Preempt ``seq``: its blocks go back to the pool, its slot is poisoned, and it
        restarts from token 0 (recompute) with everything so far as its prompt."""
        for g, t in enumerate(seq.tables):
            self.free[g].extend(t)
            t.clear()
        for s in self.states:
            s.conv[seq.slot] = float("nan")
            s.ssm[seq.slot] = float("nan")
        seq.computed = 0


def hf_logits(hf: Any, seq: Seq) -> torch.Tensor:
    """transformers' logits (one no-cache forward over the sequence's tokens) at the
    positions that predicted each generated token: ``[len(generated), vocab]``."""
    with torch.no_grad():
        out = hf(torch.tensor([seq.tokens]), use_cache=False).logits[0].float()
    return out[seq.prompt_len - 1 : len(seq.tokens) - 1]


def hf_generate(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` (its own recurrent cache); the model has no
    EOS (``min_new_tokens`` would mask the EOS logit and change the greedy token)."""
    assert hf.config.eos_token_id is None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt) :]]
