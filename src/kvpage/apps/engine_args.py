"""The engine options shared by ``kvpage generate`` and ``kvpage replay``: argparse
option types that name the accepted range, the ``engine`` argument group, and building
the ``LLMEngine`` from the parsed options.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvpage.engine.cli_flags import add_engine_flags, engine_kwargs

INT64_MAX = 2**63 - 1


# ---- option types: argparse prints "argument --x: expected X, got Y" and exits 2 -------
def _int_type(lo: int, hi: int = INT64_MAX, extra: str = "") -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            rng = f"an int >= {lo}" if hi == INT64_MAX else f"an int in [{lo}, {hi}]"
            if v is not None and v > hi:  # name the bound that was crossed
                top = "2**63 - 1" if hi == INT64_MAX else f"{hi}"
                rng = f"an int in [{lo}, {top}] (upper bound {hi})"
            raise argparse.ArgumentTypeError(f"expected {rng}{extra}, got {text!r}")
        return v

    parse.__name__ = "int"
    return parse


def _top_k(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not -1 <= v <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected -1 or 0 (off) or an int >= 1, got {text!r}")
    return v


def _float_type(lo: float, *, lo_open: bool, hi: float | None = None) -> Any:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
            if hi is not None:
                rng = f"in ({lo:g}, {hi:g}]" if lo_open else f"in [{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a finite number {rng}, got {text!r}")
        return v

    parse.__name__ = "float"
    return parse


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The ``engine`` argument group: one checked flag per EngineConfig field
    (:func:`kvpage.engine.cli_flags.add_engine_flags`)."""
    add_engine_flags(p.add_argument_group("engine"), checked=True)


def _engine(args: argparse.Namespace) -> Any:
    from kvpage.engine import LLMEngine

    return LLMEngine.from_config(**engine_kwargs(args))
