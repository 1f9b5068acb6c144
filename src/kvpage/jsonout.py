"""Strict JSON output: every JSON document kvpage writes goes through :func:`dumps`.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` for non-finite floats,
which is not JSON (RFC 8259) and which strict parsers (``jq``, JavaScript's
``JSON.parse``, Go, Rust's serde_json) reject. A statistic that has no value — the p50
TTFT of a run in which no request finished, for instance — is written as ``null``
instead, and ``allow_nan=False`` makes any leftover a loud error rather than bad output.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps", "json_safe"]


def json_safe(obj: Any) -> Any:
    """A copy of ``obj`` with every non-finite float replaced by ``None`` (recursively
    through dicts, lists and tuples; numpy scalars are converted with ``.item()``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    item = getattr(obj, "item", None)  # numpy scalar
    if callable(item) and getattr(obj, "shape", None) == ():
        return json_safe(item())
    return obj


def dumps(obj: Any, *, indent: int | None = 2, sort_keys: bool = False) -> str:
    """``json.dumps`` of :func:`json_safe` ``(obj)`` with ``allow_nan=False``.

    Raises:
        TypeError: an object JSON cannot represent.
    """
    return json.dumps(json_safe(obj), indent=indent, sort_keys=sort_keys, allow_nan=False)
