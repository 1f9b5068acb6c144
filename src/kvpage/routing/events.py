"""KV events: what a replica tells the router about the prefix-cache blocks it holds.

A replica's :class:`KVEventPublisher` listens to the block pool(s) its prefix lookup
uses (the :class:`kvpage.cache.PoolListener` seam) and turns every change of the pool's
hash map into one of three events:

* :class:`BlockStored`: blocks now hold these hashes (a prefix-cache hit candidate);
* :class:`BlockRemoved`: these hashes were evicted (their blocks were reused);
* :class:`AllBlocksCleared`: every hash was forgotten (``reset_prefix_cache``), in every
  medium.

Every stored/removed event names its *medium* (:data:`MEDIA`): ``"device"`` is the block
pool (the default, and the only medium of a replica without KV tiers), ``"host"`` and
``"disk"`` are the KV tiers below it (``kvpage.cache.tiered``). A replica's state is one
hash set per medium; a hash may be in several (the disk tier keeps its file after a
promotion), except that host and device are exclusive.

Hybrid models (recurrent state layers, ``kvpage.cache.state_pool``): a prefix hit needs
the KV blocks *and* a recurrent-state snapshot at the hit's end. Snapshots are keyed by
the hash of the block ending at their boundary, so they travel as stored/removed events
of the extra medium :data:`STATE_MEDIUM` (``"state"``): ``BlockStored(hashes,
medium="state")`` = snapshots of the state after these blocks were taken,
``BlockRemoved(..., medium="state")`` = they were evicted or dropped. Like KV blocks,
snapshots move down to host rows and disk files (``kvpage.cache.state_pool``): those
are the media ``"state_host"`` and ``"state_disk"`` (:data:`STATE_MEDIA`), so an
eviction the host rows catch is a ``BlockRemoved(medium="state")`` plus a
``BlockStored(medium="state_host")``, and a host hit the reverse; a disk hit keeps its
file (no event for the disk). A state hash is a marker on a boundary, not a block: it
is never a KV medium (:data:`MEDIA`) and the KV media's rules above do not apply to it.
:class:`KVSnapshot` carries the replica's ``state`` kind (``"none"``, ``"hybrid"``,
``"recurrent_only"``: :data:`STATE_KINDS`), its ``state_hashes`` (slots) and
``state_tier_hashes`` (host rows, disk files); the index cuts a stateful replica's
match at its deepest state hash in any state medium (``kvpage.routing.index``).

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

The publisher (``KVEventPublisher``, in :mod:`kvpage.routing.publisher`) turns pool and tier changes into these events.

Replaying events over a snapshot that already contains them is harmless: each event sets
or clears set members and the last operation on a hash wins, so a snapshot taken while
events were still pending (its ``seq`` is the last *drained* batch) followed by the next
batch gives the same set as the replica's pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpage.errors import KVPageError


class RoutingError(KVPageError, ValueError):
    """Bad routing input: a malformed event or snapshot, an unknown policy or replica."""


#: where a replica holds a block: the device pool, then the KV tiers top down (the order
#: a prefix lookup tries them in, ``kvpage.cache.tiered.TieredCache.promote_prefix``)
MEDIA = ("device", "host", "disk")
#: the media below the pool
TIER_MEDIA = MEDIA[1:]
#: the medium of recurrent-state snapshot events: snapshots in state slots (module
#: docstring)
STATE_MEDIUM = "state"
#: where a replica holds a snapshot: its state slots, host rows, disk tier files
STATE_MEDIA = (STATE_MEDIUM, "state_host", "state_disk")
#: the state media below the slots (keys of ``KVSnapshot.state_tier_hashes``)
STATE_TIER_MEDIA = STATE_MEDIA[1:]
#: every medium an event may name
EVENT_MEDIA = (*MEDIA, *STATE_MEDIA)
#: what a replica's model keeps beside KV: nothing, attention and recurrent layers, or
#: recurrent layers only (no KV block: a hit is the deepest snapshot along the prompt)
STATE_KINDS = ("none", "hybrid", "recurrent_only")


def check_medium(medium: object, what: str = "medium") -> str:
    """``medium`` if it is one of :data:`EVENT_MEDIA` (the KV and state media).

    Raises:
        RoutingError: anything else.
    """
    if medium not in EVENT_MEDIA:
        raise RoutingError(f"{what}: expected one of {list(EVENT_MEDIA)}, got {medium!r}")
    return str(medium)


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
        medium: where the blocks now are (:data:`MEDIA`; ``"host"``/``"disk"``: demoted
            into that KV tier), or a state medium (:data:`STATE_MEDIA`): recurrent-state
            snapshots at the end of these blocks were stored in state slots, host rows
            or disk files. Absent in the JSON form = ``"device"``.
    """

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None = None
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes left a medium: evicted from the pool (``"device"``), dropped by a
    tier or, for ``"host"``, promoted back into the pool (host and pool are exclusive;
    the disk tier keeps its file on a promotion).

    Attributes:
        block_hashes: the removed hashes.
        medium: the medium they left (:data:`MEDIA`, or a state medium: the snapshots
            keyed by these hashes left it; absent in the JSON form = ``"device"``).
    """

    block_hashes: tuple[bytes, ...]
    medium: str = "device"


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
        return {
            "type": "stored",
            "block_hashes": _hex(ev.block_hashes),
            "parent_hash": parent,
            "medium": ev.medium,
        }
    if isinstance(ev, BlockRemoved):
        return {"type": "removed", "block_hashes": _hex(ev.block_hashes), "medium": ev.medium}
    return {"type": "cleared"}


def event_from_dict(d: Mapping[str, Any]) -> KVEvent:
    """Inverse of :func:`event_to_dict`.

    A missing ``medium`` reads as ``"device"`` (the form before KV tiers).

    Raises:
        RoutingError: not a mapping, an unknown ``type`` or ``medium``, or bad hashes.
    """
    if not isinstance(d, Mapping):
        raise RoutingError(f"event: expected an object, got {type(d).__name__}")
    kind = d.get("type")
    if kind in ("stored", "removed"):
        medium = check_medium(d.get("medium", "device"), "event.medium")
        hashes = _unhex(d.get("block_hashes"), "block_hashes")
        if kind == "removed":
            return BlockRemoved(hashes, medium)
        parent = d.get("parent_hash")
        ph = None if parent is None else _unhex([parent], "parent_hash")[0]
        return BlockStored(hashes, ph, medium)
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
        block_hashes: every hash the replica holds in its pool (medium ``"device"``).
        epoch: the publisher instance's random id.
        tier_hashes: per KV tier medium (``"host"``, ``"disk"``), the hashes it holds;
            empty without tiers (absent in the JSON form = empty).
        state: the replica's kind of recurrent state (:data:`STATE_KINDS`; absent in
            the JSON form = ``"none"``).
        state_hashes: the keys of its recurrent-state snapshots in state slots (medium
            ``"state"``; absent in the JSON form = empty).
        state_tier_hashes: per state medium below the slots (``"state_host"``,
            ``"state_disk"``), the keys of the snapshots it holds there (absent in the
            JSON form = empty).

    Raises:
        RoutingError: ``state`` not one of :data:`STATE_KINDS`, state hashes with
            ``state="none"``, or a ``state_tier_hashes`` key outside
            :data:`STATE_TIER_MEDIA`.
    """

    replica_id: str
    seq: int
    block_hashes: frozenset[bytes]
    epoch: str = ""
    tier_hashes: Mapping[str, frozenset[bytes]] = field(default_factory=dict)
    state: str = "none"
    state_hashes: frozenset[bytes] = frozenset()
    state_tier_hashes: Mapping[str, frozenset[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in STATE_KINDS:
            raise RoutingError(
                f"snapshot.state: expected one of {list(STATE_KINDS)}, got {self.state!r}"
            )
        n_tier = sum(len(hs) for hs in self.state_tier_hashes.values())
        if self.state == "none" and (self.state_hashes or n_tier):
            raise RoutingError(
                f"snapshot.state_hashes: expected none for state='none', got "
                f"{len(self.state_hashes) + n_tier}"
            )
        for m in self.state_tier_hashes:
            if m not in STATE_TIER_MEDIA:
                raise RoutingError(
                    f"snapshot.state_tier_hashes: expected keys in {list(STATE_TIER_MEDIA)}, "
                    f"got {m!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (hashes as hex, sorted; ``state_tier_hashes`` only when some
        snapshot is below the slots)."""
        d: dict[str, Any] = {
            "replica_id": self.replica_id,
            "seq": self.seq,
            "epoch": self.epoch,
            "block_hashes": sorted(_hex(self.block_hashes)),
            "tier_hashes": {m: sorted(_hex(hs)) for m, hs in self.tier_hashes.items()},
            "state": self.state,
            "state_hashes": sorted(_hex(self.state_hashes)),
        }
        if self.state_tier_hashes:
            d["state_tier_hashes"] = {
                m: sorted(_hex(hs)) for m, hs in self.state_tier_hashes.items()
            }
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVSnapshot:
        """Inverse of :meth:`to_dict`.

        Raises:
            RoutingError: a missing or mistyped field, or bad hashes.
        """
        if not isinstance(d, Mapping):
            raise RoutingError(f"snapshot: expected an object, got {type(d).__name__}")
        tiers = d.get("tier_hashes", {})
        if not isinstance(tiers, Mapping):
            raise RoutingError(f"snapshot.tier_hashes: expected an object, got {tiers!r}")
        th = {}
        for m, hs in tiers.items():
            if m not in TIER_MEDIA:
                raise RoutingError(
                    f"snapshot.tier_hashes: expected keys in {list(TIER_MEDIA)}, got {m!r}"
                )
            th[m] = frozenset(_unhex(hs, f"snapshot.tier_hashes.{m}"))
        stiers = d.get("state_tier_hashes", {})
        if not isinstance(stiers, Mapping):
            raise RoutingError(f"snapshot.state_tier_hashes: expected an object, got {stiers!r}")
        sth = {
            str(m): frozenset(_unhex(hs, f"snapshot.state_tier_hashes.{m}"))
            for m, hs in stiers.items()
        }
        return cls(
            replica_id=_field(d, "replica_id", str, "snapshot"),
            seq=_field(d, "seq", int, "snapshot"),
            block_hashes=frozenset(_unhex(d.get("block_hashes"), "snapshot.block_hashes")),
            epoch=str(d.get("epoch", "")),
            tier_hashes=th,
            state=str(d.get("state", "none")),
            state_hashes=frozenset(_unhex(d.get("state_hashes", []), "snapshot.state_hashes")),
            state_tier_hashes=sth,
        )


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVSnapshot",
    "MEDIA",
    "EVENT_MEDIA",
    "RoutingError",
    "STATE_KINDS",
    "STATE_MEDIA",
    "STATE_MEDIUM",
    "STATE_TIER_MEDIA",
    "TIER_MEDIA",
    "check_medium",
    "event_from_dict",
    "event_to_dict",
]
