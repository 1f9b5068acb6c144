"""kvpage: paged KV-cache management and paged attention for LLM inference.

``import kvpage`` needs only torch, numpy, pydantic and pyyaml; optional parts
(GPU backends, server, HF models) import their libraries lazily.
"""

import os as _os

# OpenMP threads that wait at a barrier spin briefly (5,000 turns, tens of microseconds)
# and then sleep, instead of GNU OpenMP's default 300,000 turns (GNU OpenMP reads both
# when torch loads it, so this only takes effect when kvpage is imported before torch;
# an explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins). Long spinning is what made more
# than one thread 20-200x slower on a small or shared machine: a spinning waiter burns
# the core the thread it waits for needs; never spinning (a futex sleep at every one of
# a step's many small parallel ops) cost ~1.25x in wall time on free cores at 2 threads
# (docs/benchmarks.md, "Threads"). One thread (the default) has no barriers.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", "5000")

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
