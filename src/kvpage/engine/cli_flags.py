"""Command-line flags for engine options shared by every command that runs the engine
(``kvpage generate``/``replay`` in :mod:`kvpage.apps.engine_cli` and ``kvpage serve`` in
:mod:`kvpage.server.cli`), so each option has one spelling everywhere."""

from __future__ import annotations

from typing import Any


def add_prefix_caching_flags(group: Any, default: bool | None = True) -> None:
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (vLLM's spelling,
    the one every kvpage command uses), with ``--no-prefix-caching`` kept as an alias of
    the latter; ``dest="enable_prefix_caching"``. ``default`` None = "not given" (serve:
    the config file decides)."""
    pc = group.add_mutually_exclusive_group()
    pc.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=default,
        help="reuse cached blocks of a shared prompt prefix (default: on)",
    )
    pc.add_argument(
        "--no-enable-prefix-caching",
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn prefix caching off (--no-prefix-caching is an alias)",
    )


__all__ = ["add_prefix_caching_flags"]
