"""The engine replica class without Ray: its generate stream, KV event reports (in
order, with heartbeats), snapshots and info, on the real engine (stories260K)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpage.cluster import replica as R
from kvpage.cluster.core import RouterCore
from kvpage.engine import SamplingParams


def test_replica_reports_feed_the_router_index(monkeypatch: Any) -> None:
    monkeypatch.setattr(R, "HEARTBEAT_S", 0.0)  # every report carries a batch

    async def main() -> None:
        rep = R.EngineReplica("default", {"model": "stories260K", "block_size": 16}, "r0")
        try:
            info = await rep.info()
            assert info["block_size"] == 16 and info["replica_id"] == "r0"
            core = RouterCore("default", "kv_precise", block_size=16)
            core.set_replicas(["r0"])
            prompt = list(range(3, 3 + 40))  # 2 full blocks
            outs = [
                o
                async for o in rep.generate(
                    "q1", prompt, SamplingParams(max_tokens=3, temperature=0.0)
                )
            ]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            first = await rep.kv_events()
            assert first["replica_id"] == "r0" and first["batches"]
            assert core.apply_report(first) is False  # never synced: needs a snapshot
            core.resync(await rep.kv_snapshot())
            want = {h for h in rep.publisher.held()}
            assert core.index.view("r0") == want and len(want) >= 2
            seqs = []
            for _ in range(3):  # quiet replica: heartbeats keep the seq contiguous
                rep_ = await rep.kv_events()
                seqs += [b["seq"] for b in rep_["batches"]]
                assert core.apply_report(rep_)
            assert seqs == list(range(seqs[0], seqs[0] + 3))
            route = {"prompt_token_ids": prompt, "cache_salt": None}
            core.choose("q2", route, ["r0"])
            core.routed("q2", "r0")
            assert core.decisions["q2"].predicted_blocks == 2
            refused = [o async for o in rep.generate("q3", [], SamplingParams(max_tokens=1))]
            assert refused == [{"rejected": refused[0]["rejected"], "reason": "empty_prompt"}]
        finally:
            rep.loop.stop()

    asyncio.run(main())
