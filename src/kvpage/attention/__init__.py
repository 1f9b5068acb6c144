"""Attention: step metadata, the per-layer cache container (one layout), the typed step
plan, the backend protocol and the float64 reference that defines what every backend
computes."""

from kvpage.attention.metadata import (
    PAD_BLOCK,
    AttentionMetadata,
    KVCache,
    allocate_kv_cache,
    allocate_layer_cache,
    kv_cache_shape,
    slot_of,
    slots_of,
)
from kvpage.attention.plan import StepPlan, check_step, plan_step, step_fields
from kvpage.attention.protocol import (
    AttentionBackend,
    BackendCapabilities,
    GreedyOps,
    LayerOps,
)

__all__ = [
    "PAD_BLOCK",
    "AttentionBackend",
    "AttentionMetadata",
    "BackendCapabilities",
    "KVCache",
    "GreedyOps",
    "LayerOps",
    "StepPlan",
    "allocate_kv_cache",
    "allocate_layer_cache",
    "check_step",
    "kv_cache_shape",
    "plan_step",
    "slot_of",
    "slots_of",
    "step_fields",
]
