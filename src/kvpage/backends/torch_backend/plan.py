"""Per-step gather plans of the torch backend, shared by every layer of a step.

A plan splits the step's sequences into *groups* that are padded together. For each
group it holds the physical blocks to gather (block granular: whole blocks are copied,
which is a contiguous ``index_select``), the padded query rows, and the masks. Decode
is the special case where every query length is 1 (one group).

Key range of sequence ``i`` (absolute positions): ``lo_i .. seq_len_i - 1`` with
``lo_i = max(0, context_len_i - W + 1)`` for a sliding window ``W`` (the earliest key
its first new token sees; ``kvpage.specs``: W keys including the current one), else 0.
The gathered keys start at the block boundary ``(lo_i // block_size) * block_size``;
keys before ``lo_i`` or at/after ``seq_len_i`` are masked and zeroed (they may hold
anything, NaN included).

Everything depending on the cache's block size or the layer's window is built on first
use and memoized in the plan (all layers of one KV group share both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.attention.metadata import AttentionMetadata

#: a group may hold up to this factor more padded (query x key) work than real work
PAD_FACTOR = 1.5
#: ... plus this much slack, so that many tiny sequences still share one group
PAD_SLACK = 64 * 1024


@dataclass
class GroupIndex:
    """Gather and mask data of one padded group (all tensors on the step's device).

    Attributes:
        seqs: sequence indices of the group (host list), group order.
        blocks: ``[n, num_gather_blocks]`` int64 physical block ids to gather.
        key_valid: ``[n, num_gather_blocks * block_size]`` bool, or None when every
            gathered key is in range.
        q_rows: ``[n, max_q]`` int64 token row of each padded query (clamped).
        q_valid: ``[n * max_q]`` bool of real query rows, or None when all are real.
        out_rows: ``[num_real]`` int64 token rows receiving the group's outputs, in the
            order of ``q_valid``'s True entries.
        attn_mask: ``[n, 1, max_q, num_keys]`` bool (True = attend) or None.
        is_causal: True when a plain top-left causal mask is exact (no mask tensor).
        max_q: padded query length.
    """

    seqs: list[int]
    blocks: torch.Tensor
    key_valid: torch.Tensor | None
    q_rows: torch.Tensor
    q_valid: torch.Tensor | None
    out_rows: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    max_q: int
    identity_rows: bool = False
    min_block: int = 0
    max_block: int = 0


@dataclass
class TorchPlan:
    """Host copies of the step's lengths and a memo of group indices per
    ``(block_size, sliding_window)``."""

    device: torch.device
    block_tables: torch.Tensor  # host int64 [num_seqs, width]
    query_lens: list[int]
    seq_lens: list[int]
    query_starts: list[int]
    memo: dict[tuple[int, int | None], list[GroupIndex]] = field(default_factory=dict)

    @classmethod
    def from_meta(cls, meta: AttentionMetadata) -> TorchPlan:
        qs = [0]
        for q in meta.query_lens_cpu:
            qs.append(qs[-1] + q)
        return cls(
            device=meta.seq_lens.device,
            block_tables=meta.block_tables.to("cpu", torch.int64),
            query_lens=list(meta.query_lens_cpu),
            seq_lens=list(meta.seq_lens_cpu),
            query_starts=qs,
        )

    def groups(self, block_size: int, window: int | None) -> list[GroupIndex]:
        """The padded groups for caches of ``block_size`` and a layer window."""
        key = (block_size, window)
        if key not in self.memo:
            self.memo[key] = self._build(block_size, window)
        return self.memo[key]

    # ---- construction -------------------------------------------------------------
    def _key_range(self, i: int, window: int | None) -> tuple[int, int]:
        s, q = self.seq_lens[i], self.query_lens[i]
        lo = 0 if window is None else max(0, s - q - window + 1)
        return lo, s

    def _partition(self, block_size: int, window: int | None) -> list[list[int]]:
        """Greedy grouping: sequences sorted by query length (then key span); a group
        grows while its padded work stays within PAD_FACTOR of the real work."""
        live = [i for i in range(len(self.seq_lens)) if self.query_lens[i] > 0]

        def span(i: int) -> int:
            lo, hi = self._key_range(i, window)
            return -(-hi // block_size) * block_size - (lo // block_size) * block_size

        live.sort(key=lambda i: (self.query_lens[i], span(i)), reverse=True)
        groups: list[list[int]] = []
        cur: list[int] = []
        real = max_q = max_k = 0
        for i in live:
            q, k = self.query_lens[i], span(i)
            nq, nk, nreal = max(max_q, q), max(max_k, k), real + q * k
            if cur and (len(cur) + 1) * nq * nk > PAD_FACTOR * nreal + PAD_SLACK:
                groups.append(cur)
                cur, real, nq, nk, nreal = [], 0, q, k, q * k
            cur.append(i)
            max_q, max_k, real = nq, nk, nreal
        if cur:
            groups.append(cur)
        return groups

    def _build(self, block_size: int, window: int | None) -> list[GroupIndex]:
        out = []
        for seqs in self._partition(block_size, window):
            out.append(self._group(seqs, block_size, window))
        return out

    def _group(self, seqs: list[int], bs: int, window: int | None) -> GroupIndex:
        dev = self.device
        lo = torch.tensor([self._key_range(i, window)[0] for i in seqs], dtype=torch.int64)
        hi = torch.tensor([self.seq_lens[i] for i in seqs], dtype=torch.int64)
        ql = torch.tensor([self.query_lens[i] for i in seqs], dtype=torch.int64)
        qs = torch.tensor([self.query_starts[i] for i in seqs], dtype=torch.int64)
        first = lo // bs
        nblk = (hi + bs - 1) // bs - first
        nb, max_q = int(nblk.max()), int(ql.max())
        col = first[:, None] + torch.arange(nb)[None, :]
        col = torch.minimum(col, (first + nblk - 1)[:, None])
        blocks = self.block_tables[seqs].gather(1, col)
        kpos = (first * bs)[:, None] + torch.arange(nb * bs)[None, :]
        key_valid = (kpos >= lo[:, None]) & (kpos < hi[:, None])
        j = torch.arange(max_q)[None, :]
        q_valid = j < ql[:, None]
        q_rows = qs[:, None] + torch.minimum(j, (ql - 1)[:, None])
        qpos = (hi - ql)[:, None] + j
        all_keys = bool(key_valid.all())
        all_q = bool(q_valid.all())
        ctx_zero = bool(((hi - ql) == 0).all())
        no_window = window is None or window >= int(hi.max())
        is_causal = all_keys and all_q and ctx_zero and no_window and max_q == nb * bs
        mask: torch.Tensor | None = None
        if max_q == 1:
            # a single query at seq_len - 1 sees exactly [lo, seq_len): the key range
            mask = None if all_keys else key_valid[:, None, None, :]
        elif not is_causal:
            allowed = key_valid[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])
            if window is not None:
                allowed &= kpos[:, None, :] > (qpos[:, :, None] - window)
            mask = allowed[:, None]
        flat_valid = q_valid.reshape(-1)
        out_rows = q_rows.reshape(-1)[flat_valid]
        identity = max_q == 1 and all_q and out_rows.tolist() == list(range(self.query_starts[-1]))
        return GroupIndex(
            seqs=seqs,
            blocks=blocks.to(dev),
            key_valid=None if all_keys else key_valid.to(dev),
            q_rows=q_rows.to(dev),
            q_valid=None if all_q else flat_valid.to(dev),
            out_rows=out_rows.to(dev),
            attn_mask=None if mask is None else mask.to(dev),
            is_causal=is_causal,
            max_q=max_q,
            identity_rows=identity,
            min_block=int(blocks.min()),
            max_block=int(blocks.max()),
        )
