"""``kvpage serve``: the argparse subcommand (imports no server library until it runs).

Precedence: defaults < ``--config FILE`` < explicit flags. ``--dump-config`` checks the
effective configuration as the engine would at start-up (without loading the model) and
prints it as YAML (or JSON with ``--dump-format json``) and exits, so it can be saved and
later restored with ``--config``; an invalid one is refused (exit 2) instead of written.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpage.engine.cli_flags import add_engine_flags, engine_kwargs
from kvpage.errors import KVPageError, SpecError
from kvpage.server.config import ServerConfig, dump_config, format_validation_error, load_config

__all__ = ["add_serve_parser", "check_engine_config", "config_from_args", "serve_main"]

# flag -> (section, field, type) of the non-engine flags; section None = top level of
# ServerConfig. The engine section's flags are generated from EngineConfig's fields
# (kvpage.engine.cli_flags: one per field, dest = the field name).
_FLAGS: dict[str, tuple[str | None, str, type[str] | type[int] | type[float]]] = {
    "host": (None, "host", str),
    "port": (None, "port", int),
    "served_model_name": (None, "served_model_name", str),
    "log_level": (None, "log_level", str),
    "engine_niceness": (None, "engine_niceness", int),
    "chat_template": (None, "chat_template", str),
    "kv_retention_max_priority": ("admission", "kv_retention_max_priority", int),
    "kv_retention_max_ttl_s": ("admission", "kv_retention_max_ttl_s", float),
    "kv_high_water": ("admission", "kv_high_water", float),
    "long_prompt_tokens": ("admission", "long_prompt_tokens", int),
    "kv_pressure_action": ("admission", "kv_pressure_action", str),
    "queue_timeout_s": ("admission", "queue_timeout_s", float),
    "max_prompts_per_request": ("admission", "max_prompts_per_request", int),
    "max_sequences_per_request": ("admission", "max_sequences_per_request", int),
    "max_inflight_sequences_per_tenant": ("admission", "max_inflight_sequences_per_tenant", int),
    "max_tokens_cap": ("degradation", "max_tokens_cap", int),
    "api_keys_file": ("security", "api_keys_file", str),
    "prefix_cache_scope": ("security", "prefix_cache_scope", str),
    "metrics_host": ("security", "metrics_host", str),
    "metrics_port": ("security", "metrics_port", int),
    "max_body_bytes": ("security", "max_body_bytes", int),
    "body_timeout_s": ("security", "body_timeout_s", float),
    "send_timeout_s": ("security", "send_timeout_s", float),
    "max_unauthenticated_tenants": ("security", "max_unauthenticated_tenants", int),
}

#: environment variable holding one more API key (keeps it out of the process list)
API_KEY_ENV = "KVPAGE_API_KEY"


def _flag_help(section: str | None, field: str) -> str:
    """``--help`` text of a config flag, from its ServerConfig field: where it lives in a
    ``--config`` file, its default and, for a fixed set, the choices (the field's
    validation, not argparse's, still decides what is accepted)."""
    model = ServerConfig if section is None else ServerConfig.model_fields[section].annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"ServerConfig.{section}: expected a config section model, got {model}")
    info = model.model_fields[field]
    where = field if section is None else f"{section}.{field}"
    text = f"config {where}; default {info.default!r}"
    if typing.get_origin(info.annotation) is typing.Literal:
        text += "; one of " + ", ".join(str(a) for a in typing.get_args(info.annotation))
    return text.replace("%", "%%")


