"""Attention: step metadata, the per-layer cache container, the backend protocol and
the float64 reference that defines what every backend computes."""

from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_kv_cache
from kvpage.attention.protocol import AttentionBackend, BackendCapabilities

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendCapabilities",
    "KVCache",
    "allocate_kv_cache",
]
