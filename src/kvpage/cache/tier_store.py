"""The two KV tiers below the block pool: host memory and local disk.

Each tier is an LRU map ``block hash -> payload`` with a byte capacity; a *payload* is
one block's K/V of every layer as a C-contiguous byte buffer (``bytes`` or a 1-D
``uint8`` numpy array, made by the engine's block mover, ``kvpage.engine.kv_transfer``).
Block hashes already include the request's cache salt and adapter (``cache/hashing``),
so tenants stay isolated in every tier exactly as in the pool.

* :class:`HostTier`: an ``OrderedDict`` in process memory. ``put`` returns the entries
  it evicted to stay within ``capacity_bytes`` (the caller demotes them to disk).
* :class:`DiskTier`: one file per block under ``<path>/<fingerprint hex>/``, named
  ``<block hash hex>.kvb``, written atomically (temporary file + ``os.replace``). A file
  holds a header (magic, fingerprint, block hash, payload length, blake2b-128 checksum of
  the payload) and the payload; a read verifies every field, and a torn, corrupt or
  deleted file is a counted miss (``stats.corrupt``) and is removed, never served. The
  fingerprint (:func:`tier_fingerprint`) covers the model, KV dtype, block size, hash seed
  and the cache geometry, so files of another model or layout are never even listed.
  On an ``OSError`` while writing (disk full: ``ENOSPC``) the tier stops accepting
  demotions (``writable`` False, ``stats.write_errors`` +1), warns once on the
  ``kvpage.cache`` logger (printed on stderr by every command, even without logging
  configured: Python's last-resort handler) and keeps serving reads.
  The directory survives a restart: a new tier over the same path and fingerprint
  indexes the files it finds (oldest modification time evicted first); files that
  cannot be a block (empty, header only, a header that does not match the name, the
  fingerprint or the size, unreadable) are removed then, counted in ``stats.corrupt``
  and ``stats.removed_at_start``, and logged once.

Recurrent-state snapshots (hybrid models, ``kvpage.cache.state_pool``) share the disk
tier: a snapshot file is keyed by :func:`state_key` of the block hash ending at its
boundary (34 bytes, so it never equals a KV key of any group, ``tiered.tier_key``: 32
or 33 bytes), written, verified, indexed at start and evicted exactly like a block
file, in the same least-recently-used order. With ``state_capacity_bytes`` the state
files together hold at most that many bytes (a state put first evicts the oldest
state files beyond it); all files together stay within ``capacity_bytes``, so a KV
file may evict a state file and the reverse.

Observing tier changes (for eviction records and KV events): every tier calls each of
its ``listeners`` (:class:`TierListener`) synchronously with ``on_demoted(block_hash,
tier)`` when a block enters the tier, ``on_promoted(block_hash, tier)`` when a lookup
takes it back into the pool, and ``on_dropped(block_hash, tier, reason)`` when it
leaves the tier without going to the pool; reasons are ``"capacity"`` (LRU eviction),
``"corrupt"`` (failed verification or missing file), ``"stored_in_pool"`` (the pool
computed the same content again), ``"write_error"`` (the disk write failed) and
``"cleared"`` (``reset_prefix_cache``). Counters are in ``stats`` (:class:`TierStats`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvpage.cache.hashing import BlockHash
from kvpage.errors import SpecError

#: one block's K/V of every layer: ``bytes`` or a 1-D ``uint8`` numpy array
Payload = Any

_MAGIC = b"KVPGBLK1"
#: magic, fingerprint (16), block hash length (1) + hash, payload length, checksum (16)
_HEAD = struct.Struct("<8s16sB")
_TAIL = struct.Struct("<Q16s")
_SUFFIX = ".kvb"
#: the first bytes of a recurrent-state snapshot's tier key (:func:`state_key`)
STATE_KEY_PREFIX = b"st"
_STATE_KEY_LEN = len(STATE_KEY_PREFIX) + 32

logger = logging.getLogger("kvpage.cache")


class TierListener(Protocol):
    """Observer of one tier's changes (see the module docstring); calls are synchronous
    and must not call back into the tier."""

    def on_demoted(self, block_hash: BlockHash, tier: str) -> None:
        """``block_hash`` entered ``tier`` (``"host"`` or ``"disk"``)."""

    def on_promoted(self, block_hash: BlockHash, tier: str) -> None:
        """``block_hash`` was copied from ``tier`` into a pool block by a prefix lookup."""

    def on_dropped(self, block_hash: BlockHash, tier: str, reason: str) -> None:
        """``block_hash`` left ``tier`` for ``reason`` (not to the pool)."""


@dataclass
class TierStats:
    """Counters of one tier since construction (bytes and blocks).

    Attributes:
        demotions: blocks that entered the tier.
        promotions: blocks copied from the tier into the pool (lookups).
        hits_tokens: prompt tokens of admitted requests served from blocks this tier
            promoted (``KVCacheManager`` counts them when the hit is taken).
        drops: blocks that left the tier other than by promotion (any reason).
        corrupt: reads refused (checksum, header, length or missing file), and files
            removed at start-up (``removed_at_start``).
        removed_at_start: files a disk tier found at start that cannot be a block
            (empty, header only, mismatched header, unreadable), removed.
        write_errors: failed writes (disk tier; the tier then stops accepting).
        bytes_in: payload bytes written into the tier.
        bytes_out: payload bytes read out of the tier.
        transfer_s: wall seconds (``time.perf_counter``) spent copying blocks between
            the pool and this tier (device copies by the mover, file I/O).
    """

    demotions: int = 0
    promotions: int = 0
    hits_tokens: int = 0
    drops: int = 0
    corrupt: int = 0
    removed_at_start: int = 0
    write_errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    transfer_s: float = 0.0


def payload_nbytes(payload: Payload) -> int:
    """Size of a payload in bytes."""
    return memoryview(payload).nbytes


def state_key(block_hash: BlockHash) -> bytes:
    """The tiers' key of the recurrent-state snapshot at the end of block ``block_hash``
    (a 32-byte chained hash, ``kvpage.cache.hashing``): :data:`STATE_KEY_PREFIX` then the
    hash, 34 bytes, never equal to a KV key (``kvpage.cache.tiered.tier_key``: 32 or 33
    bytes); salts, adapters and tenant scope are in the hash, as for the KV blocks.

    Raises:
        SpecError: a hash of another length.
    """
    if len(block_hash) != 32:
        raise SpecError(f"block_hash: expected 32 bytes, got {len(block_hash)}")
    return STATE_KEY_PREFIX + block_hash


def is_state_key(key: bytes) -> bool:
    """Whether ``key`` is a :func:`state_key` (a snapshot entry, not a KV block)."""
    return len(key) == _STATE_KEY_LEN and key.startswith(STATE_KEY_PREFIX)


def state_key_hash(key: bytes) -> BlockHash:
    """The block hash of a :func:`state_key` (its inverse)."""
    return key[len(STATE_KEY_PREFIX) :]


def tier_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """16-byte fingerprint of everything that decides a block's bytes besides its hash:
    the model identity and config, KV dtype, block size, hash seed, layers, KV heads,
    head dims. ``fields`` must be JSON-serialisable (keys sorted for a stable encoding).
    Source: blake2b-128 of the sorted-key JSON."""
    enc = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.blake2b(enc, digest_size=16).digest()


class _Tier:
    """Shared LRU bookkeeping: ``_sizes`` maps hash -> payload bytes, oldest first."""

    name = ""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise SpecError(f"capacity_bytes: expected an int >= 0, got {capacity_bytes!r}")
        if capacity_bytes < 0:
            raise SpecError(f"capacity_bytes: expected an int >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[BlockHash, int] = OrderedDict()
        self.stats = TierStats()
        self.listeners: list[TierListener] = []

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def hashes(self) -> Iterator[BlockHash]:
        """Hashes held, least recently used first."""
        return iter(list(self._sizes))

    def _emit_dropped(self, h: BlockHash, reason: str) -> None:
        self.stats.drops += 1
        for listener in self.listeners:
            listener.on_dropped(h, self.name, reason)

    def _emit_demoted(self, h: BlockHash) -> None:
        self.stats.demotions += 1
        for listener in self.listeners:
            listener.on_demoted(h, self.name)

    def _emit_promoted(self, h: BlockHash) -> None:
        self.stats.promotions += 1
        for listener in self.listeners:
            listener.on_promoted(h, self.name)


class _InMemoryTier(_Tier):
    """A tier whose payloads live in a dict beside the LRU sizes (the host tier, and the
    simulator's file-less disk tier ``kvpage.sim.tiers.SimDiskTier``)."""

    def __init__(self, capacity_bytes: int) -> None:
        # _Tier's, named: in SimDiskTier's MRO the next class is DiskTier (other arguments)
        _Tier.__init__(self, capacity_bytes)
        self._data: dict[BlockHash, Payload] = {}

    def discard(self, block_hash: BlockHash, reason: str) -> bool:
        """Drop an entry for ``reason``; False if absent."""
        sz = self._sizes.pop(block_hash, None)
        if sz is None:
            return False
        self.used_bytes -= sz
        del self._data[block_hash]
        self._emit_dropped(block_hash, reason)
        return True


class HostTier(_InMemoryTier):
    """Host-memory tier (see the module docstring).

    Args:
        capacity_bytes: most payload bytes held (>= 0).
    """

    name = "host"

    def put(self, block_hash: BlockHash, payload: Payload) -> list[tuple[BlockHash, Payload]]:
        """Insert (most recently used); returns the ``(hash, payload)`` entries evicted
        (LRU) to stay within capacity, oldest first — the caller demotes or drops them
        (their ``on_dropped(..., "capacity")`` is the caller's to emit when dropped). A
        payload larger than the capacity is returned at once, not stored."""
        n = payload_nbytes(payload)
        if block_hash in self._sizes:
            self._sizes.move_to_end(block_hash)
            return []
        if n > self.capacity_bytes:
            return [(block_hash, payload)]
        out = []
        while self.used_bytes + n > self.capacity_bytes:
            h, sz = self._sizes.popitem(last=False)
            self.used_bytes -= sz
            out.append((h, self._data.pop(h)))
        self._sizes[block_hash] = n
        self._data[block_hash] = payload
        self.used_bytes += n
        self.stats.bytes_in += n
        self._emit_demoted(block_hash)
        return out

    def take(self, block_hash: BlockHash) -> Payload | None:
        """Remove and return the payload (a promotion), or None if absent."""
        sz = self._sizes.pop(block_hash, None)
        if sz is None:
            return None
        self.used_bytes -= sz
        self.stats.bytes_out += sz
        self._emit_promoted(block_hash)
        return self._data.pop(block_hash)

    def peek(self, block_hash: BlockHash) -> Payload | None:
        """The payload without any change (tests, integrity checks)."""
        return self._data.get(block_hash)

    def clear(self) -> None:
        """Drop everything (reason ``"cleared"``)."""
        for h in list(self._sizes):
            self.discard(h, "cleared")


class DiskTier(_Tier):
    """Local-disk tier (see the module docstring).

    Args:
        path: the tier's root directory (created if missing).
        capacity_bytes: most payload bytes held (>= 0); files beyond it found at start
            are deleted, oldest first.
        fingerprint: :func:`tier_fingerprint` of the engine's model and layout.
        state_capacity_bytes: most bytes of recurrent-state snapshot files
            (:func:`state_key` entries) within ``capacity_bytes`` (0 = none taken;
            module docstring).

    Attributes:
        state_used_bytes: payload bytes of the snapshot files held.

    Raises:
        SpecError: bad capacity, fingerprint, or a path that cannot be used as a
            directory.
    """

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        fingerprint: bytes,
        *,
        state_capacity_bytes: int = 0,
    ):
        super().__init__(capacity_bytes)
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 16:
            raise SpecError(f"fingerprint: expected 16 bytes, got {fingerprint!r}")
        if (
            isinstance(state_capacity_bytes, bool)
            or not isinstance(state_capacity_bytes, int)
            or not 0 <= state_capacity_bytes <= capacity_bytes
        ):
            raise SpecError(
                f"state_capacity_bytes: expected an int in [0, {capacity_bytes}], got "
                f"{state_capacity_bytes!r}"
            )
        self.state_capacity_bytes = state_capacity_bytes
        self.state_used_bytes = 0
        #: the snapshot entries: state key -> payload bytes, least recently used first
        self._state: OrderedDict[bytes, int] = OrderedDict()
        self.fingerprint = fingerprint
        self.root = Path(path)
        self.dir = self.root / fingerprint.hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecError(
                f"kv_disk_tier_path: expected a writable directory, got {str(path)!r} ({e})"
            ) from None
        self.writable = True
        #: the error of the write that stopped the tier ("" while writable)
        self.last_write_error = ""
        #: keys of the files removed at start (cannot be a block), in scan order
        self.removed_at_start: list[bytes] = []
        self._scan()

    def _file(self, h: BlockHash) -> Path:
        return self.dir / (h.hex() + _SUFFIX)

    def _scan(self) -> None:
        """Index the files left by an earlier run, oldest first; delete temporaries and
        files that cannot be a block (their header is read: one small read per file;
        the payload's checksum is verified when the block is read)."""
        found = []
        bad = 0
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # a write torn by a crash
                continue
            if not p.name.endswith(_SUFFIX):
                continue
            try:
                h = bytes.fromhex(p.name[: -len(_SUFFIX)])
            except ValueError:
                continue  # not a name this tier writes: not ours to delete
            entry = self._index_entry(p, h)
            if entry is None:
                with contextlib.suppress(OSError):
                    p.unlink(missing_ok=True)
                bad += 1
                self.removed_at_start.append(h)
            else:
                found.append(entry)
        if bad:
            self.stats.corrupt += bad
            self.stats.removed_at_start += bad
            logger.warning(
                "kvpage: disk KV tier %s: removed %d file(s) that cannot be a block "
                "(empty, header only, mismatched header or unreadable)",
                self.dir,
                bad,
            )
        for _, h, size in sorted(found):
            self._add(h, size)
        self._shrink_state(0)
        self._shrink(0)

    def _index_entry(self, p: Path, h: BlockHash) -> tuple[int, BlockHash, int] | None:
        """``(mtime ns, hash, payload size)`` of a block file whose header matches its
        name, this tier's fingerprint and its length; None otherwise."""
        head_len = _HEAD.size + len(h) + _TAIL.size
        try:
            st = p.stat()
            with open(p, "rb") as f:
                head = f.read(head_len)
        except OSError:
            return None
        size = st.st_size - head_len
        if size <= 0 or len(head) < head_len:
            return None
        magic, fp, hl = _HEAD.unpack_from(head)
        if magic != _MAGIC or fp != self.fingerprint or hl != len(h):
            return None
        if head[_HEAD.size : _HEAD.size + hl] != h:
            return None
        n, _ = _TAIL.unpack_from(head, _HEAD.size + hl)
        if n != size:
            return None
        return st.st_mtime_ns, h, size

    def _add(self, h: bytes, size: int) -> None:
        self._sizes[h] = size
        self.used_bytes += size
        if is_state_key(h):
            self._state[h] = size
            self.state_used_bytes += size

    def _remove(self, h: bytes) -> int | None:
        """Forget entry ``h`` (not its file); its size, None if absent."""
        sz = self._sizes.pop(h, None)
        if sz is None:
            return None
        self.used_bytes -= sz
        if self._state.pop(h, None) is not None:
            self.state_used_bytes -= sz
        return sz

    def _shrink(self, need: int) -> None:
        while self._sizes and self.used_bytes + need > self.capacity_bytes:
            h = next(iter(self._sizes))
            self._remove(h)
            self._file(h).unlink(missing_ok=True)
            self._emit_dropped(h, "capacity")

    def _shrink_state(self, need: int) -> None:
        """Evict the oldest snapshot files until ``need`` more bytes fit the state cap."""
        while self._state and self.state_used_bytes + need > self.state_capacity_bytes:
            h = next(iter(self._state))
            self._remove(h)
            self._file(h).unlink(missing_ok=True)
            self._emit_dropped(h, "capacity")

    def touch(self, key: bytes) -> bool:
        """Mark entry ``key`` most recently used; False if absent."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        if key in self._state:
            self._state.move_to_end(key)
        return True

    @property
    def num_state_entries(self) -> int:
        """Snapshot files held (:func:`state_key` entries)."""
        return len(self._state)

    def state_keys(self) -> list[bytes]:
        """The :func:`state_key` entries held, least recently used first."""
        return list(self._state)

    def put(self, block_hash: BlockHash, payload: Payload) -> bool:
        """Write the block (atomic), evicting the oldest files to fit. Returns False when
        not stored: too large, the tier stopped after a write error, or this write
        failed (then ``writable`` becomes False and ``stats.write_errors`` +1). A
        :func:`state_key` entry must also fit ``state_capacity_bytes`` (older snapshot
        files are evicted first)."""
        if self.touch(block_hash):
            return True
        n = payload_nbytes(payload)
        state = is_state_key(block_hash)
        if not self.writable or n > (self.state_capacity_bytes if state else self.capacity_bytes):
            return False
        t0 = time.perf_counter()
        if state:
            self._shrink_state(n)
        self._shrink(n)
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        head = _HEAD.pack(_MAGIC, self.fingerprint, len(block_hash)) + block_hash
        tmp = self.dir / (block_hash.hex() + ".tmp")
        try:
            self._write_file(tmp, (head, _TAIL.pack(n, digest), payload))
            os.replace(tmp, self._file(block_hash))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.writable = False
            self.stats.write_errors += 1
            self.last_write_error = f"{errno.errorcode.get(e.errno or 0, 'OSError')}: {e}"
            # once: the tier stops accepting, so no later put reaches this line
            logger.warning(
                "kvpage: disk KV tier %s: write failed (%s); no more blocks are written to "
                "disk in this run (the blocks already there are still served)",
                self.dir,
                self.last_write_error,
            )
            return False
        self._add(block_hash, n)
        self.stats.bytes_in += n
        self.stats.transfer_s += time.perf_counter() - t0
        self._emit_demoted(block_hash)
        return True

    @staticmethod
    def _write_file(path: Path, chunks: tuple[Payload, ...]) -> None:
        """Write ``chunks`` to a new file ``path`` (the one place the tier writes data;
        fault tests replace it to simulate a full disk)."""
        with open(path, "wb") as f:
            for c in chunks:
                f.write(c)

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The verified payload (the file stays: the disk tier is inclusive), or None if
        absent or refused (then the file is removed and counted in ``stats.corrupt``)."""
        sz = self._sizes.get(block_hash)
        if sz is None:
            return None
        t0 = time.perf_counter()
        data = self._read_verified(block_hash, sz)
        if data is None:
            self.stats.corrupt += 1
            self._remove(block_hash)
            self._file(block_hash).unlink(missing_ok=True)
            self._emit_dropped(block_hash, "corrupt")
            return None
        self.touch(block_hash)
        self.stats.bytes_out += sz
        self.stats.transfer_s += time.perf_counter() - t0
        self._emit_promoted(block_hash)
        return data

    def _read_verified(self, h: BlockHash, size: int) -> bytes | None:
        try:
            raw = self._file(h).read_bytes()
        except OSError:
            return None
        k = _HEAD.size
        if len(raw) < k + len(h) + _TAIL.size:
            return None
        magic, fp, hl = _HEAD.unpack_from(raw)
        if magic != _MAGIC or fp != self.fingerprint or raw[k : k + hl] != h:
            return None
        n, digest = _TAIL.unpack_from(raw, k + hl)
        body = raw[k + hl + _TAIL.size :]
        if n != size or len(body) != n:
            return None
        if hashlib.blake2b(body, digest_size=16).digest() != digest:
            return None
        return body

    def discard(self, block_hash: BlockHash, reason: str) -> bool:
        """Delete a block's file for ``reason``; False if absent."""
        if self._remove(block_hash) is None:
            return False
        self._file(block_hash).unlink(missing_ok=True)
        self._emit_dropped(block_hash, reason)
        return True

    def clear(self) -> None:
        """Delete every file of this fingerprint (reason ``"cleared"``)."""
        for h in list(self._sizes):
            self.discard(h, "cleared")


__all__ = [
    "STATE_KEY_PREFIX",
    "DiskTier",
    "HostTier",
    "Payload",
    "TierListener",
    "TierStats",
    "is_state_key",
    "payload_nbytes",
    "state_key",
    "state_key_hash",
    "tier_fingerprint",
]
