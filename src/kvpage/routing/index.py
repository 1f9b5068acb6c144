"""The router's per-replica view of the prefix-cache blocks each replica holds.

:class:`PrefixIndex` applies :class:`~kvpage.routing.events.KVEventBatch` objects in
sequence order. It never applies a batch out of order and never keeps a view it knows
to be stale:

* a batch with ``seq == last + 1`` of the known epoch is applied;
* a batch with ``seq <= last`` (a duplicate or a batch already covered by a snapshot)
  is dropped and ``apply`` returns True (nothing to do);
* a gap (``seq > last + 1``), an unknown replica or a new epoch (a restarted replica)
  makes ``apply`` return False: the caller must fetch a
  :class:`~kvpage.routing.events.KVSnapshot` and call :meth:`PrefixIndex.resync`. Until
  then the replica is *stale*: :meth:`PrefixIndex.matched_blocks` reports 0 blocks for
  it, so old content stops attracting traffic.
* :meth:`PrefixIndex.remove` drops a dead replica at once.

Lookups use an inverted map ``hash -> replicas holding it``: the leading-match count of
a request costs one dict lookup and one set intersection per matched block, whatever
the number of replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpage.routing.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)


@dataclass
class IndexStats:
    """Counters of a :class:`PrefixIndex` (monotone except the lag fields).

    Attributes:
        batches_applied: batches applied in order.
        events_applied: events inside them.
        batches_dropped: duplicate / already-covered batches ignored (seq <= last).
        gaps: batches refused because one or more earlier batches were missing.
        unknown: batches refused from an unknown replica or a new epoch (restart).
        joins: replicas added by their first snapshot.
        resyncs: snapshots applied to a replica already known (after a gap or restart).
        removals: replicas removed (dead).
        last_lag_s: ``now - batch.ts`` of the last applied batch, seconds.
        max_lag_s: the largest such lag seen.
    """

    batches_applied: int = 0
    events_applied: int = 0
    batches_dropped: int = 0
    gaps: int = 0
    unknown: int = 0
    joins: int = 0
    resyncs: int = 0
    removals: int = 0
    last_lag_s: float = 0.0
    max_lag_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Replica:
    __slots__ = ("epoch", "seq", "hashes", "stale")

    def __init__(self, epoch: str, seq: int) -> None:
        self.epoch = epoch
        self.seq = seq
        self.hashes: set[bytes] = set()
        self.stale = False


class PrefixIndex:
    """Per-replica sets of held block hashes, fed by KV events (module docstring).

    Args:
        clock: "now" for the lag counters (default ``time.time``; a simulator passes
            its clock).

    Attributes:
        stats: the :class:`IndexStats` counters.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._where: dict[bytes, set[str]] = {}
        self.stats = IndexStats()

    # ---- queries ------------------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        """Known replica ids (stale ones included), in insertion order."""
        return list(self._replicas)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def seq(self, replica_id: str) -> int | None:
        """The seq of the last batch (or snapshot) applied for ``replica_id``; None if
        the replica is unknown."""
        r = self._replicas.get(replica_id)
        return None if r is None else r.seq

    def epoch(self, replica_id: str) -> str | None:
        """The publisher epoch the view follows; None if unknown."""
        r = self._replicas.get(replica_id)
        return None if r is None else r.epoch

    def is_stale(self, replica_id: str) -> bool:
        """True when a batch was refused for this replica and no resync followed (an
        unknown replica counts as stale)."""
        r = self._replicas.get(replica_id)
        return r is None or r.stale

    def view(self, replica_id: str) -> frozenset[bytes]:
        """The hashes the index believes ``replica_id`` holds (empty if unknown)."""
        r = self._replicas.get(replica_id)
        return frozenset() if r is None else frozenset(r.hashes)

    def num_blocks(self, replica_id: str) -> int:
        """How many hashes the view of ``replica_id`` holds (0 if unknown)."""
        r = self._replicas.get(replica_id)
        return 0 if r is None else len(r.hashes)

    def matched_blocks(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per known replica, how many leading blocks of ``block_hashes`` it holds now.

        Args:
            block_hashes: a request's chained block hashes
                (``kvpage.cache.hash_request_blocks``), block 0 first.

        Returns:
            ``{replica_id: n}`` for every known replica, ``0 <= n <= len(block_hashes)``;
            a stale replica (awaiting resync) always gets 0.
        """
        out = {rid: 0 for rid in self._replicas}
        alive = {rid for rid, r in self._replicas.items() if not r.stale}
        where = self._where
        for i, h in enumerate(block_hashes):
            if not alive:
                break
            holders = where.get(h)
            if not holders:
                break
            nxt = alive & holders
            for rid in alive - nxt:
                out[rid] = i
            alive = nxt
        else:
            for rid in alive:
                out[rid] = len(block_hashes)
            return out
        for rid in alive:  # broke out early: every replica still alive matched i blocks
            out[rid] = i
        return out

    # ---- updates ------------------------------------------------------------------
    def apply(self, batch: KVEventBatch) -> bool:
        """Apply ``batch`` if it is the next one of the replica's known epoch.

        Returns:
            True when applied or already covered (``seq <= last``: dropped); False on
            a gap, an unknown replica or a new epoch (then nothing changed except the
            counters and the replica's stale flag: call :meth:`resync`).
        """
        r = self._replicas.get(batch.replica_id)
        st = self.stats
        if r is None or r.epoch != batch.epoch:
            st.unknown += 1
            if r is not None:
                r.stale = True
            return False
        if batch.seq <= r.seq:
            st.batches_dropped += 1
            return True
        if batch.seq != r.seq + 1:
            st.gaps += 1
            r.stale = True
            return False
        if r.stale:  # a refused batch came first: only a snapshot brings the view back
            st.gaps += 1
            return False
        rid = batch.replica_id
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._add(rid, r, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self._discard(rid, r, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._discard(rid, r, list(r.hashes))
        r.seq = batch.seq
        st.batches_applied += 1
        st.events_applied += len(batch.events)
        lag = max(0.0, self._clock() - batch.ts)
        st.last_lag_s = lag
        st.max_lag_s = max(st.max_lag_s, lag)
        return True

    def resync(self, snapshot: KVSnapshot) -> None:
        """Replace the view of ``snapshot.replica_id`` by the snapshot (a new replica is
        added); the next batch applied must be ``snapshot.seq + 1`` of its epoch."""
        rid = snapshot.replica_id
        old = self._replicas.get(rid)
        if old is not None:
            self._discard(rid, old, list(old.hashes))
        r = _Replica(snapshot.epoch, snapshot.seq)
        self._replicas[rid] = r
        self._add(rid, r, snapshot.block_hashes)
        if old is None:
            self.stats.joins += 1
        else:
            self.stats.resyncs += 1

    def remove(self, replica_id: str) -> bool:
        """Forget a (dead) replica at once; False if it was unknown."""
        r = self._replicas.pop(replica_id, None)
        if r is None:
            return False
        self._discard(replica_id, r, list(r.hashes))
        self.stats.removals += 1
        return True

    def _add(self, rid: str, r: _Replica, hashes: Iterable[bytes]) -> None:
        where = self._where
        for h in hashes:
            if h not in r.hashes:
                r.hashes.add(h)
                s = where.get(h)
                if s is None:
                    where[h] = {rid}
                else:
                    s.add(rid)

    def _discard(self, rid: str, r: _Replica, hashes: Iterable[bytes]) -> None:
        where = self._where
        for h in hashes:
            if h in r.hashes:
                r.hashes.discard(h)
                s = where.get(h)
                if s is not None:
                    s.discard(rid)
                    if not s:
                        del where[h]


__all__ = ["IndexStats", "PrefixIndex"]
