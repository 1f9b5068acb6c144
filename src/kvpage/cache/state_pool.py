"""The state slots of a hybrid model's recurrent layers (:class:`StatePool`).

A recurrent layer (Mamba-2, Gated DeltaNet; ``kvpage.specs.state``) keeps one
fixed-size state per sequence instead of KV blocks. The storage is one
``kvpage.attention.state.StateCache`` per recurrent layer with ``num_slots`` rows; this
pool decides, host side and torch-free, what each row (*slot*) holds:

* **live slots** ``0 .. num_live_slots - 1``: the state of one running sequence each,
  allocated with its first allocation and freed on finish, abort and preemption by
  recompute (the state is then recomputed, or restored from a snapshot);
* **snapshot slots** ``num_live_slots .. num_slots - 1``: prefix-cache entries, the
  state after the first ``b`` tokens of some sequence, ``b`` a block boundary, keyed by
  the hash of the block ending at ``b`` (``kvpage.cache.hashing``: the same chain,
  salts, adapters and tenant scope as the KV blocks). Which boundaries are taken is the
  :class:`~kvpage.cache.snapshot_policy.SnapshotPolicy`'s decision; a snapshot is
  evicted by retention priority, then least recently used (the free-queue order of the
  KV blocks, ``kvpage.cache.free_queue``), and predicted snapshots hold at most
  ``policy.predicted_cap(num_snapshot_slots)`` slots (their own least recently used
  goes first).

Data moves only as row copies ``(src, dst)`` that the pool queues in order (a snapshot
taken after a step: live -> snapshot; a prefix hit: snapshot -> live; a fork: live ->
live) and the engine runs, all of them and in queue order, before the next forward
(:meth:`take_copies`). Because every queued copy runs before any forward writes a slot,
a slot may be reused (evicted, freed) while a copy from it is queued: the copy still
reads the content it was queued for.

**Host snapshots** (``num_host_snapshots > 0``, the host KV tier's companion): a
snapshot evicted for room is not lost but moved to one of ``num_host_snapshots`` host
rows, addressed in the copy queue as slot ``num_slots + row`` (the copy device -> host
is queued at eviction time, so it reads the slot's content before any later queued copy
overwrites it); host rows are evicted least recently used. A lookup counts a host
snapshot like a device one (:meth:`deepest`); :meth:`restore` of a host entry first
promotes it: takes a snapshot slot (evicting, possibly to the host), queues host ->
slot, frees the host row, then the normal slot -> live copy.

**Disk snapshots** (:meth:`StatePool.attach_disk`, the disk KV tier's companion): a
snapshot evicted from the host rows (or, with no host rows, from its slot) is written
as an entry of the disk KV tier (``kvpage.cache.tier_store.DiskTier``) keyed by
``tier_store.state_key(block hash)``: a file beside the KV block files, verified on
read, counted in the tier's byte budget (``state_capacity_bytes``), indexed again by a
new tier over the same directory, so the snapshots survive an engine restart. The disk
tier is inclusive: a disk hit keeps its file. Disk I/O needs the rows' current content,
so before reading or writing a row for the disk the pool runs its queued copies through
its :class:`SnapshotMover` (in queue order: the same result as running them later, since
nothing else writes a slot before the next forward). :meth:`lookup` (the manager's
prefix lookup) promotes a disk-only snapshot at the deepest boundary into a snapshot
slot (file read and verified first); a refused file (checksum, length, size) is a miss
there, recorded with its reason (:meth:`refusal`), and the lookup tries the next
boundary down. A promoted disk snapshot is of kind ``"prompt"`` (the kind is not
stored).

Listeners (:class:`StateListener`, :attr:`StatePool.listeners`) hear every snapshot
entry stored and removed (evicted, a rolling one replaced, ``reset``) by its key, the
block hash of its boundary, and where: ``"device"`` (a snapshot slot), ``"host"`` (a
host row) or ``"disk"`` (a disk tier file, heard from the disk tier's listeners, so a
file the tier drops for a KV block is heard too): the KV-event publisher
(``kvpage.routing``) turns them into events of media ``"state"``, ``"state_host"``,
``"state_disk"`` so a router's prefix index can cut a hybrid replica's KV match at its
deepest snapshot wherever it lives.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpage.cache.free_queue import NUM_PRIORITY_LEVELS, PRIORITY_DEFAULT
from kvpage.cache.hashing import BlockHash
from kvpage.cache.snapshot_policy import SnapshotKind, SnapshotPolicy
from kvpage.cache.tier_store import (
    DiskTier,
    Payload,
    is_state_key,
    payload_nbytes,
    state_key,
    state_key_hash,
)
from kvpage.errors import AllocationError, IntegrityError, SpecError


@dataclass
class Snapshot:
    """One snapshot slot's entry.

    Attributes:
        slot: its row in every ``StateCache``.
        block_hash: the hash of the block ending at its boundary (its key).
        kind: why it was taken (``kvpage.cache.snapshot_policy.SNAPSHOT_KINDS``).
        priority: retention level (``kvpage.cache.free_queue``); evicted lowest first.
        deadline: clock reading after which a raised ``priority`` counts as default
            (None = never).
        owner: the request whose rolling decode snapshot it is (None = none).
    """

    slot: int
    block_hash: BlockHash
    kind: SnapshotKind
    priority: int = PRIORITY_DEFAULT
    deadline: float | None = None
    owner: str | None = None


#: where a snapshot lives: a snapshot slot, a host row, a disk tier file
SNAPSHOT_PLACES = ("device", "host", "disk")
#: most disk refusals remembered for miss explanations (:meth:`StatePool.refusal`)
_REFUSED_CAP = 1024


class StateListener(Protocol):
    """Hears a :class:`StatePool`'s snapshot entries come and go (module docstring).
    Called synchronously inside the pool's operation; must not call back into it.
    ``where`` is one of :data:`SNAPSHOT_PLACES`."""

    def on_snapshot_stored(self, block_hash: BlockHash, where: str) -> None:
        """A snapshot keyed ``block_hash`` was stored in ``where`` (its copy is queued,
        or its file written)."""
        ...

    def on_snapshot_removed(self, block_hash: BlockHash, where: str) -> None:
        """The snapshot keyed ``block_hash`` left ``where`` (evicted, dropped, promoted
        out of a host row, reset)."""
        ...


class SnapshotMover(Protocol):
    """Runs the pool's slot copies and reads/writes one row for the disk tier (the
    engine's ``kvpage.engine.kv_transfer.TorchStateMover``). A slot ``>= num_slots``
    is host row ``slot - num_slots``.

    Attributes:
        slot_nbytes: bytes of one row's payload (every state layer's conv and SSM state).
    """

    slot_nbytes: int

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Run the copies ``(src, dst)`` in order (finished on return)."""
        ...

    def read_slot(self, slot: int) -> Payload:
        """A copy of row ``slot``'s content (``slot_nbytes`` bytes)."""
        ...

    def write_slot(self, slot: int, payload: Payload) -> None:
        """Overwrite row ``slot`` with ``payload`` (finished on return)."""
        ...


