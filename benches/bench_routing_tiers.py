"""kv_precise with KV tiers in the simulator: tier-only leading blocks weighted by the
default ``CostWeights`` (host 0.8, disk 0.2) against weight 0 (tier blocks ignored).

The Mooncake conversation trace's first ``--requests`` requests over ``--instances``
simulated instances (``kvpage.sim.cluster.simulate_cluster``: the real scheduler,
``KVCacheManager``, KV tiers with the ``pcie5-nvme`` transfer preset and
``KVEventPublisher`` per instance), Llama-3-8B bf16 on H100-80GB, block size 64,
outputs capped at 64 tokens, arrivals compressed by ``3 / N`` (as
``benches/bench_routing.py``). The pool is made KV-bound on purpose (``--num-blocks``
blocks of 64 tokens per instance) with a host tier of 4x the pool, so evicted prefixes
live in the host tier and the router's tier view matters. One seed; prints one JSON
line per configuration.

    .venv/bin/python benches/bench_routing_tiers.py --requests 1000 --instances 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from bench_routing import load

    from kvpage.routing import CostWeights
    from kvpage.sim.cluster import simulate_cluster
    from kvpage.sim.simulator import SimConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=3000)
    args = ap.parse_args()
    trace = load("mooncake-conv", args.requests)
    block_bytes = 64 * 131072  # Llama-3-8B bf16: 128 KiB of K/V per token
    cfg = SimConfig(
        block_size=64,
        max_model_len=131072,
        time_scale=3.0 / args.instances,
        num_blocks=args.num_blocks,
        kv_host_tier_bytes=4 * args.num_blocks * block_bytes,
    )
    for label, cost in (
        ("host 0.8 / disk 0.2 (default)", None),
        ("tier blocks weighted 0", CostWeights(host=0.0, disk=0.0)),
    ):
        t0 = time.perf_counter()
        d = simulate_cluster(trace, cfg, instances=args.instances, router="kv_precise", cost=cost)
        row = {
            "weights": label,
            "prefix_hit_pct": round(d.prefix_hit_pct, 2),
            "ttft_p50_s": round(d.ttft_s["p50"], 3),
            "ttft_p90_s": round(d.ttft_s["p90"], 3),
            "ttft_p99_s": round(d.ttft_s["p99"], 3),
            "throughput_tok_s": round(d.throughput_tok_s, 1),
            "imbalance": round(d.imbalance, 2),
            "preemptions": d.preemptions,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
