"""The common model of a request trace: :class:`TraceRequest` (one request: arrival,
prompt and output lengths, optional prefix hash ids) and :class:`Trace` (the requests of
one trace in arrival order), the one error type of trace loading and the Mooncake hash
block size. The readers of the file formats are in :mod:`kvpage.workload.trace_readers`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvpage.errors import KVPageError

#: tokens per Mooncake hash block (FAST'25 release README)
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(KVPageError, ValueError):
    """A trace file is missing, malformed, or not in a known format."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        index: 0-based row of the request in its trace file (after the header).
        arrival_s: arrival time in seconds since the first request of the trace.
        prompt_tokens: prompt length in tokens (>= 0).
        output_tokens: generated length in tokens (>= 0).
        hash_ids: Mooncake 512-token prefix block ids, or None when the trace has none.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None

    @property
    def request_id(self) -> str:
        """A stable id: ``"r<index>"``."""
        return f"r{self.index}"

    @property
    def total_tokens(self) -> int:
        """Prompt plus output tokens: the final sequence length."""
        return self.prompt_tokens + self.output_tokens


@dataclass
class Trace:
    """A loaded trace: requests sorted by arrival time (non-decreasing; loaders sort
    stably, so equal timestamps keep file order).

    Attributes:
        name: the bundled name or the file stem.
        path: the file it came from ("" for synthetic traces).
        format: ``"azure"``, ``"mooncake"`` or ``"synthetic"``.
        requests: the requests.
        hash_block_tokens: tokens per hash id (512 for Mooncake).
    """

    name: str
    path: str
    format: str
    requests: list[TraceRequest] = field(default_factory=list)
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def has_hash_ids(self) -> bool:
        """True when every request carries prefix hash ids."""
        return bool(self.requests) and all(r.hash_ids is not None for r in self.requests)

    @property
    def duration_s(self) -> float:
        """Last arrival minus first arrival, in seconds."""
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def prompt_lens(self) -> np.ndarray:
        """``[num_requests]`` int64 prompt lengths in tokens."""
        return np.array([r.prompt_tokens for r in self.requests], dtype=np.int64)

    def output_lens(self) -> np.ndarray:
        """``[num_requests]`` int64 output lengths in tokens."""
        return np.array([r.output_tokens for r in self.requests], dtype=np.int64)

    def arrivals(self) -> np.ndarray:
        """``[num_requests]`` float64 arrival times in seconds."""
        return np.array([r.arrival_s for r in self.requests], dtype=np.float64)


__all__ = ["MOONCAKE_BLOCK_TOKENS", "Trace", "TraceError", "TraceRequest"]