@dataclass
class StatePoolStats:
    """Counters of a :class:`StatePool`.

    Attributes:
        snapshots_taken: snapshots stored (copies live -> snapshot queued).
        snapshots_taken_by_kind: the same by kind.
        snapshot_hits: prefix hits served from a snapshot (copies snapshot -> live).
        snapshot_evictions: snapshots dropped to make room (LRU / retention / cap).
        snapshots_dropped: rolling decode snapshots replaced by their owner's newer one.
        snapshots_skipped: wanted snapshots not taken (no snapshot slots, or a zero
            predicted cap).
        host_snapshots_stored: evicted snapshots moved to a host row.
        host_snapshot_hits: restores served by promoting a host snapshot.
        host_snapshot_evictions: host rows dropped for room (least recently used).
        disk_snapshots_stored: snapshots written to the disk tier.
        disk_snapshot_hits: lookups served by promoting a disk snapshot.
        disk_snapshot_refusals: disk snapshots refused on read (corrupt, truncated,
            another size) or removed by the tier at start: a miss there
            (:meth:`StatePool.refusal`).
    """

    snapshots_taken: int = 0
    snapshots_taken_by_kind: dict[str, int] = field(default_factory=dict)
    snapshot_hits: int = 0
    snapshot_evictions: int = 0
    snapshots_dropped: int = 0
    snapshots_skipped: int = 0
    host_snapshots_stored: int = 0
    host_snapshot_hits: int = 0
    host_snapshot_evictions: int = 0
    disk_snapshots_stored: int = 0
    disk_snapshot_hits: int = 0
    disk_snapshot_refusals: int = 0


