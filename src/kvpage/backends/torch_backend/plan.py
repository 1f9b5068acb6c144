"""Per-step gather plans of the torch backend, shared by every layer of a step.

Key range of sequence ``i`` (absolute positions): ``lo_i .. seq_len_i - 1`` with
``lo_i = max(0, context_len_i - W + 1)`` for a sliding window ``W`` (the earliest key
its first new token sees; ``kvpage.specs``: W keys including the current one), else 0.

Sequences are split into two kinds of buckets:

* **streamed** (one sequence, long key range): its whole blocks are gathered into a
  buffer with one row gather per chunk and the key range is a slice of it, so
  no padding and, for decode, no mask. The buffer is consumed right away, while it is
  still in cache — this is what makes paged decode as fast as attention over a
  contiguous cache.
* **padded** (many short sequences): per-slot gather into ``[n, max_keys]``; padding
  points at the sequence's last key (always written, so finite) and is masked out of
  the softmax, so the gathered tensors never need a cleaning pass.

Everything depending on the cache's block size, the layer's window or the row size
is built on first use and memoized (all layers of one KV group share them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpage.attention.metadata import AttentionMetadata, slot_of
from kvpage.attention.plan import StepPlan, step_fields

#: a padded bucket may hold this factor more (query x key) work than real work ...
PAD_FACTOR = 1.5
#: ... plus this much slack, so that many tiny sequences still share one bucket
PAD_SLACK = 64 * 1024
#: sequences whose K rows of the key range exceed this many bytes are streamed alone
STREAM_MIN_BYTES = 256 * 1024
#: a padded bucket's gathered K (or V) stays under this many bytes (unless one sequence
#: alone needs more), so a bucket's gather and its consumers mostly run in cache; 1 MiB
#: measured best for a 256-sequence decode step on stories260K shapes (128 KiB: 1.8x
#: slower from per-bucket overhead; 4 MiB: 1.5x slower), see docs/benchmarks.md
BUCKET_BYTES = 1024 * 1024


@dataclass
class SeqBucket:
    """Gather and mask data of one bucket (tensors on the step's device).

    Attributes:
        seqs: sequence indices of the bucket (host list).
        streamed: True for a single streamed sequence (see module docstring).
        index: padded: ``[n, max_keys]`` int64 slots; streamed: ``[num_blocks]`` int64
            physical blocks covering the key range.
        key_offset / num_keys: streamed: the key range is rows
            ``key_offset .. key_offset + num_keys - 1`` of the gathered blocks.
        q_rows: ``[n, max_q]`` int64 token row of each padded query (clamped).
        q_valid: ``[n * max_q]`` bool of real query rows, or None when all are real.
        out_rows: ``[num_real]`` int64 token rows receiving the outputs.
        attn_mask: ``[n, 1, max_q, max_keys]`` bool (True = attend) or None.
        key_bias: padded decode buckets (``max_q == 1``): ``[n, 1, max_keys]`` float32,
            0 for keys in the range and -inf for padding (added to the logits); else None.
        kv_index: memo of ``compute``: K-then-V slot index per cache slot count.
        is_causal: True when a top-left causal mask (query j sees keys 0..j) is exact.
        max_q: padded query length.
        q_start: first token row (streamed buckets: rows are contiguous).
        identity_rows: the bucket's outputs are exactly rows 0..n-1 in order.
        min_block / max_block: range of physical block ids read (validated per cache).
    """

    seqs: list[int]
    streamed: bool
    index: torch.Tensor
    key_offset: int
    num_keys: int
    q_rows: torch.Tensor
    q_valid: torch.Tensor | None
    out_rows: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    max_q: int
    q_start: int = 0
    identity_rows: bool = False
    min_block: int = 0
    max_block: int = 0
    key_bias: torch.Tensor | None = None
    kv_index: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TorchPlan(StepPlan):
    """The torch backend's step plan: host copies of the step's lengths and block
    tables, and a memo of buckets per ``(block_size, sliding_window, bytes per key row,
    stream threshold)`` (filled by the first layer that needs them).

    Attributes:
        block_tables: host int64 ``[num_seqs, width]``.
        query_lens / seq_lens: host lists per sequence.
        query_starts: ``[num_seqs + 1]`` first query row of each sequence.
    """

    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    query_starts: list[int]
    memo: dict[tuple[int, int | None, int, int], list[SeqBucket]] = field(
        default_factory=dict, repr=False, compare=False
    )
    #: ``TorchBackend.forward``'s memo: per layer shape (block size, pool size, heads,
    #: head_dim, storage dtype, query heads, window, stream threshold), the buckets with
    #: the compute path of each (``compute.pick_attend``)
    runs: dict[tuple[Any, ...], list[tuple[Callable[..., None], SeqBucket]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def from_meta(cls, meta: AttentionMetadata) -> TorchPlan:
        """Validate the step (``kvpage.attention.plan.check_step``) and copy what the
        buckets are built from to the host.

        Raises:
            ShapeError, DTypeError: see ``check_step``.
        """
        fields = step_fields(meta)
        qs = [0]
        for q in meta.query_lens_cpu:
            qs.append(qs[-1] + q)
        return cls(
            **fields,
            block_tables=meta.block_tables.to("cpu", torch.int64),
            query_lens=list(meta.query_lens_cpu),
            seq_lens=list(meta.seq_lens_cpu),
            query_starts=qs,
        )

    def buckets(
        self,
        block_size: int,
        window: int | None,
        row_bytes: int,
        stream_min_bytes: int = STREAM_MIN_BYTES,
    ) -> list[SeqBucket]:
        """The buckets for caches of ``block_size``, a layer window and ``row_bytes``
        bytes per key (num_kv_heads * head_dim * element size); sequences whose key
        range holds at least ``stream_min_bytes`` are streamed alone."""
        key = (block_size, window, row_bytes, stream_min_bytes)
        if key not in self.memo:
            self.memo[key] = self._build(block_size, window, row_bytes, stream_min_bytes)
        return self.memo[key]

    # ---- construction -------------------------------------------------------------
    def _key_range(self, i: int, window: int | None) -> tuple[int, int]:
        s, q = self.seq_lens[i], self.query_lens[i]
        lo = 0 if window is None else max(0, s - q - window + 1)
        return lo, s

    def _build(
        self, bs: int, window: int | None, row_bytes: int, stream_min: int
    ) -> list[SeqBucket]:
        # one pass over the sequences: key spans (``_key_range``, inlined: this runs per
        # step) and the streamed/batched split
        spans: dict[int, tuple[int, int]] = {}
        big: list[int] = []
        small: list[int] = []
        for i, (q, s) in enumerate(zip(self.query_lens, self.seq_lens)):
            if q <= 0:
                continue
            lo = 0 if window is None else max(0, s - q - window + 1)
            spans[i] = (lo, s)
            (big if (s - lo) * row_bytes >= stream_min else small).append(i)
        out = [self._streamed(i, bs, window) for i in big]
        for seqs in self._partition(small, spans, row_bytes):
            out.append(self._padded(seqs, bs, window, spans))
        return out

    def _partition(
        self, live: list[int], spans: dict[int, tuple[int, int]], row_bytes: int
    ) -> list[list[int]]:
        """Greedy: sorted by query length then key span, a bucket grows while its padded
        work stays within PAD_FACTOR of the real work (plus PAD_SLACK) and its padded
        K rows within BUCKET_BYTES."""
        keyed = []
        for i in live:
            keyed.append((self.query_lens[i], spans[i][1] - spans[i][0], i))
        keyed.sort(reverse=True)
        buckets: list[list[int]] = []
        cur: list[int] = []
        real = max_q = max_k = 0
        for q, k, i in keyed:
            nq, nk, nreal = max(max_q, q), max(max_k, k), real + q * k
            pad = (len(cur) + 1) * nq * nk
            if cur and (
                pad > PAD_FACTOR * nreal + PAD_SLACK
                or (len(cur) + 1) * nk * row_bytes > BUCKET_BYTES
            ):
                buckets.append(cur)
                cur, nq, nk, nreal = [], q, k, q * k
            cur.append(i)
            max_q, max_k, real = nq, nk, nreal
        if cur:
            buckets.append(cur)
        return buckets

    def _masks(
        self, kpos: torch.Tensor, qpos: torch.Tensor, key_valid: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """``[n, max_q, max_keys]`` bool: key valid, causal, inside the window."""
        allowed = key_valid[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])
        if window is not None:
            allowed &= kpos[:, None, :] > (qpos[:, :, None] - window)
        return allowed

    def _streamed(self, i: int, bs: int, window: int | None) -> SeqBucket:
        lo, hi = self._key_range(i, window)
        q, qs = self.query_lens[i], self.query_starts[i]
        first, last = lo // bs, (hi - 1) // bs
        blocks = self.block_tables[i, first : last + 1]
        n_keys = hi - lo
        rows = torch.arange(qs, qs + q, dtype=torch.int64)
        mask = None
        is_causal = False
        if q > 1:
            ctx = hi - q
            if ctx == 0 and (window is None or window >= hi) and lo == 0:
                is_causal = True
            else:
                kpos = torch.arange(lo, hi)[None]
                qpos = torch.arange(ctx, hi)[None]
                valid = torch.ones_like(kpos, dtype=torch.bool)
                mask = self._masks(kpos, qpos, valid, window)[:, None]
        dev = self.device
        return SeqBucket(
            seqs=[i],
            streamed=True,
            index=blocks.to(dev),
            key_offset=lo - first * bs,
            num_keys=n_keys,
            q_rows=rows.view(1, q).to(dev),
            q_valid=None,
            out_rows=rows.to(dev),
            attn_mask=None if mask is None else mask.to(dev),
            is_causal=is_causal,
            max_q=q,
            q_start=qs,
            min_block=int(blocks.min()),
            max_block=int(blocks.max()),
        )

    def _padded(
        self,
        seqs: list[int],
        bs: int,
        window: int | None,
        spans: dict[int, tuple[int, int]],
    ) -> SeqBucket:
        dev = self.device
        rows = []  # one host pass: (lo, seq_len, query_len, query_start) per sequence
        for i in seqs:
            rows.append((spans[i][0], self.seq_lens[i], self.query_lens[i], self.query_starts[i]))
        lo, hi, ql, qs = torch.tensor(rows, dtype=torch.int64).unbind(1)
        max_k, max_q = int((hi - lo).max()), int(ql.max())
        t = torch.arange(max_k)[None, :]
        kpos = lo[:, None] + t
        key_valid = kpos < hi[:, None]
        pos = torch.minimum(kpos, (hi - 1)[:, None])  # padding -> the last (written) key
        tables = self.block_tables[seqs]
        blocks = tables.gather(1, pos // bs)
        slots = slot_of(blocks, pos, bs)
        j = torch.arange(max_q)[None, :]
        q_valid = j < ql[:, None]
        q_rows = qs[:, None] + torch.minimum(j, (ql - 1)[:, None])
        qpos = (hi - ql)[:, None] + j
        all_keys, all_q = bool(key_valid.all()), bool(q_valid.all())
        mask: torch.Tensor | None = None
        is_causal = False
        bias: torch.Tensor | None = None
        if max_q == 1:  # the single query at seq_len - 1 sees exactly [lo, seq_len)
            mask = None if all_keys else key_valid[:, None, None, :]
            bias = torch.zeros(key_valid.shape, dtype=torch.float32)
            bias.masked_fill_(~key_valid, float("-inf"))
            bias = bias[:, None, :].to(dev)
        elif (
            all_keys
            and all_q
            and bool((lo == 0).all())
            and bool((hi == ql).all())
            and max_q == max_k
            and (window is None or window >= max_k)
        ):
            is_causal = True
        else:
            mask = self._masks(kpos, qpos, key_valid, window)[:, None]
        flat_valid = q_valid.reshape(-1)
        out_rows = q_rows.reshape(-1)[flat_valid]
        identity = max_q == 1 and all_q and out_rows.tolist() == list(range(self.query_starts[-1]))
        return SeqBucket(
            seqs=seqs,
            streamed=False,
            index=slots.to(dev),
            key_offset=0,
            num_keys=max_k,
            q_rows=q_rows.to(dev),
            q_valid=None if all_q else flat_valid.to(dev),
            out_rows=out_rows.to(dev),
            attn_mask=None if mask is None else mask.to(dev),
            is_causal=is_causal,
            max_q=max_q,
            identity_rows=identity,
            min_block=int(blocks.min()),
            max_block=int(blocks.max()),
            key_bias=bias,
        )
