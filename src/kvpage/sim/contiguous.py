"""Contiguous-reservation allocators: how serving systems before PagedAttention held KV.

Each request gets one contiguous run of slots, reserved in full when it is admitted
(Orca-style; the PagedAttention paper, Kwon et al. SOSP 2023, sec. 2.3 and Fig. 2):

* ``max``: ``max_model_len`` slots per request ("Orca (Max)");
* ``pow2``: the next power of two >= the request's final length, capped at
  ``max_model_len`` ("Orca (Pow2)");
* ``oracle``: exactly the final length, prompt + output ("Orca (Oracle)" — it knows
  the output length in advance, which no real system does).

Slots are handed out first-fit from a list of free extents, so variable-size
reservations also suffer external fragmentation (a request may not fit although enough
slots are free in total). Reserved slots that hold no token yet (future output) and
slots past the final length are the internal waste the paper measured.

:class:`ContiguousAllocator` implements :class:`kvpage.cache.KVAllocator`, the contract
the scheduler uses (``allocate``/``free``/``commit``/``get_num_cached_tokens``/...), so
``kvpage.engine.Scheduler`` drives it unchanged. No prefix caching.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpage.cache.allocation import Allocation
from kvpage.errors import AllocationError, SpecError

RESERVATIONS = ("max", "pow2", "oracle")


@dataclass
class ContiguousStats:
    """Counters (same names as ``kvpage.cache.CacheStats`` where they mean the same)."""

    allocation_failures: int = 0
    allocations: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return 0.0


@dataclass
class _Extent:
    start: int
    reserved: int
    num_tokens: int


class ContiguousAllocator:
    """First-fit contiguous reservation of KV slots.

    Args:
        num_slots: KV slots (tokens) in the pool.
        reservation: ``"max"``, ``"pow2"`` or ``"oracle"``.
        max_model_len: longest sequence, tokens.
        final_len: request id -> final length in tokens (prompt + output), needed by
            ``pow2`` and ``oracle``.

    Attributes:
        num_groups: 1. block_size: 1 (a slot). max_request_tokens: ``num_slots``.

    Raises:
        SpecError: unknown reservation, sizes < 1, or ``max`` with
            ``max_model_len > num_slots``.
    """

    num_groups = 1
    block_size = 1

    def __init__(
        self,
        num_slots: int,
        reservation: str,
        max_model_len: int,
        final_len: Callable[[str], int] | None = None,
    ) -> None:
        if reservation not in RESERVATIONS:
            raise SpecError(f"reservation: expected one of {RESERVATIONS}, got {reservation!r}")
        if num_slots < 1 or max_model_len < 1:
            raise SpecError(
                f"num_slots/max_model_len: expected >= 1, got {num_slots}/{max_model_len}"
            )
        if reservation == "max" and max_model_len > num_slots:
            raise SpecError(
                f"max_model_len: expected <= num_slots={num_slots} for max reservation, "
                f"got {max_model_len}"
            )
        if reservation != "max" and final_len is None:
            raise SpecError(f"final_len: expected a callable for {reservation!r}, got None")
        self.num_slots = num_slots
        self.reservation = reservation
        self.max_model_len = max_model_len
        self.final_len = final_len
        self.max_request_tokens = num_slots if reservation != "max" else max_model_len
        self._free: list[tuple[int, int]] = [(0, num_slots)]  # sorted (start, length)
        self._reqs: dict[str, _Extent] = {}
        self._stats = ContiguousStats()
        self.reserved_slots = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def stats(self) -> ContiguousStats:
        return self._stats

    @property
    def usage(self) -> float:
        """Reserved slots / all slots."""
        return self.reserved_slots / self.num_slots

    @property
    def num_free_blocks(self) -> int:
        """Unreserved slots."""
        return self.num_slots - self.reserved_slots

    @property
    def num_used_blocks(self) -> int:
        """Reserved slots (a slot is this allocator's block)."""
        return self.reserved_slots

    def live_tokens(self) -> int:
        """Slots holding a token (allocated positions of resident requests)."""
        return sum(e.num_tokens for e in self._reqs.values())

    def reservation_for(self, request_id: str, num_tokens: int) -> int:
        """Slots reserved for a request whose first allocation covers ``num_tokens``."""
        if self.reservation == "max":
            r = self.max_model_len
        else:
            assert self.final_len is not None
            r = self.final_len(request_id)
            if self.reservation == "pow2":
                r = min(1 << max(0, (r - 1).bit_length()), max(self.max_model_len, r))
        return max(r, num_tokens)

    def get_num_cached_tokens(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int:
        """Always 0: no prefix caching."""
        return 0

    def blocks_needed(self, num_tokens: int) -> int:
        return max(num_tokens, 0)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """``[start slot]`` of the request's extent (one entry: it is contiguous)."""
        return [self._get(request_id).start]

    def block_tables(self, request_id: str) -> list[list[int]]:
        """``[block_table(request_id)]`` (one group)."""
        return [self.block_table(request_id)]

    def num_allocated_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_tokens

    # ---- allocation ------------------------------------------------------------------------
    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_cached_tokens: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> Allocation | None:
        """Reserve the request's extent on the first call; later calls only check that
        the tokens fit the reservation. Returns None (state unchanged, one failure
        counted) when no free extent is large enough / the reservation is exceeded."""
        if num_new_tokens < 0 or num_cached_tokens:
            raise AllocationError(
                f"num_new_tokens/num_cached_tokens: expected >= 0 / 0, got "
                f"{num_new_tokens}/{num_cached_tokens}"
            )
        e = self._reqs.get(request_id)
        if e is not None:
            if e.num_tokens + num_new_tokens > e.reserved:
                self._stats.allocation_failures += 1
                return None
            e.num_tokens += num_new_tokens
            self._stats.allocations += 1
            return Allocation(0, [[]], [[]])
        need = self.reservation_for(request_id, num_new_tokens)
        for i, (start, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, length - need)
                e = _Extent(start, need, num_new_tokens)
                self._reqs[request_id] = e
                self.reserved_slots += need
                self._stats.allocations += 1
                self._stats.prefix_queries_tokens += len(token_ids)
                return Allocation(0, [[start]], [[]])
        self._stats.allocation_failures += 1
        return None

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """No-op (no prefix cache); checks the request exists."""
        self._get(request_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        raise AllocationError("fork: expected a paged allocator, got a contiguous one")

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Drop the positions past the first ``num_tokens`` (the extent stays reserved).

        Raises:
            AllocationError: unknown request or ``num_tokens`` outside ``[0, allocated]``.
        """
        e = self._get(request_id)
        if not 0 <= num_tokens <= e.num_tokens:
            raise AllocationError(f"num_tokens: expected in [0, {e.num_tokens}], got {num_tokens}")
        e.num_tokens = num_tokens

    def free(self, request_id: str) -> None:
        """Return the request's extent, merging it with free neighbours."""
        e = self._get(request_id)
        del self._reqs[request_id]
        self.reserved_slots -= e.reserved
        start, length = e.start, e.reserved
        i = bisect.bisect_left(self._free, (start, 0))
        if i < len(self._free) and start + length == self._free[i][0]:
            length += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start = self._free[i - 1][0]
            length += self._free[i - 1][1]
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, length))

    def check_integrity(self) -> None:
        """Free + reserved == all slots and no overlap (AssertionError otherwise)."""
        spans = sorted(
            [(s, n) for s, n in self._free] + [(e.start, e.reserved) for e in self._reqs.values()]
        )
        pos = 0
        for s, n in spans:
            assert s == pos, f"gap or overlap at slot {pos}: next span starts at {s}"
            pos += n
        assert pos == self.num_slots, f"spans cover {pos} slots, expected {self.num_slots}"

    def _get(self, request_id: str) -> _Extent:
        e = self._reqs.get(request_id)
        if e is None:
            raise AllocationError(f"request_id: expected an allocated request, got {request_id!r}")
        return e


__all__ = ["RESERVATIONS", "ContiguousAllocator", "ContiguousStats"]
