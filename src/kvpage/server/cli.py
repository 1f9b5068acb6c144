"""``kvpage serve``: the argparse subcommand (imports no server library until it runs).

Precedence: defaults < ``--config FILE`` < explicit flags. ``--dump-config`` prints the
effective configuration as YAML (or JSON with ``--dump-format json``) and exits, so it can
be saved and later restored with ``--config``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import ValidationError

from kvpage.errors import KVPageError, SpecError
from kvpage.server.config import ServerConfig, dump_config, format_validation_error, load_config

__all__ = ["add_serve_parser", "config_from_args", "serve_main"]

# flag -> (section, field, type); section None = top level of ServerConfig.
_FLAGS: dict[str, tuple[str | None, str, Any]] = {
    "host": (None, "host", str),
    "port": (None, "port", int),
    "served_model_name": (None, "served_model_name", str),
    "log_level": (None, "log_level", str),
    "model": ("engine", "model", str),
    "block_size": ("engine", "block_size", int),
    "num_blocks": ("engine", "num_blocks", int),
    "kv_cache_memory_bytes": ("engine", "kv_cache_memory_bytes", int),
    "max_num_seqs": ("engine", "max_num_seqs", int),
    "max_num_batched_tokens": ("engine", "max_num_batched_tokens", int),
    "max_model_len": ("engine", "max_model_len", int),
    "kv_cache_dtype": ("engine", "kv_cache_dtype", str),
    "backend": ("engine", "backend", str),
    "dtype": ("engine", "dtype", str),
    "seed": ("engine", "seed", int),
    "threads": ("engine", "num_threads", int),
    "kv_high_water": ("admission", "kv_high_water", float),
    "long_prompt_tokens": ("admission", "long_prompt_tokens", int),
    "kv_pressure_action": ("admission", "kv_pressure_action", str),
    "queue_timeout_s": ("admission", "queue_timeout_s", float),
    "max_tokens_cap": ("degradation", "max_tokens_cap", int),
}


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on an argparse subparsers object; returns the new parser."""
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (binds 127.0.0.1 by default).",
    )
    p.add_argument("--config", metavar="FILE", help="YAML/JSON ServerConfig (see --dump-config)")
    p.add_argument("--dump-config", action="store_true", help="print the effective config and exit")
    p.add_argument("--dump-format", choices=["yaml", "json"], default="yaml")
    for flag, (_, _, typ) in _FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=typ, default=None)
    pc = p.add_mutually_exclusive_group()
    pc.add_argument(
        "--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None
    )
    pc.add_argument(
        "--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false"
    )
    p.add_argument("--tenant-rate", type=float, default=None, help="default tokens/s per tenant")
    p.add_argument(
        "--tenant-burst", type=float, default=None, help="default bucket size per tenant"
    )
    p.set_defaults(func=serve_main)
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The effective :class:`ServerConfig`: file (if any) overridden by explicit flags.

    Raises:
        SpecError: unreadable/invalid file, invalid flag value, or only one of
            ``--tenant-rate``/``--tenant-burst``.
    """
    cfg = load_config(args.config) if getattr(args, "config", None) else ServerConfig()
    data = cfg.model_dump()
    for flag, (section, name, _) in _FLAGS.items():
        v = getattr(args, flag, None)
        if v is not None:
            (data if section is None else data[section])[name] = v
    if getattr(args, "enable_prefix_caching", None) is not None:
        data["engine"]["enable_prefix_caching"] = args.enable_prefix_caching
    rate, burst = getattr(args, "tenant_rate", None), getattr(args, "tenant_burst", None)
    if (rate is None) != (burst is None):
        raise SpecError(
            f"--tenant-rate/--tenant-burst: expected both or neither, got {rate}, {burst}"
        )
    if rate is not None:
        data["admission"]["default_limit"] = {"rate": rate, "burst": burst}
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"options: {format_validation_error(exc)}") from exc


def serve_main(args: argparse.Namespace) -> int:
    """Run ``kvpage serve`` (or print the config with ``--dump-config``)."""
    try:
        cfg = config_from_args(args)
    except SpecError as exc:
        print(f"kvpage serve: {exc}", file=sys.stderr)
        return 2
    if args.dump_config:
        sys.stdout.write(dump_config(cfg, args.dump_format))
        return 0
    import logging

    from kvpage.server.runner import run_server

    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        run_server(cfg)
    except KVPageError as exc:  # e.g. unknown --backend, model or KV layout: no traceback
        print(f"kvpage serve: {exc}", file=sys.stderr)
        return 2
    return 0
