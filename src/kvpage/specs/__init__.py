"""Declarative specifications: attention shape per layer and the paged KV-cache layout.

Split by job: :mod:`kvpage.specs.core` (the spec types), :mod:`kvpage.specs.hf`
(reading HF ``config.json`` and llama2.c headers: the one config reader),
:mod:`kvpage.specs.presets` (named presets), :mod:`kvpage.specs.state` (recurrent
layers' per-sequence state). Everything is importable from
``kvpage.specs`` as before.
"""

from kvpage.specs.core import (
    DTYPE_BYTES,
    KV_DTYPE_BYTES,
    SCALE_BYTES,
    AttentionSpec,
    CacheSpec,
    KVCacheDType,
    KVGroup,
    KVPoolKind,
    ModelDType,
    ScaleGranularity,
    make_attention_spec,
    make_cache_spec,
)
from kvpage.specs.hf import (
    HFAttentionShape,
    attention_layers_from_hf,
    hf_attention_shape,
    hf_config_dict,
    llama2c_header_to_hf,
    read_hf_config_file,
)
from kvpage.specs.presets import Preset, list_presets, load_preset
from kvpage.specs.state import StateSpec

__all__ = [
    "DTYPE_BYTES",
    "KV_DTYPE_BYTES",
    "SCALE_BYTES",
    "AttentionSpec",
    "CacheSpec",
    "HFAttentionShape",
    "KVCacheDType",
    "KVPoolKind",
    "KVGroup",
    "ModelDType",
    "Preset",
    "ScaleGranularity",
    "StateSpec",
    "attention_layers_from_hf",
    "hf_attention_shape",
    "hf_config_dict",
    "list_presets",
    "llama2c_header_to_hf",
    "load_preset",
    "make_attention_spec",
    "make_cache_spec",
    "read_hf_config_file",
]
