"""Request traces: load real serving traces into one record type, and give them tokens.

Formats (see ``src/kvpage/data/traces/ATTRIBUTION.md`` for sources and licenses):

* **Azure LLM inference 2023** (Splitwise, CC-BY 4.0): CSV with header
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is
  ``YYYY-MM-DD HH:MM:SS.fffffff`` (7 fractional digits, no zone). Arrival times are
  made relative to the earliest row. No prompt contents, so no prefix sharing.
* **Mooncake FAST'25** (JSON lines): ``timestamp`` (ms since trace start),
  ``input_length``, ``output_length`` (tokens) and ``hash_ids`` — one id per
  512-token block of the prompt (``len(hash_ids) == ceil(input_length / 512)``). Two
  requests with the same id at the same position share that block and every block
  before it.

Row order: a file whose timestamps are out of order is accepted and its requests are
sorted by arrival time with a *stable* sort (rows with equal timestamps keep their file
order); ``TraceRequest.index`` stays the 0-based row in the file, so request ids and
token ids do not depend on the sort. ``limit`` keeps the first ``limit`` rows of the file
(before sorting). A trace with no requests (e.g. a header-only CSV) is refused with a
``TraceError`` ("no requests"), since every consumer (plan, profile, simulate, replay)
would otherwise report all-zero statistics.

Token ids (:func:`prompt_token_ids`) — the documented mapping from hash ids to tokens:

* Hash block ``h`` (512 tokens) becomes the fixed run
  ``numpy.random.default_rng([seed, 0, h]).integers(0, vocab_size, 512)``. It depends
  only on ``(h, seed, vocab_size)``, so requests sharing a leading run of hash ids share
  exactly the same leading tokens, in any process.
* The last hash block of a prompt is usually partial: it contributes the first
  ``input_length - 512 * (len(hash_ids) - 1)`` tokens of its run, so a shorter
  request's tail is a prefix of a longer request's block with the same id.
* At a simulated block size ``B`` that divides 512 (1, 2, 4, ..., 256, 512) each hash
  block is ``512 / B`` simulated blocks; a prefix hit of ``k`` hash blocks is a hit of
  ``k * 512 / B`` simulated blocks, and inside a shared partial last block the sub-blocks
  that are full also hit (finer than the trace's own granularity, never coarser). When
  ``B`` does not divide 512 a simulated block may straddle two hash blocks and hits only
  if both are shared — the cache then hits fewer tokens than the trace would allow.
* Requests without hash ids (Azure) get a run unique to the request:
  ``default_rng([seed, 1, index])``. Generated (output) tokens use
  ``default_rng([seed, 2, index])``; output tokens are never shared between requests.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path

import numpy as np

from kvpage.errors import KVPageError

#: tokens per Mooncake hash block (FAST'25 release README)
MOONCAKE_BLOCK_TOKENS = 512

#: short names of the bundled traces -> file names in ``kvpage/data/traces``
BUNDLED_TRACES: dict[str, str] = {
    "azure-conv": "azure_llm_conv_2023.csv",
    "azure-code": "azure_llm_code_2023.csv",
    "mooncake-conv": "mooncake_conversation_trace.jsonl",
}


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


def bundled_trace_path(name: str) -> Path:
    """Path of a bundled trace by short name (see :data:`BUNDLED_TRACES`).

    Raises:
        TraceError: unknown name.
    """
    if name not in BUNDLED_TRACES:
        raise TraceError(f"trace: expected one of {sorted(BUNDLED_TRACES)}, got {name!r}")
    return Path(str(resources.files("kvpage") / "data" / "traces" / BUNDLED_TRACES[name]))


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TraceError(f"limit: expected None (all rows) or an int >= 1, got {limit!r}")


#: longest trace span accepted, in seconds (366 days). Public traces span an hour to a
#: week; a replay waits real time between arrivals, so a span of centuries (a timestamp
#: typo such as 1e300 ms) would hang it instead of failing.
MAX_TRACE_SPAN_S = 366 * 86400.0


def _finish(name: str, path: str, fmt: str, reqs: list[TraceRequest], *, relative: bool) -> Trace:
    """Refuse an empty trace or one spanning more than :data:`MAX_TRACE_SPAN_S`; sort by
    arrival (stable); with ``relative`` make times relative to the earliest request."""
    if not reqs:
        raise TraceError(f"{Path(path).name}: expected at least 1 request, got no requests")
    reqs.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    t0 = reqs[0].arrival_s
    last = reqs[-1]
    if last.arrival_s - (t0 if relative else 0.0) > MAX_TRACE_SPAN_S:
        raise TraceError(
            f"{Path(path).name}: request {last.index}: arrival: expected at most "
            f"{MAX_TRACE_SPAN_S:,.0f} s (366 days) after the trace start, got {last.arrival_s:g} s"
        )
    if relative:
        reqs = [
            TraceRequest(
                r.index, round(r.arrival_s - t0, 7), r.prompt_tokens, r.output_tokens, r.hash_ids
            )
            for r in reqs
        ]
    return Trace(name, path, fmt, reqs)


def _row_error(file: str, line: int, field: str, want: str, got: object) -> TraceError:
    """``"<file> line <N>: <field>: expected <want>, got <got>"`` (N 1-based, as an
    editor numbers the lines of the file, header included)."""
    return TraceError(f"{file} line {line}: {field}: expected {want}, got {got}")


def _finite(value: float, file: str, line: int, field: str, text: object) -> float:
    if not math.isfinite(value):
        raise _row_error(file, line, field, "a finite number", text)
    return value


def _parse_azure_time(text: str, file: str, line: int) -> float:
    """Seconds since the epoch (naive, as published) of ``YYYY-MM-DD HH:MM:SS[.f...]``."""
    head, _, frac = text.strip().partition(".")
    try:
        base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
        if frac and not frac.isdigit():
            raise ValueError(frac)
        f = float("0." + frac) if frac else 0.0
    except ValueError:
        raise _row_error(
            file, line, "TIMESTAMP", "YYYY-MM-DD HH:MM:SS.fffffff", repr(text)
        ) from None
    return (base - datetime(1970, 1, 1)).total_seconds() + f


def _count(value: object, file: str, line: int, field: str) -> int:
    """A token count: an int >= 0 (a JSON int, or CSV text of one)."""
    v: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        v = value
    elif isinstance(value, str):
        try:
            v = int(value.strip())
        except ValueError:
            v = None
    if v is None or v < 0:
        if isinstance(value, float) and not math.isfinite(value):
            raise _row_error(file, line, field, "a finite number", value)
        raise _row_error(file, line, field, "an int >= 0 (tokens)", repr(value))
    return v


def load_azure_csv(path: str | Path, *, limit: int | None = None, name: str = "") -> Trace:
    """Load an Azure LLM inference 2023 CSV.

    Args:
        path: the CSV file.
        limit: keep only the first ``limit`` rows of the file (None = all; >= 1).
        name: trace name (default the file stem).

    Returns:
        A Trace with ``format="azure"``, requests sorted by arrival (stable), arrival
        times relative to the earliest row.

    Raises:
        TraceError: missing file, wrong header, bad or negative values, no rows; the
            message names the file, the 1-based line (header = line 1) and the field.
    """
    _check_limit(limit)
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"path: expected an existing file, got {str(p)!r}")
    reqs: list[TraceRequest] = []
    with p.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header] != want:
            raise TraceError(f"{p.name} line 1: header: expected {want}, got {header}")
        for i, row in enumerate(reader):
            if limit is not None and i >= limit:
                break
            line = reader.line_num  # physical line where this row ends (1-based)
            if len(row) != 3:
                raise _row_error(p.name, line, "row", "3 columns", len(row))
            t = _parse_azure_time(row[0], p.name, line)
            ctx = _count(row[1], p.name, line, "ContextTokens")
            gen = _count(row[2], p.name, line, "GeneratedTokens")
            reqs.append(TraceRequest(i, t, ctx, gen))
    return _finish(name or p.stem, str(p), "azure", reqs, relative=True)


def _mooncake_record(text: str, file: str, line: int) -> tuple[float, int, int, tuple[int, ...]]:
    """``(timestamp_ms, input_length, output_length, hash_ids)`` of one JSON line."""
    try:
        d = json.loads(text)  # accepts NaN / Infinity: checked below
    except ValueError as e:
        raise _row_error(file, line, "record", "a JSON object", f"invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise _row_error(file, line, "record", "a JSON object", f"a JSON {type(d).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length") if k not in d]
    if missing:
        raise _row_error(
            file,
            line,
            "record",
            "keys timestamp, input_length, output_length",
            f"a record without {', '.join(missing)}",
        )
    ts = d["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise _row_error(file, line, "timestamp", "a number (ms)", repr(ts))
    try:
        _finite(float(ts), file, line, "timestamp", ts)
    except OverflowError:  # an int beyond float range
        raise _row_error(file, line, "timestamp", "a finite number", ts) from None
    if ts < 0:
        raise _row_error(file, line, "timestamp", "a number >= 0 (ms)", ts)
    n_in = _count(d["input_length"], file, line, "input_length")
    n_out = _count(d["output_length"], file, line, "output_length")
    raw = d.get("hash_ids", [])
    if not isinstance(raw, list):
        raise _row_error(file, line, "hash_ids", "a list of ints >= 0", repr(raw)[:80])
    hids = tuple(_count(h, file, line, "hash_ids") for h in raw)
    want = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(hids) != want:
        raise _row_error(file, line, "hash_ids", f"{want} ids for {n_in} tokens", len(hids))
    return float(ts), n_in, n_out, hids


def load_mooncake_jsonl(path: str | Path, *, limit: int | None = None, name: str = "") -> Trace:
    """Load a Mooncake FAST'25 JSON-lines trace.

    Args:
        path: the ``.jsonl`` file.
        limit: keep only the first ``limit`` rows of the file (None = all; >= 1).
        name: trace name (default the file stem).

    Returns:
        A Trace with ``format="mooncake"``, requests sorted by arrival (stable);
        ``arrival_s = timestamp / 1000`` (the trace's own origin).

    Raises:
        TraceError: missing file, a row that is not a JSON object, missing keys,
            non-finite (NaN, Infinity), non-integer or negative values,
            ``len(hash_ids) != ceil(input_length / 512)``, or no rows; the message names
            the file, the 1-based line (as an editor shows it) and the field.
    """
    _check_limit(limit)
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"path: expected an existing file, got {str(p)!r}")
    reqs: list[TraceRequest] = []
    with p.open() as f:
        i = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if limit is not None and i >= limit:
                break
            ts, n_in, n_out, hids = _mooncake_record(line, p.name, line_no)
            reqs.append(TraceRequest(i, ts / 1000.0, n_in, n_out, hids))
            i += 1
    return _finish(name or p.stem, str(p), "mooncake", reqs, relative=False)


def load_trace(source: str | Path, *, limit: int | None = None) -> Trace:
    """Load a trace by bundled short name or by path (format from the suffix).

    Args:
        source: ``"azure-conv"``, ``"azure-code"``, ``"mooncake-conv"``, or a path
            ending in ``.csv`` (Azure) or ``.jsonl`` (Mooncake).
        limit: keep only the first ``limit`` rows of the file (None = all; >= 1).

    Raises:
        TraceError: unknown name, unknown suffix, a malformed file, or no requests.
    """
    name = ""
    if isinstance(source, str) and source in BUNDLED_TRACES:
        name = source
        source = bundled_trace_path(source)
    p = Path(source)
    if p.suffix == ".csv":
        return load_azure_csv(p, limit=limit, name=name)
    if p.suffix in (".jsonl", ".json"):
        return load_mooncake_jsonl(p, limit=limit, name=name)
    raise TraceError(
        f"trace: expected one of {sorted(BUNDLED_TRACES)} or a .csv/.jsonl path, got {str(source)!r}"
    )


class TokenMapper:
    """Deterministic token ids for trace requests (see the module docstring).

    Memoizes hash-block runs, so requests that share hash ids reuse one array.

    Args:
        seed: the mapping's seed (any int >= 0).
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        hash_block_tokens: tokens per hash id (512 for Mooncake).
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        vocab_size: int = 32000,
        hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    ) -> None:
        if seed < 0:
            raise TraceError(f"seed: expected >= 0, got {seed}")
        if vocab_size < 2:
            raise TraceError(f"vocab_size: expected >= 2, got {vocab_size}")
        if hash_block_tokens < 1:
            raise TraceError(f"hash_block_tokens: expected >= 1, got {hash_block_tokens}")
        self.seed = seed
        self.vocab_size = vocab_size
        self.hash_block_tokens = hash_block_tokens
        self._runs: dict[int, np.ndarray] = {}

    def hash_block(self, hash_id: int) -> np.ndarray:
        """``[hash_block_tokens]`` int64: the fixed token run of one hash id."""
        run = self._runs.get(hash_id)
        if run is None:
            if hash_id < 0:
                raise TraceError(f"hash_id: expected >= 0, got {hash_id}")
            rng = np.random.default_rng([self.seed, 0, hash_id])
            run = rng.integers(0, self.vocab_size, self.hash_block_tokens, dtype=np.int64)
            self._runs[hash_id] = run
        return run

    def prompt(self, req: TraceRequest) -> list[int]:
        """The request's ``prompt_tokens`` token ids.

        Raises:
            TraceError: the hash ids cannot cover the prompt.
        """
        n = req.prompt_tokens
        if req.hash_ids is None:
            rng = np.random.default_rng([self.seed, 1, req.index])
            return rng.integers(0, self.vocab_size, n, dtype=np.int64).tolist()
        hb = self.hash_block_tokens
        if len(req.hash_ids) * hb < n:
            raise TraceError(
                f"hash_ids (request {req.index}): expected >= {-(-n // hb)} ids for {n} tokens, "
                f"got {len(req.hash_ids)}"
            )
        parts = [self.hash_block(h) for h in req.hash_ids[: -(-n // hb)]]
        if not parts:
            return []
        return np.concatenate(parts)[:n].tolist()

    def output(self, req: TraceRequest) -> list[int]:
        """The request's ``output_tokens`` generated token ids (unique per request)."""
        rng = np.random.default_rng([self.seed, 2, req.index])
        return rng.integers(0, self.vocab_size, req.output_tokens, dtype=np.int64).tolist()


def prompt_token_ids(req: TraceRequest, *, seed: int = 0, vocab_size: int = 32000) -> list[int]:
    """Token ids of one request's prompt (a one-off :class:`TokenMapper`)."""
    return TokenMapper(seed=seed, vocab_size=vocab_size).prompt(req)


def sim_blocks_per_hash_block(block_size: int) -> float:
    """Simulated blocks per 512-token hash block (``512 / block_size``; fractional
    when ``block_size`` does not divide 512 — see the module docstring)."""
    if block_size < 1:
        raise TraceError(f"block_size: expected >= 1, got {block_size}")
    return MOONCAKE_BLOCK_TOKENS / block_size


__all__ = [
    "BUNDLED_TRACES",
    "MOONCAKE_BLOCK_TOKENS",
    "TokenMapper",
    "Trace",
    "TraceError",
    "TraceRequest",
    "bundled_trace_path",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "load_trace",
    "prompt_token_ids",
    "sim_blocks_per_hash_block",
]