class StatePool:
    """Owner of the recurrent state slots (module docstring).

    Args:
        num_live_slots: slots for running sequences (>= 1; the engine gives
            ``max_num_seqs``, so a running sequence always has one).
        num_snapshot_slots: slots for prefix-cache snapshots (>= 0).
        policy: the snapshot policy (its ``predicted_cap`` bounds predicted snapshots).
        clock: seconds, for retention deadlines (``time.monotonic``).
        num_host_snapshots: host rows for evicted snapshots (>= 0; module docstring),
            addressed in copies as ``num_slots + row``.

    Attributes:
        num_slots: rows every ``StateCache`` needs: live + snapshot slots.
        stats: the counters (:class:`StatePoolStats`).
        listeners: :class:`StateListener` objects told of every snapshot stored and
            removed (append to attach).

    Raises:
        SpecError: a count out of range.
    """

    def __init__(
        self,
        num_live_slots: int,
        num_snapshot_slots: int,
        policy: SnapshotPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        num_host_snapshots: int = 0,
    ) -> None:
        if isinstance(num_live_slots, bool) or not isinstance(num_live_slots, int) or num_live_slots < 1:  # fmt: skip
            raise SpecError(f"num_live_slots: expected an int >= 1, got {num_live_slots!r}")
        if isinstance(num_snapshot_slots, bool) or not isinstance(num_snapshot_slots, int) or num_snapshot_slots < 0:  # fmt: skip
            raise SpecError(f"num_snapshot_slots: expected an int >= 0, got {num_snapshot_slots!r}")
        if isinstance(num_host_snapshots, bool) or not isinstance(num_host_snapshots, int) or num_host_snapshots < 0:  # fmt: skip
            raise SpecError(f"num_host_snapshots: expected an int >= 0, got {num_host_snapshots!r}")
        self.num_host_snapshots = num_host_snapshots
        #: host snapshots: hash -> (host row, kind), least recently used first
        self._host: OrderedDict[BlockHash, tuple[int, SnapshotKind]] = OrderedDict()
        self._free_host: list[int] = list(range(num_host_snapshots - 1, -1, -1))
        self.num_live_slots = num_live_slots
        self.num_snapshot_slots = num_snapshot_slots
        self.num_slots = num_live_slots + num_snapshot_slots
        self.policy = policy
        self.predicted_cap = policy.predicted_cap(num_snapshot_slots)
        self.clock = clock
        self.stats = StatePoolStats()
        self._free_live: list[int] = list(range(num_live_slots - 1, -1, -1))
        self._live: dict[str, int] = {}
        self._free_snap: list[int] = list(range(self.num_slots - 1, num_live_slots - 1, -1))
        #: hash -> entry, least recently used first
        self._snaps: OrderedDict[BlockHash, Snapshot] = OrderedDict()
        self._num_predicted = 0
        #: request -> hash of its rolling decode snapshot
        self._rolling: dict[str, BlockHash] = {}
        self._copies: list[tuple[int, int]] = []
        self.listeners: list[StateListener] = []
        self._disk: DiskTier | None = None
        self._mover: SnapshotMover | None = None
        #: block hash -> why its disk snapshot was refused (bounded, oldest first)
        self._refused: OrderedDict[BlockHash, str] = OrderedDict()

    # ---- disk -----------------------------------------------------------------------
    def attach_disk(self, disk: DiskTier, mover: SnapshotMover) -> None:
        """Keep evicted snapshots in ``disk`` (module docstring) and hear its snapshot
        files come and go (a listener on ``disk.listeners``). ``mover`` runs the queued
        copies and reads/writes rows for the disk (it must cover every slot and host
        row of this pool). Snapshot files already in ``disk`` (an earlier run on the
        same directory) are found by lookups at once.

        Raises:
            SpecError: already attached, or no snapshot slots (a disk snapshot is
                restored through one).
        """
        if self._disk is not None:
            raise SpecError("attach_disk: expected one disk tier, got a second")
        if self.num_snapshot_slots == 0:
            raise SpecError(
                "attach_disk: expected state snapshot slots (a disk snapshot is restored "
                "through one), got num_snapshot_slots=0"
            )
        self._disk = disk
        self._mover = mover
        disk.listeners.append(_DiskTap(self))
        for k in disk.removed_at_start:  # files the tier refused at start: explained too
            if is_state_key(k):
                self._refuse(state_key_hash(k), "corrupt")

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier holding evicted snapshots (None = none)."""
        return self._disk

    def has_disk_snapshot(self, block_hash: BlockHash) -> bool:
        """Whether the disk tier holds a snapshot file keyed ``block_hash``."""
        d = self._disk
        return d is not None and len(block_hash) == 32 and state_key(block_hash) in d

    def disk_snapshot_hashes(self) -> list[BlockHash]:
        """The block hashes of the disk tier's snapshot files, least recently used first."""
        d = self._disk
        return [] if d is None else [state_key_hash(k) for k in d.state_keys()]

    @property
    def num_disk_used(self) -> int:
        """Snapshot files in the disk tier."""
        d = self._disk
        return 0 if d is None else d.num_state_entries

    def refusal(self, block_hash: BlockHash) -> str | None:
        """Why the disk snapshot keyed ``block_hash`` was refused (``"corrupt"``: on
        read, checksum, header or length, or removed by the tier at start as not a
        valid file; ``"size"``: another payload size), None if it was not (remembered
        for the last 1024 refusals)."""
        return self._refused.get(block_hash)

    def _refuse(self, block_hash: BlockHash, reason: str) -> None:
        """Record a refused disk snapshot (bounded; :meth:`refusal`)."""
        self._refused[block_hash] = reason
        self._refused.move_to_end(block_hash)
        if len(self._refused) > _REFUSED_CAP:
            self._refused.popitem(last=False)
        self.stats.disk_snapshot_refusals += 1

    def _run_copies(self) -> None:
        """Run the queued copies now, in order (before a row is read or written for the
        disk; module docstring)."""
        if self._copies:
            assert self._mover is not None
            self._mover.copy_slots(self._copies)
            self._copies = []

    def _to_disk(self, addr: int, block_hash: BlockHash) -> None:
        """Write row ``addr`` (a slot, or ``num_slots + host row``), the snapshot keyed
        ``block_hash``, to the disk tier; nothing without one (or once it stopped after
        a write error: ``DiskTier.writable``)."""
        disk, mover = self._disk, self._mover
        if disk is None or mover is None:
            return
        key = state_key(block_hash)
        if disk.touch(key) or not disk.writable:
            return  # same tokens, same state: the file is already there
        self._run_copies()
        if disk.put(key, mover.read_slot(addr)):
            self.stats.disk_snapshots_stored += 1

    def _promote_disk(self, block_hash: BlockHash) -> bool:
        """Read and verify the disk snapshot ``block_hash`` into a snapshot slot (the
        file stays); False (a recorded refusal) when the tier refuses the file or its
        payload has another size."""
        disk, mover = self._disk, self._mover
        assert disk is not None and mover is not None
        key = state_key(block_hash)
        payload = disk.get(key)  # verified; a refused file is removed and counted there
        reason = None
        if payload is None:
            reason = "corrupt"
        elif payload_nbytes(payload) != mover.slot_nbytes:
            reason = "size"
            disk.stats.corrupt += 1
            disk.discard(key, "corrupt")
        if reason is not None:
            self._refuse(block_hash, reason)
            return False
        self._refused.pop(block_hash, None)
        if not self._free_snap:
            self._evict(predicted_only=False)
        slot = self._free_snap.pop()
        self._run_copies()  # a queued copy out of this slot (its eviction) reads it first
        mover.write_slot(slot, payload)
        self._snaps[block_hash] = Snapshot(slot, block_hash, "prompt")
        self.stats.disk_snapshot_hits += 1
        self._emit_stored(block_hash, "device")
        return True

    def lookup(self, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        """:meth:`deepest`, made servable: when the deepest snapshot is only on disk it
        is promoted into a snapshot slot (read, verified); a refused file is a miss
        there and the search goes on below it. Returns the boundary in blocks (0 =
        none); :meth:`restore` of ``hashes[k - 1]`` then succeeds. Changes the pool only
        by that promotion (and the eviction it causes)."""
        while True:
            k = self.deepest(hashes, max_blocks)
            if k == 0:
                return 0
            h = hashes[k - 1]
            if h in self._snaps or h in self._host:
                return k
            if self.num_snapshot_slots and self._promote_disk(h):
                return k
            max_blocks = k - 1

    def _emit_stored(self, block_hash: BlockHash, where: str) -> None:
        if self._refused:
            self._refused.pop(block_hash, None)  # stored again: an old refusal is moot
        for lis in self.listeners:
            lis.on_snapshot_stored(block_hash, where)

    def _emit_removed(self, block_hash: BlockHash, where: str) -> None:
        for lis in self.listeners:
            lis.on_snapshot_removed(block_hash, where)

    # ---- live slots -----------------------------------------------------------------
    def allocate_live(self, request_id: str) -> int | None:
        """A live slot for ``request_id`` (its state starts as "none": the first step's
        ``has_initial_state`` is False unless a restore is queued), or None when every
        live slot is taken (nothing changed).

        Raises:
            AllocationError: ``request_id`` already holds one.
        """
        if request_id in self._live:
            raise AllocationError(f"request_id: expected no live state slot, got {request_id!r}")
        if not self._free_live:
            return None
        slot = self._free_live.pop()
        self._live[request_id] = slot
        return slot

    def free_live(self, request_id: str) -> None:
        """Return ``request_id``'s live slot (finish, abort, preemption). Its rolling
        decode snapshot stays a normal cache entry.

        Raises:
            AllocationError: it holds none.
        """
        slot = self._live.pop(request_id, None)
        if slot is None:
            raise AllocationError(f"request_id: expected a live state slot, got {request_id!r}")
        self._free_live.append(slot)
        h = self._rolling.pop(request_id, None)
        if h is not None:
            e = self._snaps.get(h)
            if e is not None and e.owner == request_id:
                e.owner = None

    def live_slot(self, request_id: str) -> int:
        """The live slot of ``request_id``. Raises AllocationError if it holds none."""
        slot = self._live.get(request_id)
        if slot is None:
            raise AllocationError(f"request_id: expected a live state slot, got {request_id!r}")
        return slot

    def has_live(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a live slot."""
        return request_id in self._live

    def fork_live(self, parent_id: str, child_id: str) -> int:
        """A live slot for ``child_id`` holding a copy of the parent's state (copy
        queued). Returns the child's slot.

        Raises:
            AllocationError: unknown parent, child already holding one, or no live slot
                free (nothing changed).
        """
        src = self.live_slot(parent_id)
        if child_id in self._live:
            raise AllocationError(f"child_id: expected no live state slot, got {child_id!r}")
        if not self._free_live:
            raise AllocationError(
                f"fork: expected a free live state slot for {child_id!r}, got none "
                f"(num_live_slots={self.num_live_slots})"
            )
        dst = self.allocate_live(child_id)
        assert dst is not None
        self._copies.append((src, dst))
        return dst

    @property
    def num_live_used(self) -> int:
        """Live slots held by running sequences."""
        return len(self._live)

    # ---- snapshots ------------------------------------------------------------------
    def has_snapshot(self, block_hash: BlockHash) -> bool:
        """Whether a snapshot keyed ``block_hash`` exists."""
        return block_hash in self._snaps

    def snapshot_slot(self, block_hash: BlockHash) -> int | None:
        """The slot of the snapshot keyed ``block_hash`` (None = none)."""
        e = self._snaps.get(block_hash)
        return None if e is None else e.slot

    def deepest(self, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        """The largest ``k <= min(max_blocks, len(hashes))`` with a snapshot keyed
        ``hashes[k - 1]`` in a slot, a host row or the disk tier, searching right to left
        (0 = none). Changes nothing (a disk file is not read: :meth:`lookup` is)."""
        snaps, host = self._snaps, self._host
        for k in range(min(max_blocks, len(hashes)), 0, -1):
            h = hashes[k - 1]
            if h in snaps or h in host or self.has_disk_snapshot(h):
                return k
        return 0

    def nearest(self, hashes: Sequence[BlockHash], position_blocks: int) -> int | None:
        """The boundary (in blocks) of the snapshot along ``hashes`` nearest to
        ``position_blocks`` (either side; ties go left), None when there is none."""
        best: int | None = None
        for k in range(1, len(hashes) + 1):
            h = hashes[k - 1]
            if (h in self._snaps or h in self._host or self.has_disk_snapshot(h)) and (
                best is None or abs(k - position_blocks) < abs(best - position_blocks)
            ):
                best = k
        return best

    def restore(self, request_id: str, block_hash: BlockHash) -> None:
        """Queue the copy snapshot ``block_hash`` -> ``request_id``'s live slot (a
        prefix hit) and mark the snapshot most recently used.

        Raises:
            AllocationError: no such snapshot, or no live slot for ``request_id``.
        """
        dst = self.live_slot(request_id)
        e = self._snaps.get(block_hash)
        if e is None and block_hash in self._host:
            e = self._promote(block_hash)
        if e is None:
            raise AllocationError(
                "num_cached_tokens: expected a state snapshot at the hit's boundary, got none "
                "(call get_num_cached_tokens right before allocate)"
            )
        self._snaps.move_to_end(block_hash)
        self._copies.append((e.slot, dst))
        self.stats.snapshot_hits += 1

    def has_host_snapshot(self, block_hash: BlockHash) -> bool:
        """Whether a host snapshot keyed ``block_hash`` exists."""
        return block_hash in self._host

    def host_snapshot_hashes(self) -> list[BlockHash]:
        """The keys of the host snapshots, least recently used first."""
        return list(self._host)

    @property
    def num_host_used(self) -> int:
        """Host rows holding a snapshot."""
        return len(self._host)

    def _promote(self, block_hash: BlockHash) -> Snapshot | None:
        """Move the host snapshot ``block_hash`` into a snapshot slot (copy host -> slot
        queued after any eviction copy it causes; its host row is kept out of that
        eviction). None when there are no snapshot slots (the entry stays on the host)."""
        if self.num_snapshot_slots == 0:
            return None
        row, kind = self._host[block_hash]
        self._host.move_to_end(block_hash)
        if kind == "predicted" and self._num_predicted >= self.predicted_cap:
            kind = "prompt"  # wanted now: no longer a prediction
        if not self._free_snap:
            self._evict(predicted_only=False, keep_host=block_hash)
        del self._host[block_hash]
        slot = self._free_snap.pop()
        self._copies.append((self.num_slots + row, slot))
        self._free_host.append(row)
        e = Snapshot(slot, block_hash, kind)
        self._snaps[block_hash] = e
        if kind == "predicted":
            self._num_predicted += 1
        self.stats.host_snapshot_hits += 1
        self._emit_removed(block_hash, "host")
        self._emit_stored(block_hash, "device")
        return e

    def _to_host(self, e: Snapshot, keep: BlockHash | None) -> None:
        """Queue the copy of ``e``'s slot to a host row (evicting the least recently
        used host row other than ``keep``, which goes to the disk tier when there is
        one); with no host row to be had, write the slot to the disk tier instead."""
        if e.block_hash in self._host:
            return
        if self.num_host_snapshots == 0:
            self._to_disk(e.slot, e.block_hash)
            return
        if not self._free_host:
            victim = next((h for h in self._host if h != keep), None)
            if victim is None:
                self._to_disk(e.slot, e.block_hash)
                return
            vrow = self._host[victim][0]
            self._to_disk(self.num_slots + vrow, victim)  # reads the row before reuse
            del self._host[victim]
            self._free_host.append(vrow)
            self.stats.host_snapshot_evictions += 1
            self._emit_removed(victim, "host")
        row = self._free_host.pop()
        self._host[e.block_hash] = (row, e.kind)
        self._copies.append((e.slot, self.num_slots + row))
        self.stats.host_snapshots_stored += 1
        self._emit_stored(e.block_hash, "host")

    def take(
        self,
        request_id: str,
        block_hash: BlockHash,
        kind: SnapshotKind,
        *,
        priority: int = PRIORITY_DEFAULT,
        ttl_s: float | None = None,
    ) -> int | None:
        """Snapshot ``request_id``'s live state as the entry ``block_hash`` (call after
        the step whose last token ends that block; the copy live -> snapshot is
        queued). An existing entry with that key is only marked most recently used (same
        tokens, same state). A ``decode`` snapshot replaces the request's previous
        rolling one (dropped); a host copy of the key is freed as redundant. Returns the
        snapshot's slot, or None when none was taken (no snapshot slots; a predicted
        one with a zero cap; a ``decode`` one whose key a host row holds: it stays
        there, one place per key).

        Raises:
            AllocationError: ``request_id`` holds no live slot.
            SpecError: ``priority`` outside the retention levels.
        """
        src = self.live_slot(request_id)
        if not 0 <= priority < NUM_PRIORITY_LEVELS:
            raise SpecError(f"priority: expected 0 .. {NUM_PRIORITY_LEVELS - 1}, got {priority!r}")
        deadline = None if ttl_s is None else self.clock() + ttl_s
        e = self._snaps.get(block_hash)
        if e is not None:
            self._snaps.move_to_end(block_hash)
            if priority > e.priority:
                e.priority, e.deadline = priority, deadline
            if e.kind == "predicted" and kind != "predicted":  # now wanted for itself
                e.kind = kind
                self._num_predicted -= 1
            return e.slot
        if (
            self.num_snapshot_slots == 0
            or (kind == "predicted" and self.predicted_cap == 0)
            # the host keeps this state; a rolling copy would be dropped at the request's
            # next decode snapshot, never demoted, and the freed host copy with it
            or (kind == "decode" and block_hash in self._host)
        ):
            self.stats.snapshots_skipped += 1
            return None  # a host copy of the same key stays where it is
        if block_hash in self._host:
            # same tokens, same state: the host copy is now redundant
            self._free_host.append(self._host.pop(block_hash)[0])
            self._emit_removed(block_hash, "host")
        if kind == "predicted" and self._num_predicted >= self.predicted_cap:
            self._evict(predicted_only=True)
        if not self._free_snap:
            self._evict(predicted_only=False)
        slot = self._free_snap.pop()
        e = Snapshot(slot, block_hash, kind, priority, deadline)
        self._snaps[block_hash] = e
        if kind == "predicted":
            self._num_predicted += 1
        self._copies.append((src, slot))
        self._emit_stored(block_hash, "device")
        st = self.stats
        st.snapshots_taken += 1
        st.snapshots_taken_by_kind[kind] = st.snapshots_taken_by_kind.get(kind, 0) + 1
        if kind == "decode":
            old = self._rolling.get(request_id)
            if old is not None:
                prev = self._snaps.get(old)
                if prev is not None and prev.owner == request_id:
                    self._drop(old)
                    st.snapshots_dropped += 1
            e.owner = request_id
            self._rolling[request_id] = block_hash
        return slot

    def _level(self, e: Snapshot, now: float) -> int:
        if e.deadline is not None and e.deadline <= now:
            return PRIORITY_DEFAULT
        return e.priority

    def _evict(self, *, predicted_only: bool, keep_host: BlockHash | None = None) -> None:
        """Drop the least recently used snapshot of the lowest retention level (among
        predicted ones only, when asked), moving it to a host row when there are any
        (never evicting host row ``keep_host`` for it). O(snapshots)."""
        now = self.clock()
        victim: Snapshot | None = None
        best = NUM_PRIORITY_LEVELS
        for e in self._snaps.values():  # least recently used first
            if predicted_only and e.kind != "predicted":
                continue
            lv = self._level(e, now)
            if lv < best:
                victim, best = e, lv
                if lv == 0:
                    break
        assert victim is not None, "evict: no snapshot to evict"
        self._to_host(victim, keep_host)
        self._drop(victim.block_hash)
        self.stats.snapshot_evictions += 1

    def _drop(self, block_hash: BlockHash) -> None:
        e = self._snaps.pop(block_hash)
        if e.kind == "predicted":
            self._num_predicted -= 1
        if e.owner is not None and self._rolling.get(e.owner) == block_hash:
            del self._rolling[e.owner]
        self._free_snap.append(e.slot)
        self._emit_removed(block_hash, "device")

    @property
    def num_snapshots(self) -> int:
        """Snapshot slots holding an entry."""
        return len(self._snaps)

    @property
    def num_predicted(self) -> int:
        """Entries of kind ``predicted``."""
        return self._num_predicted

    def snapshot_hashes(self) -> list[BlockHash]:
        """The entries' keys, least recently used first."""
        return list(self._snaps)

    def entry(self, block_hash: BlockHash) -> Snapshot | None:
        """A copy of the entry keyed ``block_hash`` (None = none), for inspection."""
        e = self._snaps.get(block_hash)
        return None if e is None else Snapshot(**vars(e))

    # ---- copies, reset, integrity ---------------------------------------------------
    def take_copies(self) -> list[tuple[int, int]]:
        """The queued ``(src, dst)`` slot copies, in order (the engine runs them all
        before the next forward: ``StateCache.copy_slots``); the queue is emptied."""
        out, self._copies = self._copies, []
        return out

    @property
    def num_pending_copies(self) -> int:
        """Copies queued and not yet taken."""
        return len(self._copies)

    def pending_copies(self) -> list[tuple[int, int]]:
        """A copy of the queued copies, in order (for inspection; nothing taken)."""
        return list(self._copies)

    def reset(self) -> bool:
        """Drop every snapshot (slots, host rows, disk files) if no live slot is held;
        False (no change) otherwise."""
        if self._live:
            return False
        for h in list(self._snaps):
            self._drop(h)
        for h in list(self._host):
            del self._host[h]
            self._emit_removed(h, "host")
        self._free_host = list(range(self.num_host_snapshots - 1, -1, -1))
        if self._disk is not None:
            for k in self._disk.state_keys():
                self._disk.discard(k, "cleared")
        self._refused.clear()
        return True

    def check_integrity(self, live_requests: Sequence[str] | None = None) -> None:
        """Verify the slot invariants: live and snapshot slots each in their range, each
        slot either free or held exactly once, free + used == total, the predicted
        count and cap, rolling entries owned by live requests, queued copies in range;
        with ``live_requests``, the live slots are exactly theirs.

        Raises:
            IntegrityError: with the numbers.
        """
        L, S = self.num_live_slots, self.num_slots
        live = list(self._live.values())
        if len(set(live) | set(self._free_live)) != L or len(live) + len(self._free_live) != L:
            raise IntegrityError(
                f"state live slots: expected {L} slots each free or held once, got "
                f"{len(live)} held + {len(self._free_live)} free ({len(set(live))} distinct)"
            )
        if any(not 0 <= s < L for s in live + self._free_live):
            raise IntegrityError(f"state live slots: expected slots in [0, {L}), got {live}")
        snap = [e.slot for e in self._snaps.values()]
        n_snap = S - L
        if len(set(snap) | set(self._free_snap)) != n_snap or len(snap) + len(self._free_snap) != n_snap:  # fmt: skip
            raise IntegrityError(
                f"state snapshot slots: expected {n_snap} slots each free or held once, got "
                f"{len(snap)} held + {len(self._free_snap)} free"
            )
        if any(not L <= s < S for s in snap + self._free_snap):
            raise IntegrityError(f"state snapshot slots: expected slots in [{L}, {S}), got {snap}")
        for h, e in self._snaps.items():
            if e.block_hash != h:
                raise IntegrityError("state snapshot: expected its key to be its block hash")
        n_pred = sum(1 for e in self._snaps.values() if e.kind == "predicted")
        if n_pred != self._num_predicted or n_pred > self.predicted_cap:
            raise IntegrityError(
                f"state snapshots: expected {self._num_predicted} predicted <= cap "
                f"{self.predicted_cap}, got {n_pred}"
            )
        for rid, h in self._rolling.items():
            owned = self._snaps.get(h)
            if rid not in self._live or owned is None or owned.owner != rid:
                raise IntegrityError(
                    f"state rolling snapshot of {rid!r}: expected a live request owning it"
                )
        H = self.num_host_snapshots
        rows = [r for r, _ in self._host.values()]
        if len(set(rows) | set(self._free_host)) != H or len(rows) + len(self._free_host) != H:
            raise IntegrityError(
                f"state host snapshots: expected {H} rows each free or held once, got "
                f"{len(rows)} held + {len(self._free_host)} free"
            )
        if any(not (0 <= a < S + H and 0 <= b < S + H) for a, b in self._copies):
            raise IntegrityError(
                f"state copies: expected slots in [0, {S + H}), got {self._copies}"
            )
        if live_requests is not None and set(live_requests) != set(self._live):
            raise IntegrityError(
                f"state live slots: expected the requests {sorted(live_requests)}, got "
                f"{sorted(self._live)}"
            )


