"""Test helpers shipped with kvpage, for the conformance suite and for out-of-tree
backend authors: Hypothesis strategies of attention cases, poisoning, the tolerance
table, and functions that run a case through a backend against the float64 reference.

Importing this package needs Hypothesis (the ``test`` extra).
"""

from kvpage.testing.cases import (
    AttentionCase,
    Materialized,
    clone_cache,
    make_case,
    make_data,
    materialize,
    poisoned_cache,
    poisoned_like,
    slot_at,
)
from kvpage.testing.invariance import (
    check_chunking_invariance,
    check_layout_invariance,
    chunked_outputs,
)
from kvpage.testing.runner import (
    assert_cache_bits_equal,
    check_attention_case,
    check_quantization_error,
    check_write_kv_case,
    run_attention,
    run_plugin_case,
)
from kvpage.testing.strategies import (
    HEAD_DIMS,
    SIMULATOR_BUDGET,
    TestBudget,
    attention_cases,
    budget_for,
    chunkings,
    layouts,
    seq_lens_near_boundaries,
)
from kvpage.testing.tolerances import (
    QUANT_ERROR_BOUNDS,
    TOLERANCES,
    Tolerance,
    assert_bits_equal,
    assert_close,
    tolerance_for,
)

__all__ = [
    "HEAD_DIMS",
    "QUANT_ERROR_BOUNDS",
    "SIMULATOR_BUDGET",
    "TOLERANCES",
    "AttentionCase",
    "Materialized",
    "TestBudget",
    "Tolerance",
    "assert_bits_equal",
    "assert_cache_bits_equal",
    "assert_close",
    "attention_cases",
    "budget_for",
    "check_attention_case",
    "check_chunking_invariance",
    "check_layout_invariance",
    "check_quantization_error",
    "check_write_kv_case",
    "chunked_outputs",
    "chunkings",
    "clone_cache",
    "layouts",
    "make_case",
    "make_data",
    "materialize",
    "poisoned_cache",
    "poisoned_like",
    "run_attention",
    "run_plugin_case",
    "seq_lens_near_boundaries",
    "slot_at",
    "tolerance_for",
]
