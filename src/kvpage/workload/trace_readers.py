"""Readers of the trace file formats into one :class:`~kvpage.workload.trace_types.Trace`.

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
"""

from __future__ import annotations

import csv
import json
import math
from datetime import datetime
from pathlib import Path

from kvpage.workload.trace_types import (
    MOONCAKE_BLOCK_TOKENS,
    Trace,
    TraceError,
    TraceRequest,
)


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


__all__ = ["MAX_TRACE_SPAN_S", "load_azure_csv", "load_mooncake_jsonl"]