class _DiskTap:
    """The ``TierListener`` a :class:`StatePool` puts on its disk tier: the tier's
    snapshot files coming and going, told to the pool's listeners as ``"disk"``."""

    __slots__ = ("pool",)

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool

    def on_demoted(self, block_hash: bytes, tier: str) -> None:
        if is_state_key(block_hash):
            self.pool._emit_stored(state_key_hash(block_hash), "disk")

    def on_promoted(self, block_hash: bytes, tier: str) -> None:
        """Nothing: a disk hit keeps its file."""

    def on_dropped(self, block_hash: bytes, tier: str, reason: str) -> None:
        if is_state_key(block_hash):
            self.pool._emit_removed(state_key_hash(block_hash), "disk")


def split_state_memory(
    memory_bytes: int, state_bytes: int, num_live_slots: int, snapshot_share: float
) -> tuple[int, int]:
    """Split a cache memory budget of a hybrid model: first one live state slot per
    sequence (``num_live_slots * state_bytes``), then the rest between KV blocks and
    snapshots, ``floor(rest * snapshot_share)`` bytes for snapshots.

    Returns:
        ``(kv_bytes, snapshot_bytes)``; ``kv_bytes`` may be <= 0 (the caller refuses a
        budget too small).
    """
    rest = memory_bytes - num_live_slots * state_bytes
    snap = int(max(rest, 0) * snapshot_share)
    return rest - snap, snap


