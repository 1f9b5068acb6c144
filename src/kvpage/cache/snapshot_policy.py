"""Where to snapshot recurrent state for prefix caching (the snapshot policy).

A prefix hit on a hybrid model needs the attention KV of the prefix **and** the
recurrent state at exactly the hit's end, a block boundary (a multiple of
``block_size``). The engine cannot recover a state after the fact: the state after
token ``t`` exists only right after the step that computed ``t``, so it must decide
*before* the step where it will want one (it then ends the prefill chunk exactly at that
boundary and copies the live state into a snapshot slot after the step). This module is
that decision, as pure logic (no pool, no torch), shared by the engine and the
simulator:

* **prompt**: always the last full-block boundary of each prompt,
  ``(P // block_size) * block_size`` (a request sharing the prompt but not its last
  partial block — the same system prompt or document with another question —
  continues from there);
* **decode** (rolling): during decode, each time a sequence's computed tokens reach a
  block boundary; the engine keeps only the newest one of a sequence, so at finish the
  sequence holds a snapshot at the last full-block boundary of its computed tokens (the
  next turn of a conversation starts there); off with ``decode_snapshots=False``, for
  traffic whose outputs never come back in a later prompt (single-turn requests);
* **predicted**: the deepest block boundary of a prompt that at least
  ``share_threshold`` requests have passed (counted per distinct block hash, so salts,
  tenants and adapters keep their own counts), when it lies past the request's hit and
  before its prompt boundary; such snapshots may hold at most ``predicted_share`` of the
  snapshot slots (:meth:`predicted_cap`; the pool evicts its least recently used
  predicted snapshot first).

A boundary ``b > 0`` is named by the hash of the block that ends there,
``hashes[b // block_size - 1]`` (``kvpage.cache.hashing``), the same key as that KV
block, so a snapshot follows the chain, salts and tenant scope of the KV cache.

The pass counts are bounded: the last ``max_tracked`` distinct hashes (least recently
passed forgotten first; a dict entry and its 65-byte key, ~170 bytes each).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpage.cache.hashing import BlockHash
from kvpage.errors import SpecError

#: why a snapshot is (to be) taken: see the module docstring
SnapshotKind = Literal["prompt", "predicted", "decode"]
SNAPSHOT_KINDS: tuple[SnapshotKind, ...] = ("prompt", "predicted", "decode")

#: distinct block hashes whose pass counts are remembered by default
DEFAULT_MAX_TRACKED = 65536


@dataclass(frozen=True)
class SnapshotPoint:
    """One boundary to snapshot.

    Attributes:
        position: tokens before the boundary (a positive multiple of ``block_size``).
        kind: ``prompt`` or ``predicted`` (prefill); ``decode`` (rolling, in decode).
        block_hash: the hash of the block ending at ``position`` (the snapshot's key).
    """

    position: int
    kind: SnapshotKind
    block_hash: BlockHash


class SnapshotPolicy:
    """The snapshot policy (module docstring) of one engine or simulated instance.

    Args:
        block_size: tokens per KV block (>= 1); snapshots sit on its boundaries.
        share_threshold: requests that must have passed a boundary before it is
            predicted shared (>= 2: one request is the prompt boundary's job).
        predicted_share: most fraction of the snapshot slots predicted snapshots may
            hold, in [0, 1] (0 = no predicted snapshots).
        max_tracked: distinct block hashes whose pass counts are remembered (>= 1).
        decode_snapshots: take the rolling decode snapshots (default True).

    Raises:
        SpecError: a parameter out of range.
    """

    def __init__(
        self,
        block_size: int,
        *,
        share_threshold: int = 2,
        predicted_share: float = 0.25,
        max_tracked: int = DEFAULT_MAX_TRACKED,
        decode_snapshots: bool = True,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise SpecError(f"block_size: expected an int >= 1, got {block_size!r}")
        if (
            isinstance(share_threshold, bool)
            or not isinstance(share_threshold, int)
            or share_threshold < 2
        ):
            raise SpecError(f"share_threshold: expected an int >= 2, got {share_threshold!r}")
        if isinstance(predicted_share, bool) or not 0.0 <= float(predicted_share) <= 1.0:
            raise SpecError(
                f"predicted_share: expected a number in [0, 1], got {predicted_share!r}"
            )
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 1:
            raise SpecError(f"max_tracked: expected an int >= 1, got {max_tracked!r}")
        if not isinstance(decode_snapshots, bool):
            raise SpecError(f"decode_snapshots: expected a bool, got {decode_snapshots!r}")
        self.block_size = block_size
        self.share_threshold = share_threshold
        self.predicted_share = float(predicted_share)
        self.max_tracked = max_tracked
        self.decode_snapshots = decode_snapshots
        self._passes: OrderedDict[BlockHash, int] = OrderedDict()

    # ---- pass counts ----------------------------------------------------------------
    def observe(self, hashes: Sequence[BlockHash]) -> None:
        """Count one request passing the boundaries ending the blocks ``hashes`` (its
        prompt's full blocks; a hash repeated in ``hashes`` counts once). Mutates the
        pass counts (least recently passed hashes forgotten past ``max_tracked``)."""
        passes = self._passes
        for h in dict.fromkeys(hashes):
            passes[h] = passes.pop(h, 0) + 1
        while len(passes) > self.max_tracked:
            passes.popitem(last=False)

    def pass_count(self, block_hash: BlockHash) -> int:
        """Requests counted passing the boundary ending ``block_hash`` (0 = none or
        forgotten)."""
        return self._passes.get(block_hash, 0)

    @property
    def num_tracked(self) -> int:
        """Distinct block hashes with a pass count."""
        return len(self._passes)

    # ---- boundaries -----------------------------------------------------------------
    def last_full_boundary(self, num_tokens: int) -> int:
        """``(num_tokens // block_size) * block_size``: the last block boundary at or
        before ``num_tokens`` tokens (0 = none)."""
        return max(num_tokens, 0) // self.block_size * self.block_size

    def prompt_points(
        self,
        hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        num_cached_tokens: int,
        *,
        self_pass: bool = False,
    ) -> list[SnapshotPoint]:
        """The boundaries to snapshot while prefilling a prompt, in position order:
        the deepest predicted-shared boundary (if any) and the prompt boundary, both
        strictly past ``num_cached_tokens`` (a snapshot at the hit exists already).

        Args:
            hashes: the prompt's full-block hashes (``num_prompt_tokens // block_size``
                of them, block 0 first); call :meth:`observe` with them first so this
                request's own pass counts.
            num_prompt_tokens: the prompt's length ``P``.
            num_cached_tokens: the prefix hit (tokens; the prefill starts there).
            self_pass: count this request's own pass as if :meth:`observe` had run
                (the answer :meth:`observe` then this call will give; changes nothing).

        Raises:
            SpecError: ``len(hashes) != P // block_size``.
        """
        bs = self.block_size
        nfull = num_prompt_tokens // bs
        if len(hashes) != nfull:
            raise SpecError(
                f"hashes: expected {nfull} (num_prompt_tokens // block_size), got {len(hashes)}"
            )
        last = nfull * bs
        out: list[SnapshotPoint] = []
        if self.predicted_share > 0.0:
            for i in range(nfull - 2, -1, -1):  # deepest first, below the prompt boundary
                b = (i + 1) * bs
                if b <= num_cached_tokens:
                    break
                if self.pass_count(hashes[i]) + self_pass >= self.share_threshold:
                    out.append(SnapshotPoint(b, "predicted", hashes[i]))
                    break
        if last > num_cached_tokens:
            out.append(SnapshotPoint(last, "prompt", hashes[nfull - 1]))
        return out

    def chunk_end(self, start: int, end: int, points: Sequence[SnapshotPoint]) -> int:
        """Where a prefill chunk of tokens ``[start, end)`` must end so the state at
        each wanted boundary exists after some step: the first point strictly inside
        ``(start, end)``, else ``end``."""
        for p in points:
            if start < p.position < end:
                return p.position
        return end

    def decode_point(self, computed_before: int, computed_after: int) -> int | None:
        """The rolling decode boundary a step reached: ``computed_after`` when the step
        computed tokens and ``computed_after`` is a multiple of ``block_size``, else
        None (the state after a step is the one after its last token, so only a step
        ending exactly on a boundary can give that boundary's snapshot)."""
        if computed_after <= computed_before or computed_after % self.block_size:
            return None
        return computed_after

    def predicted_cap(self, num_snapshot_slots: int) -> int:
        """Most predicted snapshots a pool of ``num_snapshot_slots`` snapshot slots may
        hold: ``floor(predicted_share * num_snapshot_slots)``."""
        return int(self.predicted_share * max(num_snapshot_slots, 0))


__all__ = [
    "DEFAULT_MAX_TRACKED",
    "SNAPSHOT_KINDS",
    "SnapshotKind",
    "SnapshotPoint",
    "SnapshotPolicy",
]
