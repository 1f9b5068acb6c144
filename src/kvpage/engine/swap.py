"""Swap preemption: a preempted sequence's KV blocks go to host memory and come back.

With ``EngineConfig.preemption_mode="swap"`` the scheduler asks a :class:`Swapper`
before freeing a victim's blocks (``Scheduler._preempt``); when the swapper copies them
out, the victim keeps its progress (``Request.swapped_tokens``) and, when readmitted,
gets fresh blocks into which the swapper copies the K/V back before the step runs
(``Scheduler.schedule``), instead of recomputing its prompt and output so far.

Cost model (per victim, :class:`SwapCostModel`): swapping ``B`` bytes costs
``2 * B / host_bandwidth`` seconds (out and back in); recomputing costs
``T / prefill_tokens_per_s`` seconds for its ``T`` computed tokens. Swap is chosen when
it is cheaper and the bytes fit in ``swap_space_bytes``; otherwise the victim is
recomputed as in recompute mode. ``prefill_tokens_per_s`` is measured by the engine: an
exponential moving average (weight 0.2) of tokens / model seconds over steps that
compute at least :data:`MIN_PREFILL_TOKENS` tokens (smaller steps are dominated by
per-step overhead); until a step is seen, :data:`DEFAULT_PREFILL_TOKENS_PER_S`.
``host_bandwidth`` defaults by device: :data:`HOST_BANDWIDTH` (bytes/s; CPU: a memory
copy, conservatively 5 GB/s; CUDA: PCIe 4.0 x16 at ~25 GB/s effective, the figure vLLM
and LMCache use for pinned-memory copies). Recompute here ignores prefix-cache hits the
victim may get back (a bias towards swap when its blocks would survive in the pool).

KV groups (sliding-window hybrids on a unified pool, docs/architecture.md "One pool for
every kind of layer"): a victim's blocks are copied per group, only those a
continuation needs (``KVCacheManager.swap_blocks``: a full group all its blocks, a
sliding group those inside the window of its next position), each group through its own
mover (its layers' caches); ``B`` is their sum. On readmission
(``KVCacheManager.allocate_swapped``) each group gets new blocks for exactly those
positions (a sliding group null entries below the window, as a prefix hit leaves them),
and the payloads are written back into them before the step runs.

Hybrid models (recurrent state layers, ``kvpage.cache.state_pool``): a victim's live
state slot (every state layer's conv and ssm rows, :class:`StateMover`) goes to host
memory beside its blocks and counts in ``B`` and against ``swap_space_bytes``; on
readmission it is written into the new live slot. The caller (``Preemptor``) runs the
queued state slot copies first (``KVCacheManager.take_state_copies``, in order), so the
slot read holds the state after the victim's computed tokens and a slot written holds
nothing a queued copy still has to read (docs/architecture.md, "Recurrent state").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpage.cache.tier_store import Payload, payload_nbytes
from kvpage.cache.tiered import BlockMover

#: host <-> device copy bandwidth presets, bytes/s (see the module docstring)
HOST_BANDWIDTH = {"cpu": 5e9, "cuda": 25e9}
#: steps with fewer computed tokens do not update the prefill rate
MIN_PREFILL_TOKENS = 32
#: prefill rate assumed before a step was measured (tokens/s): the bundled model's
#: order of magnitude on one CPU thread
DEFAULT_PREFILL_TOKENS_PER_S = 5000.0


class StateMover(Protocol):
    """Copies of whole recurrent state slots between the state caches and host memory
    (the engine's: ``kvpage.engine.kv_transfer.TorchStateMover``).

    Attributes:
        slot_nbytes: payload bytes of one slot (every state layer's conv and ssm row).
    """

    slot_nbytes: int

    def read_slot(self, slot: int) -> Payload:
        """A host copy of slot ``slot`` of every state cache (``slot_nbytes`` bytes)."""
        ...

    def write_slot(self, slot: int, payload: Payload) -> None:
        """Overwrite slot ``slot`` of every state cache with ``payload``."""
        ...

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Run slot copies ``(src, dst)`` in order (the state pool's queued copies)."""
        ...


@dataclass
class SwapCostModel:
    """The swap-or-recompute rule (module docstring).

    Attributes:
        host_bandwidth: bytes/s of one direction of a host <-> device copy.
        prefill_tokens_per_s: measured prefill rate (EMA).
    """

    host_bandwidth: float
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S

    def swap_seconds(self, num_bytes: int) -> float:
        """Estimated seconds to swap ``num_bytes`` out and back in."""
        return 2.0 * num_bytes / self.host_bandwidth

    def recompute_seconds(self, num_tokens: int) -> float:
        """Estimated seconds to recompute ``num_tokens`` tokens."""
        return num_tokens / self.prefill_tokens_per_s

    def prefer_swap(self, num_tokens: int, num_bytes: int) -> bool:
        """Whether swapping is cheaper than recomputing."""
        return self.swap_seconds(num_bytes) < self.recompute_seconds(num_tokens)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Feed one step (tokens computed, model seconds) into the prefill-rate EMA."""
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            rate = num_tokens / seconds
            self.prefill_tokens_per_s += 0.2 * (rate - self.prefill_tokens_per_s)


@dataclass
class SwapStats:
    """Counters of the swapper (blocks, bytes, seconds).

    Attributes:
        swap_outs / swap_ins: sequences swapped out / back in.
        recomputed: victims the cost model or the swap space sent to recompute.
        bytes_out / bytes_in: payload bytes copied to / from host memory.
        transfer_s: wall seconds of those copies.
    """

    swap_outs: int = 0
    swap_ins: int = 0
    recomputed: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    transfer_s: float = 0.0


class Swapper:
    """Host-memory store of swapped-out sequences (see the module docstring).

    Args:
        movers: per KV group, the mover copying that group's blocks (its layers'
            caches), in group order (a one-group model: one).
        block_size: tokens per block.
        swap_space_bytes: most bytes held at once (blocks and state slots together).
        cost: the decision rule.
        state: copies the live state slot of a hybrid model's sequences (None = no
            state layers).

    Attributes:
        used_bytes: bytes held now.
        stats: :class:`SwapStats`.

    Raises:
        ValueError: no mover.
    """

    def __init__(
        self,
        movers: Sequence[BlockMover],
        block_size: int,
        swap_space_bytes: int,
        cost: SwapCostModel,
        *,
        state: StateMover | None = None,
    ) -> None:
        if not movers:
            raise ValueError("movers: expected one block mover per KV group, got none")
        self.movers = list(movers)
        self.state = state
        self.block_size = block_size
        self.capacity_bytes = swap_space_bytes
        self.cost = cost
        self.used_bytes = 0
        self.stats = SwapStats()
        #: request id -> per group, its swapped blocks' payloads
        self._store: dict[str, list[list[Payload]]] = {}
        #: request id -> its swapped live state slot (hybrid models)
        self._state_store: dict[str, Payload] = {}

    def swap_out(
        self,
        request_id: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        state_slot: int | None = None,
    ) -> bool:
        """Copy ``blocks`` (per KV group, the blocks of ``request_id`` that a
        continuation after its first ``num_tokens`` tokens needs:
        ``KVCacheManager.swap_blocks``) and, on a hybrid model, its live state slot
        ``state_slot`` (the state after those tokens) to host memory if that is cheaper
        and fits; True when done (the caller keeps the progress and frees the blocks and
        the slot), False for recompute (nothing copied).

        Raises:
            ValueError: ``blocks`` for another number of groups than the movers, or
                ``state_slot`` given without a state mover or missing with one (nothing
                changed).
        """
        if len(blocks) != len(self.movers):
            raise ValueError(
                f"blocks: expected {len(self.movers)} groups' block lists for "
                f"{request_id!r}, got {len(blocks)}"
            )
        if (state_slot is None) != (self.state is None):
            raise ValueError(
                f"state_slot: expected {'none' if self.state is None else 'a live slot'} "
                f"for {request_id!r}, got {state_slot!r}"
            )
        nb = sum(len(b) for b in blocks)
        nbytes = sum(len(b) * m.block_nbytes for b, m in zip(blocks, self.movers))
        nbytes += self.state_nbytes
        if (
            nb == 0
            or self.used_bytes + nbytes > self.capacity_bytes
            or not self.cost.prefer_swap(num_tokens, nbytes)
        ):
            self.stats.recomputed += 1
            return False
        t0 = time.perf_counter()
        payloads = [m.read_blocks(list(b)) for b, m in zip(blocks, self.movers)]
        self._store[request_id] = payloads
        n = sum(payload_nbytes(p) for group in payloads for p in group)
        if self.state is not None:
            assert state_slot is not None
            st = self.state.read_slot(state_slot)
            self._state_store[request_id] = st
            n += payload_nbytes(st)
        self.stats.transfer_s += time.perf_counter() - t0
        self.used_bytes += n
        self.stats.bytes_out += n
        self.stats.swap_outs += 1
        return True

    @property
    def state_nbytes(self) -> int:
        """Host bytes of one swapped live state slot (0 without state layers)."""
        return 0 if self.state is None else self.state.slot_nbytes

    def swap_in(
        self,
        request_id: str,
        blocks: Sequence[Sequence[int]],
        *,
        state_slot: int | None = None,
    ) -> None:
        """Copy ``request_id``'s swapped blocks into ``blocks`` (per KV group, its new
        blocks at the positions swapped out: ``KVCacheManager.swap_blocks`` after
        ``allocate_swapped``) and, on a hybrid model, its swapped state into its new
        live slot ``state_slot``; forget them.

        Raises:
            KeyError: nothing swapped out for ``request_id``.
            ValueError: ``blocks`` of another shape (groups, blocks per group) than the
                swapped blocks, or ``state_slot`` missing on a hybrid model / given
                without one (nothing changed).
        """
        payloads = self._store[request_id]
        got = [len(b) for b in blocks]
        want = [len(p) for p in payloads]
        if got != want:
            raise ValueError(
                f"blocks: expected {want} blocks per group for {request_id!r}, got {got}"
            )
        if (state_slot is None) != (self.state is None):
            raise ValueError(
                f"state_slot: expected {'none' if self.state is None else 'a live slot'} "
                f"for {request_id!r}, got {state_slot!r}"
            )
        t0 = time.perf_counter()
        for b, p, m in zip(blocks, payloads, self.movers):
            m.write_blocks(list(b), p)
        n = sum(payload_nbytes(p) for group in payloads for p in group)
        if self.state is not None:
            assert state_slot is not None
            st = self._state_store.pop(request_id)
            self.state.write_slot(state_slot, st)
            n += payload_nbytes(st)
        self.stats.transfer_s += time.perf_counter() - t0
        del self._store[request_id]
        self.used_bytes -= n
        self.stats.bytes_in += n
        self.stats.swap_ins += 1

    def discard(self, request_id: str) -> None:
        """Forget a swapped-out sequence that finished or was aborted (no-op if none)."""
        payloads = self._store.pop(request_id, None)
        if payloads is not None:
            self.used_bytes -= sum(payload_nbytes(p) for group in payloads for p in group)
        st = self._state_store.pop(request_id, None)
        if st is not None:
            self.used_bytes -= payload_nbytes(st)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._store


__all__ = [
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "HOST_BANDWIDTH",
    "MIN_PREFILL_TOKENS",
    "StateMover",
    "SwapCostModel",
    "SwapStats",
    "Swapper",
]
