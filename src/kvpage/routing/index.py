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

Media: each replica's view is one hash set per medium (``"device"``, the pool; and the
KV tiers ``"host"``, ``"disk"``; events carry it, see :mod:`kvpage.routing.events`).
:meth:`PrefixIndex.matched_blocks` and :meth:`PrefixIndex.view` answer for the device
by default, as before tiers; :meth:`PrefixIndex.matched_media` counts a leading run of
blocks each held in *some* medium, per medium, for a cost that weighs tier hits
(``kvpage.routing.policies.CostWeights``).

Hybrid replicas (recurrent state layers; the snapshot's ``state`` kind): a prefix hit
needs a recurrent-state snapshot at its end, and snapshots arrive as events of medium
``"state"`` keyed by the hash of the block ending at their boundary (and, moved below
the state slots, ``"state_host"`` / ``"state_disk"``). For such a replica
:meth:`PrefixIndex.matched_blocks` and :meth:`PrefixIndex.matched_media` cut the KV
match at the deepest block whose hash has a snapshot in any of those media (the
engine's rule, which promotes a host or disk snapshot on a hit:
``KVCacheManager.get_num_cached_tokens``); a ``recurrent_only`` replica (no KV blocks)
matches up to the deepest snapshot along the whole request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpage.routing.events import (
    EVENT_MEDIA,
    MEDIA,
    STATE_MEDIA,
    STATE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
    check_medium,
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
    __slots__ = ("epoch", "seq", "hashes", "tiers", "stale", "state")

    def __init__(self, epoch: str, seq: int, state: str = "none") -> None:
        self.epoch = epoch
        self.seq = seq
        self.hashes: set[bytes] = set()  # medium "device"
        self.tiers: dict[str, set[bytes]] = {}  # "host" / "disk", and the state media
        self.stale = False
        self.state = state  # kvpage.routing.events.STATE_KINDS

    def deepest_state(self, block_hashes: Sequence[bytes], n: int) -> int:
        """The largest ``k <= n`` whose block ``k - 1`` has a state snapshot in some
        state medium (slots, host rows, disk files; 0 = none)."""
        media = [hs for m in STATE_MEDIA if (hs := self.tiers.get(m))]
        if not media:
            return 0
        for k in range(min(n, len(block_hashes)), 0, -1):
            h = block_hashes[k - 1]
            if any(h in hs for hs in media):
                return k
        return 0

    def media(self, medium: str) -> set[bytes]:
        if medium == "device":
            return self.hashes
        return self.tiers.setdefault(medium, set())


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
        # per medium, hash -> replicas holding it there
        self._wheres: dict[str, dict[bytes, set[str]]] = {m: {} for m in EVENT_MEDIA}
        self._where = self._wheres["device"]
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

    def view(self, replica_id: str, medium: str = "device") -> frozenset[bytes]:
        """The hashes the index believes ``replica_id`` holds in ``medium`` (empty if
        unknown).

        Raises:
            RoutingError: ``medium`` not one of ``kvpage.routing.events.EVENT_MEDIA``
                (``"state"``: the keys of its recurrent-state snapshots).
        """
        check_medium(medium)
        r = self._replicas.get(replica_id)
        if r is None:
            return frozenset()
        return frozenset(r.hashes if medium == "device" else r.tiers.get(medium, ()))

    def num_blocks(self, replica_id: str, medium: str = "device") -> int:
        """How many hashes the view of ``replica_id`` holds in ``medium`` (0 if unknown)."""
        return len(self.view(replica_id, medium))

    def state_kind(self, replica_id: str) -> str | None:
        """The replica's kind of recurrent state (``kvpage.routing.events.STATE_KINDS``,
        from its last snapshot); None if unknown."""
        r = self._replicas.get(replica_id)
        return None if r is None else r.state

    @property
    def has_tiers(self) -> bool:
        """True while some replica's view holds a hash in a tier medium."""
        return any(self._wheres[m] for m in MEDIA[1:])

    def matched_media(self, block_hashes: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """Per known replica, the leading run of ``block_hashes`` held in any medium,
        counted per medium that would serve each block: the device when the pool holds
        it, else the first tier holding it (host before disk, the order a lookup tries).
        The run ends at the first block the replica holds nowhere (a lookup promotes
        tier blocks, so a tier block between device blocks does not end it).

        A stateful replica's run is cut at its deepest state snapshot (module
        docstring); a ``recurrent_only`` one counts its snapshot's blocks as device.

        Returns:
            ``{replica_id: {medium: n}}`` for every known replica (media with n > 0
            only); a stale replica gets ``{}``.
        """
        out: dict[str, dict[str, int]] = {rid: {} for rid in self._replicas}
        alive = {rid for rid, r in self._replicas.items() if not r.stale}
        stateful = {rid for rid in alive if self._replicas[rid].state != "none"}
        runs: dict[str, list[str]] = {rid: [] for rid in stateful}
        wheres = [(m, self._wheres[m]) for m in MEDIA]
        for h in block_hashes:
            if not alive:
                break
            holders = [(m, w.get(h)) for m, w in wheres]
            nxt = set()
            for rid in alive:
                for m, hs in holders:
                    if hs and rid in hs:
                        c = out[rid]
                        c[m] = c.get(m, 0) + 1
                        nxt.add(rid)
                        if rid in runs:
                            runs[rid].append(m)
                        break
            alive = nxt
        for rid, run in runs.items():
            r = self._replicas[rid]
            if r.state == "recurrent_only":
                k = r.deepest_state(block_hashes, len(block_hashes))
                out[rid] = {"device": k} if k else {}
                continue
            counts: dict[str, int] = {}
            for m in run[: r.deepest_state(block_hashes, len(run))]:
                counts[m] = counts.get(m, 0) + 1
            out[rid] = counts
        return out

    def matched_blocks(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per known replica, how many leading blocks of ``block_hashes`` it holds now.

        Args:
            block_hashes: a request's chained block hashes
                (``kvpage.cache.hash_request_blocks``), block 0 first.

        Returns:
            ``{replica_id: n}`` for every known replica, ``0 <= n <= len(block_hashes)``;
            a stale replica (awaiting resync) always gets 0; a stateful replica's ``n``
            is cut at its deepest state snapshot (module docstring).
        """
        out = self._matched_kv(block_hashes)
        for rid, r in self._replicas.items():
            if r.state != "none" and not r.stale:
                n = len(block_hashes) if r.state == "recurrent_only" else out[rid]
                out[rid] = r.deepest_state(block_hashes, n)
        return out

    def _matched_kv(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per known replica, its leading run of ``block_hashes`` on the device (stale:
        0), without the state cut."""
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
                self._add(rid, r, ev.block_hashes, ev.medium)
            elif isinstance(ev, BlockRemoved):
                self._discard(rid, r, ev.block_hashes, ev.medium)
            elif isinstance(ev, AllBlocksCleared):
                self._discard_all(rid, r)
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
            self._discard_all(rid, old)
        r = _Replica(snapshot.epoch, snapshot.seq, snapshot.state)
        self._replicas[rid] = r
        self._add(rid, r, snapshot.block_hashes)
        for m, hs in snapshot.tier_hashes.items():
            self._add(rid, r, hs, check_medium(m))
        self._add(rid, r, snapshot.state_hashes, STATE_MEDIUM)
        for m, hs in snapshot.state_tier_hashes.items():
            self._add(rid, r, hs, check_medium(m))
        if old is None:
            self.stats.joins += 1
        else:
            self.stats.resyncs += 1

    def remove(self, replica_id: str) -> bool:
        """Forget a (dead) replica at once; False if it was unknown."""
        r = self._replicas.pop(replica_id, None)
        if r is None:
            return False
        self._discard_all(replica_id, r)
        self.stats.removals += 1
        return True

    def _add(self, rid: str, r: _Replica, hashes: Iterable[bytes], medium: str = "device") -> None:
        where = self._wheres[medium]
        held = r.media(medium)
        for h in hashes:
            if h not in held:
                held.add(h)
                s = where.get(h)
                if s is None:
                    where[h] = {rid}
                else:
                    s.add(rid)

    def _discard_all(self, rid: str, r: _Replica) -> None:
        self._discard(rid, r, list(r.hashes))
        for m, hs in list(r.tiers.items()):
            self._discard(rid, r, list(hs), m)

    def _discard(
        self, rid: str, r: _Replica, hashes: Iterable[bytes], medium: str = "device"
    ) -> None:
        where = self._wheres[medium]
        held = r.media(medium)
        for h in hashes:
            if h in held:
                held.discard(h)
                s = where.get(h)
                if s is not None:
                    s.discard(rid)
                    if not s:
                        del where[h]


__all__ = ["IndexStats", "PrefixIndex"]