def snapshot_slots_for(
    state_bytes: int,
    snapshot_share: float,
    usable_blocks: int,
    *,
    kv_bytes: int | None = None,
    snapshot_bytes: int | None = None,
) -> int:
    """Snapshot slots of a hybrid model's pool: ``snapshot_bytes // state_bytes`` (a
    budget split by :func:`split_state_memory`), or with the KV size given
    ``floor(kv_bytes * share / (1 - share) / state_bytes)``; at most ``usable_blocks``
    (a snapshot sits at the end of a cached KV block, so more can never all be hits).

    Raises:
        SpecError: neither or both of ``kv_bytes`` / ``snapshot_bytes``; share not in
            [0, 1); ``state_bytes < 1``.
    """
    if (kv_bytes is None) == (snapshot_bytes is None):
        raise SpecError("snapshot_slots_for: expected exactly one of kv_bytes, snapshot_bytes")
    if not 0.0 <= snapshot_share < 1.0:
        raise SpecError(f"state_snapshot_share: expected a number in [0, 1), got {snapshot_share}")
    if state_bytes < 1:
        raise SpecError(f"state_bytes: expected >= 1, got {state_bytes}")
    if snapshot_bytes is None:
        assert kv_bytes is not None
        snapshot_bytes = int(kv_bytes * snapshot_share / (1.0 - snapshot_share))
    return int(max(0, min(snapshot_bytes // state_bytes, usable_blocks)))


__all__ = [
    "SNAPSHOT_PLACES",
    "Snapshot",
    "SnapshotMover",
    "StateListener",
    "StatePool",
    "StatePoolStats",
    "snapshot_slots_for",
    "split_state_memory",
]
