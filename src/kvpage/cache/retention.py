"""Per-request retention policies: which of a request's cached blocks stay longer (or
go first) once the request is done with them.

In the spirit of TensorRT-LLM's ``KvCacheRetentionConfig`` (token ranges with a
priority and a duration, plus a priority for decode blocks); the names, levels and
rules here are kvpage's own:

* a :class:`RetentionRange` gives the full blocks inside tokens ``[start, end)`` a
  priority level (``kvpage.cache.free_queue``: 0 low, 1 default, 2 high, 3 max) for
  ``ttl_s`` seconds after they are freed (None = until evicted at that level);
* ``decode_priority`` applies to every block holding at least one generated token
  (``0`` = evict those first);
* ranges override the decode rule and later ranges override earlier ones.

The priority is *soft*: a retained block is still free, and the allocator takes it only
when no lower-level free block is left, so retention never makes a request wait. The
pool caps how many free blocks sit at a raised level (``BlockPool.max_retained_blocks``),
and the engine sizes that cap so that one max-length request always fits without
evicting a retained block (``kvpage.engine.config``). Hashes (and so the blocks a
policy can keep) include the request's cache salt: retention never shares a block
across tenants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpage.cache.free_queue import NUM_PRIORITY_LEVELS, PRIORITY_DEFAULT
from kvpage.errors import SpecError, got_repr

#: longest ``ttl_s`` accepted (one week, in seconds): a bound against typos, not a policy
MAX_TTL_S = 7 * 24 * 3600.0
#: most ranges one policy may list
MAX_RANGES = 8

_PRIO = f"an int in [0, {NUM_PRIORITY_LEVELS - 1}]"


def _check_priority(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < NUM_PRIORITY_LEVELS:
        raise SpecError(f"{name}: expected {_PRIO}, got {got_repr(v)}")
    return v


def _check_ttl(name: str, v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SpecError(
            f"{name}: expected None or a number of seconds in (0, {MAX_TTL_S}], got {got_repr(v)}"
        )
    if not 0 < v <= MAX_TTL_S:
        raise SpecError(
            f"{name}: expected None or a number of seconds in (0, {MAX_TTL_S}], got {got_repr(v)}"
        )
    return float(v)


@dataclass(frozen=True)
class RetentionRange:
    """Tokens ``[start, end)`` of a request and the level their full blocks get.

    Attributes:
        start: first token (>= 0).
        end: one past the last token (> start); None = the end of the prompt.
        priority: free-queue level, 0..3 (``kvpage.cache.free_queue``).
        ttl_s: seconds the level holds after the block is freed (None = no expiry).

    Raises:
        SpecError: a value out of range ("kv_retention.ranges[i].name: expected ...").
    """

    start: int = 0
    end: int | None = None
    priority: int = PRIORITY_DEFAULT
    ttl_s: float | None = None

    def check(self, where: str) -> None:
        """Validate (``where`` prefixes the field names of the error)."""
        s = self.start
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise SpecError(f"{where}.start: expected an int >= 0, got {got_repr(s)}")
        e = self.end
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e <= s):
            raise SpecError(
                f"{where}.end: expected None or an int > start ({s}), got {got_repr(e)}"
            )
        _check_priority(f"{where}.priority", self.priority)
        _check_ttl(f"{where}.ttl_s", self.ttl_s)


@dataclass(frozen=True)
class KVRetention:
    """A request's retention policy (see the module docstring).

    Attributes:
        ranges: token ranges with their level and ttl (at most :data:`MAX_RANGES`).
        decode_priority: level of blocks holding generated tokens (default 1: none).
        decode_ttl_s: ttl of a raised ``decode_priority`` (None = no expiry).

    Raises:
        SpecError: on construction, naming the bad field.
    """

    ranges: tuple[RetentionRange, ...] = ()
    decode_priority: int = PRIORITY_DEFAULT
    decode_ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ranges, tuple):
            object.__setattr__(self, "ranges", tuple(self.ranges))
        if len(self.ranges) > MAX_RANGES:
            raise SpecError(
                f"kv_retention.ranges: expected at most {MAX_RANGES} ranges, got {len(self.ranges)}"
            )
        for i, r in enumerate(self.ranges):
            if not isinstance(r, RetentionRange):
                raise SpecError(
                    f"kv_retention.ranges[{i}]: expected a RetentionRange, got {got_repr(r)}"
                )
            r.check(f"kv_retention.ranges[{i}]")
        _check_priority("kv_retention.decode_priority", self.decode_priority)
        _check_ttl("kv_retention.decode_ttl_s", self.decode_ttl_s)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVRetention:
        """Build from plain data (the server's JSON field, a dict in ``SamplingParams``):
        ``{"ranges": [{"start", "end", "priority", "ttl_s"}, ...], "decode_priority",
        "decode_ttl_s"}``; every key optional, unknown keys refused.

        Raises:
            SpecError: naming the bad or unknown field.
        """
        if not isinstance(d, Mapping):
            raise SpecError(f"kv_retention: expected an object, got {got_repr(d)}")
        allowed = {"ranges", "decode_priority", "decode_ttl_s"}
        unknown = sorted(str(k) for k in d if k not in allowed)
        if unknown:
            raise SpecError(f"kv_retention: expected keys among {sorted(allowed)}, got {unknown}")
        raw = d.get("ranges") or []
        if not isinstance(raw, (list, tuple)):
            raise SpecError(f"kv_retention.ranges: expected a list, got {got_repr(raw)}")
        ranges = []
        keys = {"start", "end", "priority", "ttl_s"}
        for i, r in enumerate(raw):
            if not isinstance(r, Mapping):
                raise SpecError(f"kv_retention.ranges[{i}]: expected an object, got {got_repr(r)}")
            bad = sorted(str(k) for k in r if k not in keys)
            if bad:
                raise SpecError(
                    f"kv_retention.ranges[{i}]: expected keys among {sorted(keys)}, got {bad}"
                )
            ranges.append(RetentionRange(**{str(k): v for k, v in r.items()}))
        return cls(
            tuple(ranges),
            d.get("decode_priority", PRIORITY_DEFAULT),
            d.get("decode_ttl_s"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form :meth:`from_dict` reads."""
        return {
            "ranges": [
                {"start": r.start, "end": r.end, "priority": r.priority, "ttl_s": r.ttl_s}
                for r in self.ranges
            ],
            "decode_priority": self.decode_priority,
            "decode_ttl_s": self.decode_ttl_s,
        }

    @property
    def max_priority(self) -> int:
        """The highest level the policy asks for."""
        return max([self.decode_priority, *(r.priority for r in self.ranges)])

    @property
    def max_ttl_s(self) -> float | None:
        """The longest ttl of a raised level (None = some raised level never expires,
        or no level is raised)."""
        ttls = [r.ttl_s for r in self.ranges if r.priority > PRIORITY_DEFAULT]
        if self.decode_priority > PRIORITY_DEFAULT:
            ttls.append(self.decode_ttl_s)
        if not ttls or any(t is None for t in ttls):
            return None
        return max(t for t in ttls if t is not None)

    def block_spans(
        self, num_prompt_tokens: int, block_size: int, num_blocks: int
    ) -> list[tuple[int, int, int, float | None]]:
        """``(first block, end block, priority, ttl_s)`` runs of the table's blocks
        ``0 .. num_blocks-1`` whose level is not the default (a range covers a block
        when all its tokens are inside; decode blocks hold a token at or past
        ``num_prompt_tokens``)."""
        bs = block_size
        per: list[tuple[int, float | None]] = [(PRIORITY_DEFAULT, None)] * num_blocks
        if self.decode_priority != PRIORITY_DEFAULT:
            for i in range(min(num_prompt_tokens // bs, num_blocks), num_blocks):
                per[i] = (self.decode_priority, self.decode_ttl_s)
        for r in self.ranges:
            end = num_prompt_tokens if r.end is None else r.end
            for i in range(-(-r.start // bs), min(end // bs, num_blocks)):
                per[i] = (r.priority, r.ttl_s)
        spans: list[tuple[int, int, int, float | None]] = []
        for i, (p, t) in enumerate(per):
            if p == PRIORITY_DEFAULT:
                continue
            if spans and spans[-1][1] == i and spans[-1][2:] == (p, t):
                lo = spans[-1][0]
                spans[-1] = (lo, i + 1, p, t)
            else:
                spans.append((i, i + 1, p, t))
        return spans


def max_retained_blocks(num_usable: int, share: float, blocks_for_one_request: int) -> int:
    """The pool's retention cap: ``min(floor(share * num_usable), num_usable -
    blocks_for_one_request)``, at least 0, so a request of ``blocks_for_one_request``
    blocks always fits in blocks no retention holds.

    Raises:
        SpecError: ``share`` outside [0, 1].
    """
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise SpecError(
            f"kv_retention_max_share: expected a number in [0, 1], got {got_repr(share)}"
        )
    return max(0, min(int(share * num_usable), num_usable - blocks_for_one_request))


__all__ = ["MAX_RANGES", "MAX_TTL_S", "KVRetention", "RetentionRange", "max_retained_blocks"]
