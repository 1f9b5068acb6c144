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

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "BackendUnavailableError",
    "CacheSpec",
    "IntegrityError",
    "KVPageError",
    "RequestRejected",
    "ShapeError",
    "SpecError",
    "__version__",
    "load_preset",
]
