"""kvpage: paged KV-cache management and paged attention for LLM inference.

``import kvpage`` needs only torch, numpy, pydantic and pyyaml; optional parts
(GPU backends, server, HF models) import their libraries lazily.
"""

from kvpage.errors import (
    BackendUnavailableError,
    IntegrityError,
    KVPageError,
    RequestRejected,
    ShapeError,
    SpecError,
)
from kvpage.specs import AttentionSpec, CacheSpec, load_preset
from kvpage.version import __version__

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
