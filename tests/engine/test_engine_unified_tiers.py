"""KV tiers per KV group on the unified pool of a sliding-window hybrid (a tiny random
Gemma-2-style model: 1 full + 2 sliding groups, window 8 shorter than the prompts).

A pool too small to keep an earlier prompt's cached blocks evicts them into the tier
under ``tier_key(group, hash)``; the prompt repeated later is served from the tier by
the cross-group rule (the full group every block, the sliding groups the window at the
hit's end), promoted before the forward: same greedy output as transformers float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from engine_harness import hf_greedy, make_hf_model  # noqa: E402

from kvpage.engine import LLM, SamplingParams  # noqa: E402

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
BS = 4
NB = 40
#: A, then two prompts that evict A's cached blocks, then A again
A = [1] + [(5 * i + 7) % 120 + 3 for i in range(41)]
FILLERS = [
    [1] + [(11 * i + 2) % 120 + 3 for i in range(39)],
    [1] + [(13 * i + 5) % 120 + 3 for i in range(39)],
]


def _one(eng: Any, rid: str, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    """Greedy output of one request and its ``num_cached_tokens_by_tier``, the
    manager's integrity checked after every step."""
    eng.add_request(rid, prompt, GREEDY)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o
        eng.kv_cache_manager.check_integrity()
    assert out is not None
    return list(out.outputs[0].token_ids), dict(out.num_cached_tokens_by_tier)


def _sequence(eng: Any, tag: str, hf: Any) -> dict[str, int]:
    """Run A, the fillers, A again (each output equal to transformers'); returns the
    second A's tokens by tier."""
    refs = {id(p): hf_greedy(hf, p, NEW) for p in [A, *FILLERS]}
    for i, p in enumerate([A, *FILLERS]):
        assert _one(eng, f"{tag}{i}", p)[0] == refs[id(p)]
    got, by_tier = _one(eng, f"{tag}again", A)
    assert got == refs[id(A)]
    kvm = eng.kv_cache_manager
    assert kvm.num_used_blocks == 0 and kvm.num_requests == 0
    assert kvm.num_free_blocks == NB - 1
    return by_tier


@pytest.fixture(scope="module")
def hf() -> Any:
    return make_hf_model("gemma2")


def test_host_tier_per_group_on_a_unified_pool(hf: Any) -> None:
    llm = LLM(hf, block_size=BS, num_blocks=NB, kv_host_tier_bytes=1 << 24)
    eng = llm.llm_engine
    kvm = eng.kv_cache_manager
    assert kvm.unified and kvm.windows == [None, 8, 8]
    tiers = eng.tiers
    assert tiers is not None and len(tiers.movers) == 3 and tiers.host is not None
    demoted_groups: set[int] = set()
    evicted = tiers.evicted_in_group

    def recording(g: int, bid: int, h: bytes) -> None:
        demoted_groups.add(g)
        evicted(g, bid, h)

    tiers.evicted_in_group = recording  # type: ignore[method-assign]
    by_tier = _sequence(eng, "h", hf)
    assert demoted_groups == {0, 1, 2}  # every group's evicted blocks went to the tier
    # the whole prompt but its last token's block, served from host (A was evicted
    # entirely: without tiers the same sequence hits nothing)
    assert by_tier == {"device": 0, "host": (len(A) - 1) // BS * BS}
    base = LLM(hf, block_size=BS, num_blocks=NB).llm_engine
    assert _sequence(base, "b", hf) == {"device": 0}
    # promoted: the full group's 10 blocks, each sliding group only the 2 blocks of
    # its window at the hit's end (40 tokens, window 8: blocks 8 and 9)
    assert tiers.host.stats.promotions == 10 + 2 * 2
    assert tiers.host.stats.hits_tokens == by_tier["host"]
    assert llm.get_metrics()["kvpage:kv_tier_host_hit_tokens_total"] == by_tier["host"]
    kvm.check_integrity()


def test_disk_tier_per_group_survives_a_restart(hf: Any, tmp_path: Path) -> None:
    kw: dict[str, Any] = dict(
        block_size=BS,
        num_blocks=NB,
        kv_disk_tier_bytes=1 << 24,
        kv_disk_tier_path=str(tmp_path),
    )
    eng = LLM(hf, **kw).llm_engine
    by_tier = _sequence(eng, "d", hf)
    assert by_tier.get("disk", 0) > 0
    # a new engine over the same directory (a restart) serves A from disk at once
    eng2 = LLM(hf, **kw).llm_engine
    got, by2 = _one(eng2, "fresh", A)
    assert got == hf_greedy(hf, A, NEW)
    assert by2.get("disk", 0) == (len(A) - 1) // BS * BS
    kvm = eng2.kv_cache_manager
    assert kvm.num_used_blocks == 0 and kvm.num_free_blocks == NB - 1
