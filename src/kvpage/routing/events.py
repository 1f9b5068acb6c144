"""KV events: what a replica tells the router about the prefix-cache blocks it holds.

A replica's :class:`KVEventPublisher` listens to the block pool(s) its prefix lookup
uses (the :class:`kvpage.cache.PoolListener` seam) and turns every change of the pool's
hash map into one of three events:

* :class:`BlockStored`: blocks now hold these hashes (a prefix-cache hit candidate);
* :class:`BlockRemoved`: these hashes were evicted (their blocks were reused);
* :class:`AllBlocksCleared`: every hash was forgotten (``reset_prefix_cache``).

Events are *set operations* on the replica's hash set, grouped into numbered
:class:`KVEventBatch` objects: ``seq`` starts at 1 and grows by exactly 1 per batch, so
a receiver detects a lost batch as a gap. ``epoch`` is a random id drawn when the
publisher is created, so a restarted replica (seq back at 1) is told apart from a
late batch of the old one. On a gap or a new epoch the receiver asks for a
:class:`KVSnapshot` (the whole hash set) and starts again from its ``seq``.

The event names follow vLLM's KV-events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, batched with a sequence number) that Dynamo and llm-d consume; the
fields and the JSON form here are kvpage's own. ``to_dict``/``from_dict`` give a JSON-able
form (hashes as hex strings) for any transport (a Ray actor call, HTTP, a queue).

Replaying events over a snapshot that already contains them is harmless: each event sets
or clears set members and the last operation on a hash wins, so a snapshot taken while
events were still pending (its ``seq`` is the last *drained* batch) followed by the next
batch gives the same set as the replica's pool.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpage.errors import KVPageError, SpecError

if TYPE_CHECKING:
    from kvpage.cache import BlockPool, KVCacheManager


class RoutingError(KVPageError, ValueError):
    """Bad routing input: a malformed event or snapshot, an unknown policy or replica."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks holding these hashes were added to the replica's prefix cache.

    Attributes:
        block_hashes: 32-byte chained block hashes (``kvpage.cache.hash_request_blocks``),
            in the order the pool registered them.
        parent_hash: the hash of the block before the first one when known, else None.
            The pool seam reports blocks one at a time without their parent, so the
            publisher sends None; the index does not need it because a chained hash
            already fixes the whole prefix.
    """

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks holding these hashes were evicted (reused for other content).

    Attributes:
        block_hashes: the evicted hashes.
    """

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every hash of the replica was forgotten (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _hex(hashes: Iterable[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def _unhex(items: object, what: str) -> tuple[bytes, ...]:
    if not isinstance(items, (list, tuple)):
        raise RoutingError(f"{what}: expected a list of hex strings, got {type(items).__name__}")
    try:
        return tuple(bytes.fromhex(x) for x in items)
    except (TypeError, ValueError):
        raise RoutingError(f"{what}: expected hex strings, got {list(items)[:2]!r}...") from None


def event_to_dict(ev: KVEvent) -> dict[str, Any]:
    """One event as a JSON-able dict with a ``type`` key (``stored``/``removed``/``cleared``)."""
    if isinstance(ev, BlockStored):
        parent = None if ev.parent_hash is None else ev.parent_hash.hex()
        return {"type": "stored", "block_hashes": _hex(ev.block_hashes), "parent_hash": parent}
    if isinstance(ev, BlockRemoved):
        return {"type": "removed", "block_hashes": _hex(ev.block_hashes)}
    return {"type": "cleared"}


def event_from_dict(d: Mapping[str, Any]) -> KVEvent:
    """Inverse of :func:`event_to_dict`.

    Raises:
        RoutingError: not a mapping, an unknown ``type``, or bad hashes.
    """
    if not isinstance(d, Mapping):
        raise RoutingError(f"event: expected an object, got {type(d).__name__}")
    kind = d.get("type")
    if kind == "stored":
        parent = d.get("parent_hash")
        ph = None if parent is None else _unhex([parent], "parent_hash")[0]
        return BlockStored(_unhex(d.get("block_hashes"), "block_hashes"), ph)
    if kind == "removed":
        return BlockRemoved(_unhex(d.get("block_hashes"), "block_hashes"))
    if kind == "cleared":
        return AllBlocksCleared()
    raise RoutingError(f"event.type: expected 'stored', 'removed' or 'cleared', got {kind!r}")


def _field(d: Mapping[str, Any], key: str, typ: type | tuple[type, ...], what: str) -> Any:
    v = d.get(key)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise RoutingError(f"{what}.{key}: expected {typ}, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one replica since its previous batch, in pool order.

    Attributes:
        replica_id: the publishing replica.
        seq: 1 for the publisher's first batch, +1 for each later one.
        ts: when the batch was drained, in seconds (``time.time()`` or a simulated clock).
        events: the events, applied in order.
        epoch: the publisher instance's random id (a restarted replica has a new one).
    """

    replica_id: str
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    epoch: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (hashes as hex)."""
        return {
            "replica_id": self.replica_id,
            "seq": self.seq,
            "ts": self.ts,
            "epoch": self.epoch,
            "events": [event_to_dict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVEventBatch:
        """Inverse of :meth:`to_dict`.

        Raises:
            RoutingError: a missing or mistyped field, or a bad event.
        """
        if not isinstance(d, Mapping):
            raise RoutingError(f"batch: expected an object, got {type(d).__name__}")
        evs = d.get("events")
        if not isinstance(evs, list):
            raise RoutingError(f"batch.events: expected a list, got {type(evs).__name__}")
        return cls(
            replica_id=_field(d, "replica_id", str, "batch"),
            seq=_field(d, "seq", int, "batch"),
            ts=float(_field(d, "ts", (int, float), "batch")),
            events=tuple(event_from_dict(e) for e in evs),
            epoch=str(d.get("epoch", "")),
        )


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """A replica's whole prefix-cache hash set.

    Attributes:
        replica_id: the replica.
        seq: the seq of the last batch drained before the snapshot (0 = none yet); the
            next batch to apply after it is ``seq + 1``.
        block_hashes: every hash the replica holds.
        epoch: the publisher instance's random id.
    """

    replica_id: str
    seq: int
    block_hashes: frozenset[bytes]
    epoch: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (hashes as hex, sorted)."""
        return {
            "replica_id": self.replica_id,
            "seq": self.seq,
            "epoch": self.epoch,
            "block_hashes": sorted(_hex(self.block_hashes)),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVSnapshot:
        """Inverse of :meth:`to_dict`.

        Raises:
            RoutingError: a missing or mistyped field, or bad hashes.
        """
        if not isinstance(d, Mapping):
            raise RoutingError(f"snapshot: expected an object, got {type(d).__name__}")
        return cls(
            replica_id=_field(d, "replica_id", str, "snapshot"),
            seq=_field(d, "seq", int, "snapshot"),
            block_hashes=frozenset(_unhex(d.get("block_hashes"), "snapshot.block_hashes")),
            epoch=str(d.get("epoch", "")),
        )


def _event(kind: str, hashes: list[bytes]) -> KVEvent:
    if kind == "stored":
        return BlockStored(tuple(hashes))
    if kind == "removed":
        return BlockRemoved(tuple(hashes))
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


class KVEventPublisher:
    """Turns a replica's pool changes into numbered :class:`KVEventBatch` objects.

    Attach it to a :class:`~kvpage.cache.KVCacheManager` with :meth:`attach`; it then
    listens to the pools of the manager's full-attention KV groups
    (``KVCacheManager.prefix_pools``), the ones whose hash maps decide a prefix hit.
    With several such pools a hash counts as held while *every* one of them holds it
    (a hit needs all full-attention groups). Sliding-window groups are not tracked:
    for a hybrid model the router's view is the full-attention part.

    Consecutive stores (or removals) are merged into one event; a clear drops the events
    still pending before it (they are overridden) and is sent as one
    :class:`AllBlocksCleared`.

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
        self._pending: list[tuple[str, list[bytes]]] = []
        self._pools: list[BlockPool] = []
        self._per_pool: list[set[bytes]] = []
        self._held: set[bytes] = set()

    # ---- wiring -------------------------------------------------------------------
    def attach(self, manager: KVCacheManager) -> None:
        """Listen to ``manager.prefix_pools``; hashes already cached there are announced
        in the first batch (as one :class:`BlockStored`).

        Raises:
            SpecError: already attached.
        """
        if self._pools:
            raise SpecError(f"publisher {self.replica_id!r}: expected one attach, got a second")
        pools = manager.prefix_pools
        for i, pool in enumerate(pools):
            self._pools.append(pool)
            self._per_pool.append(set(pool.cached_hashes()))
            pool.listeners.append(_PoolTap(self, i))
        held = set.intersection(*self._per_pool) if self._per_pool else set()
        if held:
            self._held = held
            self._pending.append(("stored", list(held)))

    def detach(self) -> None:
        """Stop listening (the publisher keeps its state; a later attach is refused)."""
        for pool in self._pools:
            pool.listeners[:] = [
                x for x in pool.listeners if not (isinstance(x, _PoolTap) and x.pub is self)
            ]

    # ---- listener callbacks -------------------------------------------------------
    # pending events are kept as ("stored" | "removed" | "cleared", hashes) runs and
    # turned into event objects at drain time (appending to a run is O(1))
    def _push(self, kind: str, h: bytes) -> None:
        p = self._pending
        if p and p[-1][0] == kind:
            p[-1][1].append(h)
        else:
            p.append((kind, [h]))

    def _stored(self, i: int, h: bytes) -> None:
        per = self._per_pool
        per[i].add(h)
        if h in self._held or (len(per) > 1 and not all(h in s for s in per)):
            return
        self._held.add(h)
        self._push("stored", h)

    def _evicted(self, i: int, h: bytes) -> None:
        self._per_pool[i].discard(h)
        if h not in self._held:
            return
        self._held.discard(h)
        self._push("removed", h)

    def _cleared(self, i: int) -> None:
        self._per_pool[i].clear()
        if self._held:
            self._held.clear()
            self._pending = [("cleared", [])]

    # ---- output -------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        """Events waiting for the next :meth:`drain`."""
        return len(self._pending)

    def held(self) -> frozenset[bytes]:
        """The hashes held now (what a snapshot would carry)."""
        return frozenset(self._held)

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
        evs = tuple(_event(kind, hs) for kind, hs in self._pending)
        self._pending = []
        return KVEventBatch(self.replica_id, self.seq, self._clock(), evs, self.epoch)

    def snapshot(self) -> KVSnapshot:
        """The current hash set with the seq of the last drained batch (events still
        pending are already in the set; replaying them later is harmless, see the
        module docstring)."""
        return KVSnapshot(self.replica_id, self.seq, frozenset(self._held), self.epoch)


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVSnapshot",
    "RoutingError",
    "event_from_dict",
    "event_to_dict",
]
