"""The integration of KV tiers with KV events and miss explanations on the bundled
model: a publisher on an engine with host and disk tiers keeps the router's per-medium
views equal to the pool and the tiers, and a miss after a host-tier LRU drop is
explained as evicted from ``host`` by ``lru``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpage.engine import LLM, SamplingParams
from kvpage.routing import KVEventPublisher, PrefixIndex

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# 50-token prompts: 3 full blocks of 16 each; 6 of them overflow the 9-block pool
PROMPTS = [[1 + (i * 37 + j * 11) % 500 for j in range(50)] for i in range(6)]


@pytest.mark.parametrize("disk", [True, False], ids=["host+disk", "host"])
def test_events_follow_pool_and_tiers_and_misses_name_the_tier(tmp_path: Path, disk: bool) -> None:
    kw: dict[str, object] = {}
    if disk:  # 4 blocks: the disk tier drops by LRU too
        kw = dict(kv_disk_tier_bytes=4 * 20480, kv_disk_tier_path=str(tmp_path))
    llm = LLM(
        "stories260K",
        block_size=16,
        num_blocks=10,
        kv_host_tier_bytes=2 * 20480,  # 2 blocks: the host tier drops (to disk) by LRU
        **kw,  # type: ignore[arg-type]
    )
    kvm = llm.llm_engine.kv_cache_manager
    tiers = kvm.tiers
    assert tiers is not None and tiers.host is not None
    pub = KVEventPublisher("r0")
    pub.attach(kvm)
    idx = PrefixIndex()
    idx.resync(pub.snapshot())
    outs = []
    for p in PROMPTS + PROMPTS[:2]:  # the repeats come back from the tiers or miss
        (o,) = llm.generate([p], GREEDY, use_tqdm=False)
        outs.append(o)
        batch = pub.drain(heartbeat=True)
        assert batch is not None and idx.apply(batch)
        assert idx.view("r0") == kvm.prefix_pools[0].cached_hashes()
        assert idx.view("r0", "host") == frozenset(tiers.host.hashes())
        on_disk = frozenset() if tiers.disk is None else frozenset(tiers.disk.hashes())
        assert idx.view("r0", "disk") == on_disk
    assert tiers.host.stats.drops > 0
    # the repeats' blocks went device -> host (-> disk) and were dropped by that LRU
    for o in outs[6:]:
        miss = o.cache_miss
        assert miss is not None and o.num_cached_tokens == 0
        assert (miss.reason, miss.tier, miss.policy) == (
            "evicted",
            "disk" if disk else "host",
            "lru",
        )