def add_serve_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``serve`` on an argparse subparsers object; returns the new parser."""
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (binds 127.0.0.1 by "
        "default). Each config flag sets the ServerConfig field it names (a flag wins over "
        "--config); docs/serving.md, 'The rollback-friendly config file', lists every field.",
    )
    p.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="model to serve (as vLLM's `vllm serve MODEL`; same as --model)",
    )
    _add_config_file_flags(p)
    for flag, (section, field, typ) in _FLAGS.items():
        p.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            type=typ,
            default=None,
            help=_flag_help(section, field),
        )
    add_engine_flags(p, checked=False, where="engine")  # the spelling generate/replay use too
    _add_feature_flags(p)
    _add_security_flags(p)
    p.set_defaults(func=serve_main)
    return p


def _add_config_file_flags(p: argparse.ArgumentParser) -> None:
    """``--config`` and the ``--dump-config`` family."""
    p.add_argument("--config", metavar="FILE", help="YAML/JSON ServerConfig (see --dump-config)")
    p.add_argument("--dump-config", action="store_true", help="print the effective config and exit")
    p.add_argument("--dump-format", choices=["yaml", "json"], default="yaml")
    p.add_argument(
        "--resolved",
        action="store_true",
        help="with --dump-config: build the engine as start-up would (loads the model) and "
        "write the values it decided (num_blocks, backend, max_model_len, num_threads) and "
        "the machine they were decided on, so a restore starts identically",
    )


def _add_feature_flags(p: argparse.ArgumentParser) -> None:
    """Request-handling features: unknown fields, tool calls, the engine process."""
    p.add_argument(
        "--allow-unknown-fields",
        dest="allow_unknown_fields",
        action="store_true",
        default=None,
        help="ignore request fields outside the OpenAI/vLLM schemas (default: refuse, 400)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        dest="enable_auto_tool_choice",
        action="store_true",
        default=None,
        help="chat tool_choice 'auto' parses tool calls from the reply (needs --tool-call-parser)",
    )
    p.add_argument(
        "--tool-call-parser",
        dest="tool_call_parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="how tool calls are found in a reply (vLLM's names)",
    )
    ep = p.add_mutually_exclusive_group()
    ep.add_argument(
        "--engine-process",
        dest="engine_process",
        action="store_true",
        default=None,
        help="run the engine in its own process, apart from the HTTP server's GIL",
    )
    ep.add_argument(
        "--no-engine-process",
        dest="engine_process",
        action="store_false",
        help="run the engine as a thread of the server process (default)",
    )


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    """Tenants, API keys and CORS."""
    p.add_argument("--tenant-rate", type=float, default=None, help="default tokens/s per tenant")
    p.add_argument(
        "--tenant-burst", type=float, default=None, help="default bucket size per tenant"
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="KEY",
        help=f"require this Bearer key (repeatable; each key is a tenant). Other local users "
        f"can read command lines: prefer --api-keys-file or ${API_KEY_ENV}",
    )
    p.add_argument(
        "--metrics-api-key",
        dest="metrics_api_keys",
        action="append",
        default=None,
        metavar="KEY",
        help="an operator key that may read /metrics (repeatable)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        dest="allow_unauthenticated",
        action="store_true",
        default=None,
        help="allow serving a non-loopback address without API keys",
    )
    p.add_argument(
        "--allowed-origins",
        dest="allowed_origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="send CORS headers for this origin (repeatable; default: no CORS)",
    )


def config_from_args(args: argparse.Namespace, base: ServerConfig | None = None) -> ServerConfig:
    """The effective :class:`ServerConfig`: file (if any) overridden by explicit flags.

    Args:
        args: the parsed ``kvpage serve`` arguments.
        base: the configuration the flags override when no ``--config`` is given
            (default ``ServerConfig()``; a deployment file passes its ``server``).

    Raises:
        SpecError: unreadable/invalid file, invalid flag value, or only one of
            ``--tenant-rate``/``--tenant-burst``.
    """
    if getattr(args, "config", None):
        cfg = load_config(args.config)
    else:
        cfg = base if base is not None else ServerConfig()
    data = cfg.model_dump()
    _take_positional_model(args)
    _apply_serving_flags(args, data)
    _apply_security_flags(args, cfg, data["security"])
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"options: {format_validation_error(exc)}") from exc


def _take_positional_model(args: argparse.Namespace) -> None:
    """Set ``args.model`` from the positional ``MODEL``, if given.

    Raises:
        SpecError: ``MODEL`` and ``--model`` name different models.
    """
    pos = getattr(args, "model_positional", None)
    if pos is None:
        return
    if getattr(args, "model", None) not in (None, pos):
        raise SpecError(
            f"MODEL: expected the same model as --model ({args.model!r}) or only one of "
            f"them, got {pos!r}"
        )
    args.model = pos


def _apply_serving_flags(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Write the explicit server, engine and admission flags into ``data`` (a
    ``ServerConfig.model_dump()``).

    Raises:
        SpecError: only one of ``--tenant-rate``/``--tenant-burst``.
    """
    if getattr(args, "allow_unknown_fields", None):
        data["allow_unknown_fields"] = True
    if getattr(args, "enable_auto_tool_choice", None):
        data["enable_auto_tool_choice"] = True
    if getattr(args, "tool_call_parser", None) is not None:
        data["tool_call_parser"] = args.tool_call_parser
    for flag, (section, name, _) in _FLAGS.items():
        v = getattr(args, flag, None)
        if v is not None:
            (data if section is None else data[section])[name] = v
    if getattr(args, "engine_process", None) is not None:
        data["engine_process"] = args.engine_process
    data["engine"].update(engine_kwargs(args))
    rate, burst = getattr(args, "tenant_rate", None), getattr(args, "tenant_burst", None)
    if (rate is None) != (burst is None):
        raise SpecError(
            f"--tenant-rate/--tenant-burst: expected both or neither, got {rate}, {burst}"
        )
    if rate is not None:
        data["admission"]["default_limit"] = {"rate": rate, "burst": burst}


def _apply_security_flags(args: argparse.Namespace, cfg: ServerConfig, sec: dict[str, Any]) -> None:
    """Write the security flags into ``sec`` (the dump's ``security`` section): keys
    from the file, the flags and ``$KVPAGE_API_KEY`` are added up."""
    # keys are excluded from dumps, so take them from the loaded config directly
    sec["api_keys"] = list(cfg.security.api_keys) + list(getattr(args, "api_keys", None) or [])
    env_key = os.environ.get(API_KEY_ENV)
    if env_key:
        sec["api_keys"].append(env_key)
    sec["metrics_api_keys"] = list(cfg.security.metrics_api_keys) + list(
        getattr(args, "metrics_api_keys", None) or []
    )
    if getattr(args, "allow_unauthenticated", None):
        sec["allow_unauthenticated"] = True
    if getattr(args, "allowed_origins", None):
        sec["allowed_origins"] = list(args.allowed_origins)


