"""Command-line flags for engine options shared by every command that runs the engine
(``kvpage generate``/``replay`` in :mod:`kvpage.apps.engine_cli` and ``kvpage serve`` in
:mod:`kvpage.server.cli`), so each option has one spelling everywhere."""

from __future__ import annotations

import argparse
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


#: the KV tier / preemption flags: flag -> (EngineConfig field, help)
TIER_FLAGS: dict[str, tuple[str, str]] = {
    "--kv-host-tier-bytes": (
        "kv_host_tier_bytes",
        "host-memory KV tier capacity in bytes: evicted prefix blocks are kept there and "
        "promoted back on a hit (default 0: none)",
    ),
    "--kv-disk-tier-bytes": (
        "kv_disk_tier_bytes",
        "local-disk KV tier capacity in bytes (needs --kv-disk-tier-path; default 0: none)",
    ),
    "--kv-disk-tier-path": (
        "kv_disk_tier_path",
        "directory of the disk KV tier (survives restarts; one subdirectory per "
        "model/cache-layout fingerprint)",
    ),
    "--preemption-mode": (
        "preemption_mode",
        "recompute (default) or swap: copy a preempted sequence's KV to host memory and "
        "back when the cost model says it is cheaper",
    ),
    "--swap-space-bytes": (
        "swap_space_bytes",
        "host bytes for swapped-out sequences (preemption-mode swap; default 1 GiB)",
    ),
}


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 (bytes), got {text!r}")
    return v


def add_tier_flags(group: Any) -> None:
    """:data:`TIER_FLAGS` with ``default=None`` ("not given": the EngineConfig default,
    or for ``serve`` the config file, decides); ``dest`` is the EngineConfig field."""
    for flag, (dest, help_) in TIER_FLAGS.items():
        if dest == "kv_disk_tier_path":
            group.add_argument(flag, dest=dest, default=None, metavar="DIR", help=help_)
        elif dest == "preemption_mode":
            group.add_argument(
                flag, dest=dest, default=None, choices=["recompute", "swap"], help=help_
            )
        else:
            group.add_argument(flag, dest=dest, type=_nonneg_int, default=None, help=help_)


def tier_kwargs(args: Any) -> dict[str, Any]:
    """The EngineConfig kwargs of the tier flags that were given."""
    out = {}
    for dest, _ in TIER_FLAGS.values():
        v = getattr(args, dest, None)
        if v is not None:
            out[dest] = v
    return out


__all__ = ["TIER_FLAGS", "add_prefix_caching_flags", "add_tier_flags", "tier_kwargs"]
