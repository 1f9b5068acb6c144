"""The typed step plan: what ``AttentionBackend.plan`` returns once per step.

A step (one ``AttentionMetadata`` per KV group) is validated **once**, by
``check_step`` when a plan is built; every layer's ``forward`` then receives the plan
and checks only what differs per layer (its query, cache and spec:
``kvpage.attention.checks.check_forward``). Checks that depend on a cache's
``(block_size, num_blocks)`` (block-table width, block ids in the pool) are the same
for every layer of a KV group: they run for the first layer and are remembered in the
plan (``StepPlan.tables_checked``). The engine's runner goes further: it validates its
caches once and each step's plan against them before any layer runs
(``checks.check_step_layers``, ``StepPlan.layers_checked``), and the CPU backends'
``forward`` then checks nothing per layer.

Each backend subclasses ``StepPlan`` with its own frozen fields (precomputed tensors,
launch parameters) — never an untyped dict. Build one with
``MyPlan(**step_fields(meta), my_field=...)``: ``step_fields`` runs ``check_step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.errors import DTypeError, ShapeError

#: dtypes kernels accept for slot mappings, block tables and block pairs
INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """One step, validated: the base of every backend's plan.

    Attributes:
        meta: the step's metadata (not copied; must not change while the plan is used).
        num_seqs: sequences in the step.
        num_tokens: query rows in the step (``sum(query_lens)``); the first dimension
            of every layer's query and output.
        max_query_len: longest query (1 for a pure decode step; 0 for an empty step).
        is_decode: every sequence has exactly one query token (``num_tokens ==
            num_seqs``); a backend may take a decode-specialized kernel.
        device: where the step's tensors live.
        tables_checked: ``(block_size, num_blocks)`` pairs whose block-table checks
            passed this step (``kvpage.attention.checks.check_tables``; a memo, not
            input).
        layers_checked: every layer's cache, spec and pool was validated for this step
            before any layer ran (``kvpage.attention.checks.check_step_layers``, the
            engine's runner): ``forward`` then skips its per-layer argument checks
            (``check_forward``). False (a plan used directly) = ``forward`` checks.
        checked_slot_mapping: ``meta.slot_mapping`` once ``check_step_layers`` checked its
            slots against every pool of the group (None before, and with
            ``KVPAGE_CHECK_EVERY_LAYER``): ``write_kv(..., slot_mapping, plan=plan)`` with
            this very tensor skips ``check_write_kv``; any other slot mapping, or no
            plan, is checked.
    """

    meta: AttentionMetadata
    num_seqs: int
    num_tokens: int
    max_query_len: int
    is_decode: bool
    device: torch.device
    tables_checked: set[tuple[int, int]] = field(default_factory=set, repr=False, compare=False)
    layers_checked: bool = field(default=False, repr=False, compare=False)
    checked_slot_mapping: torch.Tensor | None = field(default=None, repr=False, compare=False)


def check_step(meta: AttentionMetadata) -> None:
    """Validate what is constant for the whole step (every layer of a KV group).

    Checks: host lists of one length per sequence with ``0 <= query_len <= seq_len``;
    ``max_query_len``/``max_seq_len`` equal to their lists' maxima; ``query_start_loc``
    ``[num_seqs + 1]``, ``seq_lens`` ``[num_seqs]``, ``block_tables``
    ``[num_seqs, max_blocks]`` and ``slot_mapping`` ``[num_tokens]``, all int32|int64
    on one device.

    Raises:
        ShapeError: a length, shape or device disagrees (the message names it).
        DTypeError: an index tensor is not an integer tensor.
    """
    n = len(meta.seq_lens_cpu)
    if len(meta.query_lens_cpu) != n:
        raise ShapeError(
            f"meta.query_lens_cpu: expected {n} entries (one per sequence), got "
            f"{len(meta.query_lens_cpu)}"
        )
    tokens = 0
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q < 0 or q > s:
            raise ShapeError(f"meta.query_lens_cpu[{i}]: expected 0 <= q <= {s}, got {q}")
        tokens += q
    if meta.max_query_len != max(meta.query_lens_cpu, default=0):
        raise ShapeError(
            f"meta.max_query_len: expected {max(meta.query_lens_cpu, default=0)}, got "
            f"{meta.max_query_len}"
        )
    if meta.max_seq_len != max(meta.seq_lens_cpu, default=0):
        raise ShapeError(
            f"meta.max_seq_len: expected {max(meta.seq_lens_cpu, default=0)}, got "
            f"{meta.max_seq_len}"
        )
    dev = meta.seq_lens.device
    want: dict[str, tuple[torch.Tensor, tuple[int, ...] | None]] = {
        "meta.query_start_loc": (meta.query_start_loc, (n + 1,)),
        "meta.seq_lens": (meta.seq_lens, (n,)),
        "meta.block_tables": (meta.block_tables, None),
        "meta.slot_mapping": (meta.slot_mapping, (tokens,)),
    }
    for name, (t, shape) in want.items():
        if t.dtype not in INDEX_DTYPES:
            raise DTypeError(f"{name}: expected int32|int64, got {t.dtype}")
        if shape is not None and tuple(t.shape) != shape:
            raise ShapeError(f"{name}: expected {list(shape)}, got {list(t.shape)}")
        if t.device != dev:
            raise ShapeError(f"{name}.device: expected {dev} (meta.seq_lens), got {t.device}")
    bt = meta.block_tables
    if bt.dim() != 2 or bt.shape[0] != n:
        raise ShapeError(f"meta.block_tables: expected [{n}, max_blocks], got {list(bt.shape)}")


def step_fields(meta: AttentionMetadata) -> dict[str, Any]:
    """``check_step(meta)``, then the ``StepPlan`` fields of ``meta`` as keyword
    arguments (for ``MyPlan(**step_fields(meta), ...)``).

    Raises:
        ShapeError, DTypeError: see ``check_step``.
    """
    check_step(meta)
    tokens = sum(meta.query_lens_cpu)
    return {
        "meta": meta,
        "num_seqs": len(meta.seq_lens_cpu),
        "num_tokens": tokens,
        "max_query_len": meta.max_query_len,
        "is_decode": tokens == len(meta.seq_lens_cpu) and meta.max_query_len == 1,
        "device": meta.seq_lens.device,
    }


def plan_step(meta: AttentionMetadata) -> StepPlan:
    """A validated ``StepPlan`` with no backend data (for backends that precompute
    nothing per step, like the float64 reference).

    Raises:
        ShapeError, DTypeError: see ``check_step``.
    """
    return StepPlan(**step_fields(meta))