def check_engine_config(cfg: ServerConfig) -> None:
    """What the engine checks at build time beyond the config's own rules, without loading
    the model: the ``device`` exists here, ``backend`` is a registered name and
    ``chat_template`` is a readable, valid template.

    Raises:
        SpecError: the first invalid engine field, named.
    """
    from kvpage.backends import available_backends
    from kvpage.engine.chat import load_chat_template
    from kvpage.engine.config import check_device

    check_device(cfg.engine.device)
    load_chat_template(cfg.chat_template)
    names = available_backends()
    if cfg.engine.backend != "auto" and cfg.engine.backend not in names:
        raise SpecError(
            f"engine.backend: expected 'auto' or one of {names}, got {cfg.engine.backend!r}"
        )


def model_max_position(model: str) -> int | None:
    """The model's ``max_position_embeddings`` read from its header or ``config.json``
    alone (no weights loaded); None when the model is not a file this can read.

    Raises:
        SpecError: an unreadable or invalid header / config file.
    """
    from pathlib import Path

    from kvpage.models.llama2c import BUNDLED_MODEL, bundled_model_path
    from kvpage.specs.hf import llama2c_header_to_hf, read_hf_config_file

    path = bundled_model_path() if model == BUNDLED_MODEL else Path(model).expanduser()
    if path.is_file() and path.suffix == ".bin":
        cfg = llama2c_header_to_hf(path)
    elif (path / "config.json").is_file():
        cfg = read_hf_config_file(path / "config.json", str(path / "config.json"))
    else:
        return None
    mpe = cfg.get("max_position_embeddings")
    return int(mpe) if mpe else None


def check_startup_config(cfg: ServerConfig) -> None:
    """The start-up checks that need no model load, for ``--dump-config`` (a dumped
    config must start): the engine's argument checks (:func:`check_engine_config`),
    ``max_model_len`` against the model's context (read from its header/config only),
    the bind rule (:func:`kvpage.server.security.check_bind`) and the API keys
    (keys file, key characters). The listener ports are checked by the config itself.

    Raises:
        SpecError: the first failing check, named.
    """
    from kvpage.server.auth import Authenticator
    from kvpage.server.security import check_bind

    check_engine_config(cfg)
    mml = cfg.engine.max_model_len
    if mml is not None:
        mpe = model_max_position(cfg.engine.model)
        if mpe is not None and mml > mpe:
            raise SpecError(
                f"max_model_len: expected <= {mpe} (the model's max_position_embeddings), got {mml}"
            )
    check_bind(cfg, cfg.security.auth_enabled, log=False)
    Authenticator(cfg.security)


def resolve_startup_config(cfg: ServerConfig) -> ServerConfig:
    """``cfg`` with what start-up decides pinned (``kvpage.server.resolved``): builds
    the engine in this process as ``kvpage serve`` would, reads its decisions, frees it.

    Raises:
        SpecError: the engine cannot be built from ``cfg`` (named by the engine).
    """
    from kvpage.engine import LLMEngine
    from kvpage.server.resolved import resolve_server

    engine = LLMEngine.from_config(**cfg.engine.engine_kwargs())
    try:
        return resolve_server(cfg, engine)
    finally:
        del engine


def serve_main(args: argparse.Namespace) -> int:
    """Run ``kvpage serve`` (or print the config with ``--dump-config``)."""
    try:
        cfg = config_from_args(args)
    except SpecError as exc:
        print(f"kvpage serve: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "resolved", False) and not args.dump_config:
        print("kvpage serve: --resolved: expected with --dump-config, got without", file=sys.stderr)
        return 2
    if args.dump_config:
        try:  # a dumped config must start: run the start-up checks before writing it
            check_startup_config(cfg)
            if args.resolved:
                cfg = resolve_startup_config(cfg)
        except KVPageError as exc:
            print(f"kvpage serve: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(dump_config(cfg, args.dump_format))
        if cfg.security.api_keys or cfg.security.metrics_api_keys:
            print(  # secrets are never written; a restored config must get them again
                "kvpage serve: note: --api-key/--metrics-api-key values are not written to "
                "the dumped config; pass them again (or KVPAGE_API_KEY / --api-keys-file) "
                "when starting from it",
                file=sys.stderr,
            )
        return 0
    import logging

    try:
        from kvpage.server.runner import run_server
    except ImportError as exc:  # e.g. the core venv of scripts/run.sh: no server packages
        print(
            "kvpage serve: needs the server packages (FastAPI, uvicorn, prometheus-client, "
            "xgrammar): `bash scripts/bootstrap.sh` installs everything, or "
            f"pip install 'kvpage[server]'; got {exc}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        run_server(cfg)
    except KVPageError as exc:  # e.g. unknown --backend, model or KV layout: no traceback
        print(f"kvpage serve: {exc}", file=sys.stderr)
        return 2
    return 0
