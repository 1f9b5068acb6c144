"""kvpage: paged KV-cache management and paged attention for LLM inference.

``import kvpage`` needs only torch, numpy, pydantic and pyyaml; optional parts
(GPU backends, server, HF models) import their libraries lazily.
"""

import os as _os

# OpenMP threads that wait at a barrier sleep instead of spinning (GNU OpenMP reads this
# when torch loads it, so it only takes effect when kvpage is imported before torch;
# an explicit setting wins). Spinning is what made more than one thread 20-200x slower
# on a small or shared machine: a spinning waiter burns the core the thread it waits
# for needs (docs/benchmarks.md, "Threads").
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvpage.errors import (  # noqa: E402
    BackendUnavailableError,
    IntegrityError,
    KVPageError,
    RequestRejected,
    ShapeError,
    SpecError,
)
from kvpage.specs import AttentionSpec, CacheSpec, load_preset  # noqa: E402
from kvpage.version import __version__  # noqa: E402

#: the user API, imported on first use (``from kvpage import LLM, SamplingParams``) so
#: that ``import kvpage`` stays light
_ENGINE_EXPORTS = ("LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput")


def __getattr__(name: str) -> object:
    if name in _ENGINE_EXPORTS:
        import kvpage.engine

        return getattr(kvpage.engine, name)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")


__all__ = [
    "AttentionSpec",
    "BackendUnavailableError",
    "CacheSpec",
    "CompletionOutput",
    "IntegrityError",
    "KVPageError",
    "LLM",
    "LLMEngine",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "ShapeError",
    "SpecError",
    "__version__",
    "load_preset",
]
