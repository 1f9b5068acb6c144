"""The configuration start-up decided: ``auto``/``null`` engine fields pinned to what the
engine resolved them to, and the facts of the machine they were resolved on.

``kvpage serve --dump-config`` writes the configuration as given: ``num_blocks: null``,
``backend: auto``, ``max_model_len: null``, ``num_threads: null`` are decided again at
every start, so the same file can start differently on another machine or kvpage
version (a bigger pool, another backend). ``--dump-config --resolved`` builds the engine
as start-up would and writes, per engine, the decided values (:func:`resolve_engine`)
plus ``resolved_on`` (:func:`machine_facts`). Starting from such a file uses the pinned
values as given (an unavailable backend or a pool that does not fit is refused by the
engine, named) and logs, when the machine differs, each fact that does
(:func:`differences`, :func:`warn_if_elsewhere`). A running server shows the same
resolved view at ``GET /admin/config`` (operator key).

This is one step over the config objects (it builds new ones with ``model_copy``); the
config classes themselves are unchanged.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Mapping

from kvpage.server.config import EngineConfig, ServerConfig
from kvpage.server.engine_client import ServedEngine

__all__ = [
    "differences",
    "machine_facts",
    "resolve_engine",
    "resolve_server",
    "resolved_num_threads",
    "warn_if_elsewhere",
]

logger = logging.getLogger("kvpage.server")


def resolved_num_threads(num_threads: int | None) -> int:
    """The CPU threads an engine built with ``num_threads`` runs with, by the rule of
    ``kvpage.engine.config.EngineConfig.num_threads``: None ->
    ``DEFAULT_NUM_THREADS`` (1), 0 -> torch's default in this process, N -> N."""
    from kvpage.engine.config import DEFAULT_NUM_THREADS

    if num_threads is None:
        return DEFAULT_NUM_THREADS
    if num_threads == 0:
        import torch

        return int(torch.get_num_threads())
    return int(num_threads)


def resolve_engine(config: EngineConfig, engine: ServedEngine) -> EngineConfig:
    """``config`` with the values ``engine`` (built from it) decided at start-up:

    * ``num_blocks``: the pool's blocks per KV group (``engine.cache_spec.num_blocks``,
      the reserved null block included; ``kvpage.engine.config.resolve_num_blocks``);
    * ``backend``: the backend selected for ``auto`` (``engine.backend_name``);
    * ``max_model_len``: the scheduler's (the model's ``max_position_embeddings`` when
      unset);
    * ``num_threads``: :func:`resolved_num_threads`.

    Every other field is kept. Idempotent: resolving a resolved config's engine gives
    the same config.

    Args:
        config: the engine section the engine was built from.
        engine: the engine built from it (an ``LLMEngine``, the engine process's
            handle or the ingress's facade).
    """
    return config.model_copy(
        update={
            "num_blocks": int(engine.cache_spec.num_blocks),
            "backend": str(engine.backend_name),
            "max_model_len": int(engine.scheduler.max_model_len),
            "num_threads": resolved_num_threads(config.num_threads),
        }
    )


def machine_facts() -> dict[str, str]:
    """What a resolved configuration depends on besides itself: kvpage, torch and
    Python versions, OS and CPU architecture, CPU count, CUDA devices, the registered
    backends (strings, so a YAML/JSON round trip keeps them equal)."""
    import torch

    from kvpage.backends import available_backends
    from kvpage.version import __version__

    cuda = torch.cuda.is_available()
    return {
        "kvpage": str(__version__),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "cpu_count": str(os.cpu_count() or 0),
        "cuda": (
            ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            if cuda
            else "none"
        ),
        "backends": ",".join(sorted(available_backends())),
    }


def resolve_server(config: ServerConfig, engine: ServedEngine) -> ServerConfig:
    """``config`` with its engine resolved (:func:`resolve_engine`) and ``resolved_on``
    set to this machine's :func:`machine_facts`."""
    return config.model_copy(
        update={"engine": resolve_engine(config.engine, engine), "resolved_on": machine_facts()}
    )


def differences(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """``"key: recorded -> current"`` for every fact that differs (sorted by key)."""
    keys = sorted(set(recorded) | set(current))
    return [
        f"{k}: {recorded.get(k, '(absent)')} -> {current.get(k, '(absent)')}"
        for k in keys
        if recorded.get(k) != current.get(k)
    ]


def warn_if_elsewhere(config: ServerConfig, what: str = "config") -> list[str]:
    """Log a WARNING listing how this machine differs from the one ``config`` was
    resolved on (``resolved_on``); returns the differences (``[]`` when the config is
    not a resolved dump or the machine is the same)."""
    if config.resolved_on is None:
        return []
    diff = differences(config.resolved_on, machine_facts())
    if diff:
        logger.warning(
            "kvpage serve: the %s was resolved on another machine or version; its pinned "
            "values (num_blocks, backend, max_model_len, num_threads) are used as written, "
            "which may not be what this machine would choose. Differences: %s",
            what,
            "; ".join(diff),
        )
    return diff
