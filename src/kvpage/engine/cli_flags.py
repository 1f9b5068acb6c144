"""Command-line flags generated from :class:`~kvpage.specs.engine_config.EngineConfig`:
one flag per field, for every command that runs the engine (``kvpage generate``/
``replay`` in :mod:`kvpage.apps.engine_args`, ``kvpage serve`` in
:mod:`kvpage.server.cli`), so each option has one spelling, one help text (the field's
``description``) and one rule everywhere. A new engine field gets its flag for free.

Every flag's default is None ("not given"): the config's default (or for ``serve`` the
config file) decides; ``dest`` is the field name.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from typing import Any

from kvpage.errors import SpecError
from kvpage.specs.engine_config import EngineConfig, check_engine_field

#: fields whose flag is not ``--`` + the field name with dashes
FLAG_NAMES: dict[str, str] = {"num_threads": "--threads"}
#: bool fields: ``--<field>`` / ``--no-<field>``, plus these aliases of the negative
NEGATIVE_ALIASES: dict[str, tuple[str, ...]] = {"enable_prefix_caching": ("--no-prefix-caching",)}


def engine_flag(field: str) -> str:
    """The flag of EngineConfig field ``field`` (``num_threads`` -> ``--threads``)."""
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def _base_type(annotation: Any) -> tuple[type, tuple[str, ...]]:
    """``(int | float | str, choices)`` of a field annotation (``int | None`` -> int;
    a Literal -> str and its values; ``Any`` -> str)."""
    if typing.get_origin(annotation) is typing.Literal:
        return str, tuple(str(a) for a in typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = args[0]
    return (base if base in (int, float, bool) else str), ()


def _checked(field: str, base: type) -> Callable[[str], Any]:
    """An argparse ``type`` that converts to ``base`` and applies the field's rule:
    argparse then prints ``argument --x: expected <rule>, got '<text>'`` and exits 2."""

    def parse(text: str) -> Any:
        try:
            value: Any = base(text)
        except ValueError:
            value = text  # the rule names what was expected
        try:
            return check_engine_field(field, value)
        except SpecError as e:
            want = str(e).split(": expected ", 1)[1].rsplit(", got ", 1)[0]
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None

    parse.__name__ = base.__name__
    return parse


def _help(field: str, where: str | None) -> str:
    info = EngineConfig.model_fields[field]
    desc = info.description or ""
    choices = _base_type(info.annotation)[1]
    if choices:
        desc += "; one of " + ", ".join(choices)
    if where is None:  # None defaults are explained by the description
        text = desc if info.default is None else f"{desc} (default {info.default!r})"
    else:  # serve: where the flag lands in a --config file first
        text = f"config {where}.{field}; default {info.default!r}; {desc}"
    return text.replace("%", "%%")


def add_engine_flags(group: Any, *, checked: bool = True, where: str | None = None) -> None:
    """Add one flag per EngineConfig field to ``group`` (an argparse parser or group).

    Args:
        checked: apply each field's rule while parsing (``generate``/``replay``); False
            leaves it to the config's validation (``serve``, whose flags override a
            file and are validated together with it).
        where: the config section the help names (``"engine"`` for serve), None = none.
    """
    for field, info in EngineConfig.model_fields.items():
        flag, hlp = engine_flag(field), _help(field, where)
        base, choices = _base_type(info.annotation)
        if base is bool:
            both = group.add_mutually_exclusive_group()
            both.add_argument(flag, dest=field, action="store_true", default=None, help=hlp)
            neg = "--no-" + flag.removeprefix("--")
            both.add_argument(
                neg,
                *NEGATIVE_ALIASES.get(field, ()),
                dest=field,
                action="store_false",
                help=f"the opposite of {flag}",
            )
            continue
        group.add_argument(
            flag,
            dest=field,
            type=_checked(field, base) if checked else base,
            default=None,
            choices=(choices or None) if checked else None,
            metavar="DIR" if field.endswith("_path") else None,
            help=hlp,
        )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (None = not given)."""
    out = {}
    for field in EngineConfig.model_fields:
        v = getattr(args, field, None)
        if v is not None:
            out[field] = v
    return out


__all__ = ["FLAG_NAMES", "NEGATIVE_ALIASES", "add_engine_flags", "engine_flag", "engine_kwargs"]
