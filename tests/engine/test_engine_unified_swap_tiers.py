"""Swap preemption and KV tiers on a sliding-window hybrid (a tiny random Gemma-2-style
model, unified pool of 3 KV groups): both serve one full-attention group only, and are
refused by name at engine construction (never run silently on group 0 alone). Issue 25
asks for them per group on the shared pool; not built yet (docs/benchmarks.md, issue-25
section)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from engine_harness import make_hf_model  # noqa: E402

from kvpage.engine import LLM  # noqa: E402
from kvpage.errors import SpecError  # noqa: E402


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        (dict(preemption_mode="swap"), "preemption_mode"),
        (dict(kv_host_tier_bytes=1 << 20), "tiers"),
    ],
)
def test_swap_and_tiers_refused_on_a_multi_group_pool(kw: dict, name: str) -> None:
    hf = make_hf_model("gemma2")
    with pytest.raises(SpecError, match=name):
        LLM(hf, block_size=4, num_blocks=64, **kw)
