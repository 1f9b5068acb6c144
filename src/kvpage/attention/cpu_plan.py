"""The step plan of the CPU kernel backends (the ``numba-cpu`` and ``native-cpu``
plugins share it, so neither imports the other): host arrays the kernel reads, and the
work split across threads.

Built once per step from the host lists (``query_lens_cpu``, ``seq_lens_cpu``); every
layer of the KV group shares it. The work units of a layer depend only on its number of
KV heads and the thread count, so they are memoized per ``(num_kv_heads, threads)``.

Work split: a unit is ``(sequence, rows r0..r1-1 of its query, KV heads h0..h1-1)``,
at most ``ROWS_PER_UNIT`` query rows, so one long prompt is cut into pieces that run
on different threads; a unit takes every KV head (each block's K and V are then read
in one pass instead of once per head: 8 % less CPU time on a 200-sequence decode at
head_dim 32) unless there are too few units to go round. Units are dealt to ``threads`` contiguous parts of equal estimated
cost (keys read x (query rows x GQA group + 2), the multiply-adds of the unit plus its
K/V tile conversion), one parallel iteration per part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.attention.plan import StepPlan, step_fields
from kvpage.specs import AttentionSpec

#: query rows per work unit: a unit converts each K/V block once for all its rows, so
#: longer units convert less; shorter ones balance a lone long prefill across threads
ROWS_PER_UNIT = 64
#: with fewer (sequence, rows) units than this many per thread, units are split by KV
#: head so that every thread gets work (e.g. one sequence's decode)
SPLIT_HEADS_BELOW = 4


@dataclass(frozen=True, kw_only=True)
class CpuPlan(StepPlan):
    """The validated step plus the kernel's host arrays.

    Attributes:
        query_start: ``[num_seqs + 1]`` int64, first query row of each sequence.
        seq_lens: ``[num_seqs]`` int64.
        block_tables: ``[num_seqs, max_blocks]`` int32 C-contiguous numpy copy.
        threads: compute threads of this step (``torch.get_num_threads()`` when the
            plan was built).
        work: memo ``(num_kv_heads, group) -> (units, bounds)`` (see ``units_for``).
    """

    query_start: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    threads: int
    work: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def from_meta(cls, meta: AttentionMetadata, threads: int) -> CpuPlan:
        """Validate the step (``check_step``) and build the host arrays.

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.plan.check_step``.
        """
        fields = step_fields(meta)
        qs = np.zeros(len(meta.query_lens_cpu) + 1, dtype=np.int64)
        np.cumsum(np.asarray(meta.query_lens_cpu, dtype=np.int64), out=qs[1:])
        bt = meta.block_tables
        tables = np.ascontiguousarray(bt.detach().cpu().numpy(), dtype=np.int32)
        return cls(
            **fields,
            query_start=qs,
            seq_lens=np.asarray(meta.seq_lens_cpu, dtype=np.int64),
            block_tables=tables,
            threads=max(1, threads),
        )

    def units_for(self, num_kv_heads: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        """``(units [n, 5] int64 (seq, r0, r1, h0, h1), bounds [threads + 1] int64)``
        for a layer with ``num_kv_heads`` KV heads of ``group`` query heads each."""
        key = (num_kv_heads, group)
        if key not in self.work:
            self.work[key] = _split(
                self.query_start, self.seq_lens, num_kv_heads, group, self.threads
            )
        return self.work[key]


def _split(
    query_start: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int, group: int, threads: int
) -> tuple[np.ndarray, np.ndarray]:
    qlens = np.diff(query_start)
    seq_ids = np.nonzero(qlens > 0)[0]
    chunks = (qlens[seq_ids] + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT
    seq_of_chunk = np.repeat(seq_ids, chunks)
    first_chunk = np.cumsum(chunks) - chunks
    k = np.arange(seq_of_chunk.shape[0]) - np.repeat(first_chunk, chunks)
    r0 = k * ROWS_PER_UNIT
    r1 = np.minimum(r0 + ROWS_PER_UNIT, qlens[seq_of_chunk])
    ctx = seq_lens[seq_of_chunk] - qlens[seq_of_chunk]
    cost = (ctx + r1) * ((r1 - r0) * group + 2)
    n = seq_of_chunk.shape[0]
    # all KV heads of a block in one unit (the block's K and V are read as one
    # contiguous run); split by head only when there are too few units to go round
    heads = 1 if n < SPLIT_HEADS_BELOW * threads else num_kv_heads
    parts = num_kv_heads // heads
    units = np.empty((n * parts, 5), dtype=np.int64)
    units[:, 0] = np.repeat(seq_of_chunk, parts)
    units[:, 1] = np.repeat(r0, parts)
    units[:, 2] = np.repeat(r1, parts)
    units[:, 3] = np.tile(np.arange(parts) * heads, n)
    units[:, 4] = units[:, 3] + heads
    cost = cost * heads
    cum = np.cumsum(np.repeat(cost, parts))
    total = int(cum[-1]) if cum.shape[0] else 0
    bounds = np.empty(threads + 1, dtype=np.int64)
    bounds[0] = 0
    bounds[-1] = units.shape[0]
    if threads > 1:
        targets = total * np.arange(1, threads) / threads
        bounds[1:-1] = np.searchsorted(cum, targets, side="left") + 1
        np.minimum(bounds, units.shape[0], out=bounds)
    return units, bounds


def torch_threads() -> int:
    """The process's torch intra-op thread count (the engine's ``num_threads``)."""
    return int(torch.get_num_threads())


def forward_operands(
    query: torch.Tensor, plan: CpuPlan, spec: AttentionSpec, out: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray] | None]:
    """What a CPU kernel's ``forward`` hands the kernel (numba-cpu and native-cpu alike).

    Returns:
        ``(out, None)`` for an empty step (``out`` as given, or a new empty tensor shaped
        like ``query``), else ``(out, (res, q, units, bounds))``: ``res`` the float32
        contiguous ``[num_tokens, num_q_heads, head_dim]`` the kernel writes (``out``
        itself when it is float32 and contiguous, else a scratch tensor the caller
        copies into ``out``), ``q`` the query as float32 contiguous, and the plan's work
        units and part bounds for ``spec``'s GQA group (:meth:`CpuPlan.units_for`).
    """
    direct = query.dtype == torch.float32
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if plan.num_tokens == 0:
        return out, None
    res = out if direct and out.is_contiguous() else torch.empty(query.shape, dtype=torch.float32)  # fmt: skip
    q = query if direct and query.is_contiguous() else query.float().contiguous()
    hkv = spec.num_kv_heads
    key = (hkv, spec.num_q_heads // hkv)
    work = plan.work.get(key)  # units_for's memo, read here: no call per layer
    units, bounds = work if work is not None else plan.units_for(*key)
    return out, (res, q, units, bounds)
