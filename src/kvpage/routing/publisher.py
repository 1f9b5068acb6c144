"""KVEventPublisher: a replica's pool and KV-tier changes as numbered event batches.

The event types and their wire form are in :mod:`kvpage.routing.events` (which
re-exports :class:`KVEventPublisher`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpage.cache.tier_store import is_state_key
from kvpage.errors import SpecError
from kvpage.routing.events import (
    STATE_MEDIA,
    STATE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
)

if TYPE_CHECKING:
    from kvpage.cache import BlockPool, GroupPool, KVCacheManager
    from kvpage.cache.state_pool import StatePool
    from kvpage.cache.tier_store import DiskTier, HostTier


def _event(kind: str, medium: str, hashes: list[bytes]) -> KVEvent:
    if kind == "stored":
        return BlockStored(tuple(hashes), None, medium)
    if kind == "removed":
        return BlockRemoved(tuple(hashes), medium)
    return AllBlocksCleared()


class _PoolTap:
    """The :class:`PoolListener` attached to one pool; forwards to the publisher."""

    __slots__ = ("pub", "index")

    def __init__(self, pub: KVEventPublisher, index: int) -> None:
        self.pub = pub
        self.index = index

    def on_stored(self, block_id: int, block_hash: bytes) -> None:
        self.pub._stored(self.index, block_hash)

    def on_evicted(self, block_id: int, block_hash: bytes) -> None:
        self.pub._evicted(self.index, block_hash)

    def on_cleared(self) -> None:
        self.pub._cleared(self.index)


class _TierTap:
    """The :class:`~kvpage.cache.tier_store.TierListener` attached to one KV tier."""

    __slots__ = ("pub",)

    def __init__(self, pub: KVEventPublisher) -> None:
        self.pub = pub

    # a state snapshot's file in the disk tier (tier_store.state_key) is not a block:
    # the state pool reports it (_StateTap, "disk")
    def on_demoted(self, block_hash: bytes, tier: str) -> None:
        if not is_state_key(block_hash):
            self.pub._tier_stored(tier, block_hash)

    def on_promoted(self, block_hash: bytes, tier: str) -> None:
        if tier == "host":  # taken out of the host tier; a disk file stays
            self.pub._tier_removed(tier, block_hash)

    def on_dropped(self, block_hash: bytes, tier: str, reason: str) -> None:
        if not is_state_key(block_hash):
            self.pub._tier_removed(tier, block_hash)


#: where a snapshot lives (``StateListener``) -> its event medium
_STATE_PLACE_MEDIUM = dict(zip(("device", "host", "disk"), STATE_MEDIA))


class _StateTap:
    """The :class:`~kvpage.cache.state_pool.StateListener` attached to a hybrid model's
    state pool."""

    __slots__ = ("pub",)

    def __init__(self, pub: KVEventPublisher) -> None:
        self.pub = pub

    def on_snapshot_stored(self, block_hash: bytes, where: str) -> None:
        self.pub._tier_stored(_STATE_PLACE_MEDIUM[where], block_hash)

    def on_snapshot_removed(self, block_hash: bytes, where: str) -> None:
        self.pub._tier_removed(_STATE_PLACE_MEDIUM[where], block_hash)


class KVEventPublisher:
    """Turns a replica's pool and tier changes into numbered :class:`KVEventBatch` objects.

    Attach it to a :class:`~kvpage.cache.KVCacheManager` with :meth:`attach`; it then
    listens to the pools of the manager's full-attention KV groups
    (``KVCacheManager.prefix_pools``), the ones whose hash maps decide a prefix hit.
    With several such pools a hash counts as held while *every* one of them holds it
    (a hit needs all full-attention groups). Sliding-window groups are not tracked:
    for a hybrid model the router's view is the full-attention part.

    With KV tiers attached to the manager (``manager.tiers``, which the engine builds
    before any publisher attaches) it also listens to each tier
    (``TierListener``): a demotion into a tier is a :class:`BlockStored` with that
    ``medium``; a drop from a tier (capacity LRU, corrupt file, failed write, clear,
    the pool computing the same block again) and a promotion out of the host tier are
    a :class:`BlockRemoved` with that ``medium`` (a disk promotion keeps the file, so
    it changes nothing). A device eviction that the tiers catch is therefore a
    ``BlockRemoved(medium="device")`` plus a ``BlockStored(medium="host")``.

    On a hybrid model (``manager.state``, a ``StatePool``) it also listens to the state
    pool (``StateListener``): a snapshot stored is a :class:`BlockStored` with medium
    ``"state"`` (a state slot), ``"state_host"`` (a host row) or ``"state_disk"`` (a
    disk tier file) and the hash of the block ending at its boundary, one that leaves
    that place (evicted, dropped, promoted out of a host row, reset) a
    :class:`BlockRemoved` with that medium (snapshot files of the disk tier are not KV
    disk blocks); the snapshot it serves carries ``state`` (``"hybrid"``, or
    ``"recurrent_only"`` without a KV pool), the held ``state_hashes`` (slots) and
    ``state_tier_hashes`` (host rows, disk files).

    Consecutive stores (or removals) of one medium are merged into one event; a clear
    of the pool (``reset_prefix_cache``, which clears the tiers too) drops the events
    still pending before it (they are overridden) and is sent as one
    :class:`AllBlocksCleared`, which clears every medium.

    Args:
        replica_id: the replica's id, copied into every batch and snapshot.
        clock: ``ts`` of a drained batch (default ``time.time``; a simulator passes its
            own clock).

    Attributes:
        replica_id: as given.
        epoch: a random 16-hex-digit id of this publisher instance.
        seq: the seq of the last drained batch (0 before the first).
    """

    def __init__(self, replica_id: str, *, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(replica_id, str) or not replica_id:
            raise SpecError(f"replica_id: expected a non-empty str, got {replica_id!r}")
        self.replica_id = replica_id
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self._clock = clock
        self._pending: list[tuple[str, str, list[bytes]]] = []
        self._pools: list[BlockPool | GroupPool] = []
        self._tiers: list[HostTier | DiskTier] = []
        self._per_pool: list[set[bytes]] = []
        self._held: set[bytes] = set()
        self._tier_held: dict[str, set[bytes]] = {}  # KV tiers, and "state"
        self._state_kind = "none"
        self._state_pool: StatePool | None = None

    # ---- wiring -------------------------------------------------------------------
    def attach(self, manager: KVCacheManager) -> None:
        """Listen to ``manager.prefix_pools``, ``manager.tiers`` when attached and
        ``manager.state`` on a hybrid model; hashes already held there are announced in
        the first batch (one :class:`BlockStored` per medium).

        Raises:
            SpecError: already attached.
        """
        if self._pools or self._state_pool is not None:
            raise SpecError(f"publisher {self.replica_id!r}: expected one attach, got a second")
        pools = manager.prefix_pools
        for i, pool in enumerate(pools):
            self._pools.append(pool)
            self._per_pool.append(set(pool.cached_hashes()))
            pool.listeners.append(_PoolTap(self, i))
        held = set.intersection(*self._per_pool) if self._per_pool else set()
        if held:
            self._held = held
            self._pending.append(("stored", "device", list(held)))
        tiers = getattr(manager, "tiers", None)
        for t in [] if tiers is None else tiers.tiers:
            self._tiers.append(t)
            hs = self._tier_held[t.name] = {h for h in t.hashes() if not is_state_key(h)}
            t.listeners.append(_TierTap(self))
            if hs:
                self._pending.append(("stored", t.name, list(hs)))
        state = getattr(manager, "state", None)
        if state is not None:
            self._state_pool = state
            self._state_kind = "hybrid" if pools else "recurrent_only"
            for m, got in zip(
                STATE_MEDIA,
                (
                    state.snapshot_hashes(),
                    state.host_snapshot_hashes(),
                    state.disk_snapshot_hashes(),
                ),  # fmt: skip
            ):
                hs = self._tier_held[m] = set(got)
                if hs:
                    self._pending.append(("stored", m, list(hs)))
            state.listeners.append(_StateTap(self))

    def detach(self) -> None:
        """Stop listening (the publisher keeps its state; a later attach is refused)."""
        for pool in self._pools:
            pool.listeners[:] = [
                x for x in pool.listeners if not (isinstance(x, _PoolTap) and x.pub is self)
            ]
        for t in self._tiers:
            t.listeners[:] = [
                x for x in t.listeners if not (isinstance(x, _TierTap) and x.pub is self)
            ]
        sp = self._state_pool
        if sp is not None:
            sp.listeners[:] = [
                x for x in sp.listeners if not (isinstance(x, _StateTap) and x.pub is self)
            ]

    # ---- listener callbacks -------------------------------------------------------
    # pending events are kept as (kind, medium, hashes) runs and turned into event
    # objects at drain time (appending to a run is O(1))
    def _push(self, kind: str, medium: str, h: bytes) -> None:
        p = self._pending
        if p and p[-1][0] == kind and p[-1][1] == medium:
            p[-1][2].append(h)
        else:
            p.append((kind, medium, [h]))

    def _stored(self, i: int, h: bytes) -> None:
        per = self._per_pool
        per[i].add(h)
        if h in self._held or (len(per) > 1 and not all(h in s for s in per)):
            return
        self._held.add(h)
        self._push("stored", "device", h)

    def _evicted(self, i: int, h: bytes) -> None:
        self._per_pool[i].discard(h)
        if h not in self._held:
            return
        self._held.discard(h)
        self._push("removed", "device", h)

    def _cleared(self, i: int) -> None:
        self._per_pool[i].clear()
        if self._held or any(self._tier_held.values()):
            self._held.clear()
            for hs in self._tier_held.values():
                hs.clear()
            self._pending = [("cleared", "device", [])]

    def _tier_stored(self, medium: str, h: bytes) -> None:
        hs = self._tier_held.setdefault(medium, set())
        if h not in hs:
            hs.add(h)
            self._push("stored", medium, h)

    def _tier_removed(self, medium: str, h: bytes) -> None:
        hs = self._tier_held.get(medium)
        if hs is not None and h in hs:
            hs.discard(h)
            self._push("removed", medium, h)

    # ---- output -------------------------------------------------------------------
    def held(self, medium: str = "device") -> frozenset[bytes]:
        """The hashes held now in ``medium`` (what a snapshot would carry; ``"state"``:
        the keys of the recurrent-state snapshots)."""
        if medium == "device":
            return frozenset(self._held)
        return frozenset(self._tier_held.get(medium, ()))

    def drain(self, *, heartbeat: bool = False) -> KVEventBatch | None:
        """All events since the last drain as one batch with the next seq.

        Args:
            heartbeat: when nothing is pending, still return a batch (with no events and
                the next seq) instead of None. A receiver can only see a lost batch as a
                gap before a *later* one, so a publisher that goes quiet sends heartbeats
                (the simulator every step, the Ray replica every few seconds) to bound
                how long a lost last batch stays unnoticed.

        Returns:
            The batch, or None (no seq used) when nothing is pending and not ``heartbeat``.
        """
        if not self._pending and not heartbeat:
            return None
        self.seq += 1
        evs = tuple(_event(kind, medium, hs) for kind, medium, hs in self._pending)
        self._pending = []
        return KVEventBatch(self.replica_id, self.seq, self._clock(), evs, self.epoch)

    def snapshot(self) -> KVSnapshot:
        """The current hash sets with the seq of the last drained batch (events still
        pending are already in the sets; replaying them later is harmless, see the
        :mod:`kvpage.routing.events` docstring)."""
        held = self._tier_held
        tiers = {m: frozenset(hs) for m, hs in held.items() if hs and m not in STATE_MEDIA}
        return KVSnapshot(
            self.replica_id,
            self.seq,
            frozenset(self._held),
            self.epoch,
            tiers,
            state=self._state_kind,
            state_hashes=frozenset(held.get(STATE_MEDIUM, ())),
            state_tier_hashes={m: frozenset(held[m]) for m in STATE_MEDIA[1:] if held.get(m)},
        )


__all__ = ["KVEventPublisher"]
