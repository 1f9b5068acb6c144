"""Argument helpers shared by the ``plan``, ``profile`` and ``simulate`` subcommands.

Limit semantics (the same as ``kvpage replay --num-requests``): ``--limit N`` keeps the
first ``N`` rows of the trace file, ``--limit 0`` (or no ``--limit`` where the default is
"all") keeps every request, a negative value is refused.

Output paths are checked before any work starts (``kvpage plan/profile/simulate`` and
``kvpage replay --output`` share :func:`prepare_output`): a path naming an existing
directory is refused, missing parent directories are created, and a location where a
file cannot actually be created (read-only, ``/proc``, a parent that is a file) is
refused — by creating and removing a probe file, since ``os.access`` answers "yes" to
root on a read-only or virtual file system.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import argparse

from kvpage.cache.explain import miss_table_rows
from kvpage.errors import KVPageError

#: what ``ArgumentParser.add_subparsers()`` returns; each ``add_*_parser`` adds one
#: subcommand to it (a string: ``_SubParsersAction`` is not subscriptable at runtime)
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def trace_limit(value: int | None, flag: str = "--limit") -> int | None:
    """The ``limit`` for ``load_trace`` from a CLI value: None or 0 -> None (all rows).

    Raises:
        KVPageError: ``value < 0``.
    """
    if value is None or value == 0:
        return None
    if value < 0:
        raise KVPageError(f"{flag}: expected an int >= 1, or 0 for all requests, got {value}")
    return value


def prepare_output(path: str, flag: str) -> Path:
    """Check an output file path up front and create its parent directories.

    Args:
        path: the file to be written later.
        flag: the option name, for messages (e.g. ``"--json"``).

    Returns:
        ``Path(path)``.

    Raises:
        KVPageError: the path is a directory, its parent cannot be created, or no file
            can be written there.
    """
    p = Path(path)
    if p.is_dir():
        raise KVPageError(f"{flag}: expected a file path, got the directory {path!r}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVPageError(
            f"{flag}: expected a path whose folder can be created, got {path!r} ({e.strerror})"
        ) from None
    if not p.parent.is_dir():
        raise KVPageError(f"{flag}: expected a path inside a folder, got {path!r}")
    if p.exists() and not os.access(p, os.W_OK):
        raise KVPageError(f"{flag}: expected a writable path, got {path!r}")
    try:  # can a file be created there? (root passes os.access on a read-only mount)
        with tempfile.NamedTemporaryFile(dir=p.parent, prefix=".kvpage-probe-"):
            pass
    except OSError as e:
        raise KVPageError(
            f"{flag}: expected a writable path, got {path!r} ({e.strerror or e})"
        ) from None
    return p


def write_output(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: into a temporary file in the same folder,
    flushed to disk, then renamed over ``path`` (POSIX ``rename``), so a failure (a full
    disk, the folder gone) leaves an existing file whole and never a half-written one.

    Raises:
        OSError: the write, the flush or the rename failed (the temporary file is
            removed).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def parse_int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """``"1,8,16"`` -> ``[1, 8, 16]``.

    Raises:
        KVPageError: an item is not an int >= ``minimum`` or the list is empty.
    """
    out: list[int] = []
    for item in text.split(","):
        word = item.strip()
        try:
            v: int | None = int(word)
        except ValueError:
            v = None
        if v is None or v < minimum:
            raise KVPageError(
                f"{flag}: expected a comma list of ints >= {minimum}, got {word!r} in {text!r}"
            )
        out.append(v)
    return out


def miss_markdown(rows: list[tuple[list[str], dict[str, Any]]], keys: list[str]) -> str:
    """A markdown table of cache-miss reasons (``kvpage.cache.explain.aggregate_misses``)
    for ``kvpage replay`` and ``kvpage simulate``: one line per (row, reason), the row's
    ``keys`` cells first (e.g. policy and block size), then requests, prompt tokens
    computed, their share, and what the reason suggests to an operator."""
    head = [*keys, "miss reason", "requests", "missed tokens", "share", "suggests"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cells, agg in rows:
        for r in miss_table_rows(agg):
            lines.append("| " + " | ".join([*cells, *r]) + " |")
    return "\n".join(lines)


__all__ = ["miss_markdown", "parse_int_list", "prepare_output", "trace_limit", "write_output"]
