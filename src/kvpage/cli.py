"""The ``kvpage`` command line (also ``python -m kvpage.cli`` and ``python -m kvpage``).

Subcommands are registered from :data:`SUBCOMMANDS`: each entry names a function
``add_<name>_parser(subparsers) -> argparse.ArgumentParser`` that adds one subcommand
and sets ``func`` (``func(args) -> int`` exit code) as its default. Entries are imported
lazily, so ``kvpage --help`` works when an optional part (e.g. the server's fastapi) is
missing: such a subcommand is listed and explains what to install. To add one, append
a ``"module:function"`` line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

#: "module:function" of every subcommand registrar, in help order
SUBCOMMANDS: list[str] = [
    "kvpage.apps.engine_cli:add_generate_parser",
    "kvpage.apps.engine_cli:add_replay_parser",
    "kvpage.cluster.cli:add_serve_parser",
    "kvpage.apps.sim_cli:add_plan_parser",
    "kvpage.apps.sim_cli:add_profile_parser",
    "kvpage.apps.simulate_cli:add_simulate_parser",
]


def _unavailable(subparsers: Any, target: str, error: Exception) -> None:
    name = target.rsplit(":", 1)[1].removeprefix("add_").removesuffix("_parser")
    p = subparsers.add_parser(name, help=f"(unavailable: {error})")

    def run(args: argparse.Namespace) -> int:
        print(f"kvpage {name}: unavailable here: {error}", file=sys.stderr)
        return 2

    p.set_defaults(func=run)


class _NoAbbrevParser(argparse.ArgumentParser):
    """A sub-command parser that refuses abbreviated long options."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    from kvpage import __version__

    parser = argparse.ArgumentParser(
        prog="kvpage",
        description="Paged KV-cache LLM inference: generate, replay traces, serve, plan.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"kvpage {__version__}")
    # allow_abbrev=False everywhere: an abbreviated option ("--max-num" for "--max-num-seqs")
    # is refused by name instead of silently meaning whichever option it prefixes today
    sub = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        parser_class=_NoAbbrevParser,
    )
    for target in SUBCOMMANDS:
        module, func = target.split(":")
        try:
            registrar = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as e:
            if isinstance(e, ModuleNotFoundError) and e.name and module.startswith(e.name):
                continue  # that part of kvpage is not in this build at all
            _unavailable(sub, target, e)
            continue
        registrar(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvpage`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM where a command turns it into one
        code = int(getattr(e, "exit_code", 130))  # 130 = 128 + SIGINT, 143 = 128 + SIGTERM
        how = "terminated (SIGTERM)" if code == 143 else "interrupted"
        print(f"kvpage {args.command}: {how}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
