"""KV tiers and swap preemption: simulator studies and a real run (docs/benchmarks.md,
"KV tiers"; docs/capacity-planning.md, "KV tiers").

Sections (``--sections``, default all):

* ``model`` — timing-free chain of LRU tiers over the **whole** Mooncake conversation
  trace (``kvpage.sim.tiers.simulate_tiered_eviction``): Llama-3-8B bf16 on one 80 GB GPU
  (pool from ``kvpage.capacity.plan_capacity``), a host tier of 4x the pool, disk tiers
  of several sizes; prefix-block hit ratio per tier vs the unbounded bound, and a
  service-time TTFT (prefill of the missed tokens on the H100 cost model + transfers at
  the ``--preset`` link speeds; no queueing) p50/p90 with and without tiers.
* ``sim`` — the full simulator (real scheduler, cache manager and tier code) on the first
  ``--sim-requests`` Mooncake requests: hit ratio, TTFT p50/p95 with and without tiers.
* ``swap`` — the stress matrix's long-prompt + long-output (``long-long``) workload,
  recompute vs swap preemption.
* ``engine`` — the bundled model on this machine: a Mooncake-derived workload
  (``kvpage.apps.replay.fit_trace``) on a deliberately small pool, with and without a
  host + disk tier, in alternating rounds in one process: hit ratio, tokens/s, greedy
  outputs identical (with and without tiers, and after a restart over the disk tier).

Usage: ``.venv/bin/python benches/bench_tiers.py [--sections model,sim,swap,engine]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
TB = 10**12


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _gpu_setup() -> tuple[Any, int, int]:
    """Cost model, pool tokens and bytes per token of Llama-3-8B on one H100 80 GB."""
    from kvpage.sim.simulator import SimConfig, build_setup

    spec, cost, _, slots = build_setup(SimConfig())
    return cost, slots, spec.bytes_per_token


def run_model(preset_name: str) -> list[dict[str, Any]]:
    from kvpage.sim.tiers import get_transfer_preset, simulate_tiered_eviction
    from kvpage.workload.traces import load_trace

    trace = load_trace("mooncake-conv")
    cost, slots, bpt = _gpu_setup()
    hb = trace.hash_block_tokens
    block_bytes = hb * bpt
    gpu = slots // hb
    preset = get_transfer_preset(preset_name)
    rows = []
    configs: list[tuple[str, list[int | None]]] = [
        ("GPU only", [gpu]),
        ("GPU + host 4x", [gpu, 4 * gpu]),
    ]
    for tb in (1, 2, 4, 8):
        configs.append((f"GPU + host 4x + disk {tb} TB", [gpu, 4 * gpu, tb * TB // block_bytes]))
    configs.append(("unbounded", [None]))
    for label, caps in configs:
        t0 = time.perf_counter()
        r = simulate_tiered_eviction(trace, caps, cost=cost, block_bytes=block_bytes, preset=preset)
        row = {
            "config": label,
            "capacities_blocks": caps,
            "hit_pct": r.block_hit_pct,
            "by_tier": r.block_hit_pct_by_tier,
            "ttft_s": r.ttft_s,
            "transfer_s": r.transfer_s,
            "wall_s": time.perf_counter() - t0,
        }
        rows.append(row)
        _log(f"model {label}: {r.block_hit_pct:.2f}% ttft p50 {r.ttft_s.get('p50', 0):.3f}s")
    return rows


def run_sim(n: int, preset: str) -> list[dict[str, Any]]:
    from kvpage.sim.simulator import SimConfig, simulate
    from kvpage.workload.traces import load_trace

    trace = load_trace("mooncake-conv", limit=n)
    _, slots, bpt = _gpu_setup()
    pool = slots * bpt
    rows = []
    for label, kw in (
        ("GPU only", {}),
        ("GPU + host 4x + disk 4 TB", dict(kv_host_tier_bytes=4 * pool, kv_disk_tier_bytes=4 * TB)),
    ):
        t0 = time.perf_counter()
        cfg = SimConfig(max_model_len=131072, transfer_preset=preset, **kw)  # type: ignore[arg-type]
        d = simulate(trace, cfg).to_dict()
        d["config"] = label
        d["wall_s"] = time.perf_counter() - t0
        rows.append(d)
        _log(f"sim {label}: hit {d['prefix_hit_pct']:.2f}% ttft p50 {d['ttft_s']['p50']:.2f}s")
    return rows


def run_swap(n: int, preset: str) -> list[dict[str, Any]]:
    from kvpage.sim.simulator import SimConfig, simulate
    from kvpage.workload.workloads import make_workload

    trace = make_workload("long-long", n, scale="gpu")
    rows = []
    for mode in ("recompute", "swap"):
        t0 = time.perf_counter()
        cfg = SimConfig(
            max_model_len=8192,
            preemption_mode=mode,
            swap_space_bytes=64 * GIB,
            transfer_preset=preset,
        )
        d = simulate(trace, cfg).to_dict()
        d["mode"] = mode
        d["wall_s"] = time.perf_counter() - t0
        rows.append(d)
        _log(f"swap {mode}: {d['throughput_tok_s']:.0f} tok/s, {d['preemptions']} preemptions")
    return rows


def run_engine(n: int, num_blocks: int, rounds: int) -> dict[str, Any]:
    from kvpage.apps.replay import fit_trace
    from kvpage.engine import LLM, SamplingParams
    from kvpage.workload.traces import load_trace

    trace = load_trace("mooncake-conv", limit=n)
    reqs = fit_trace(trace, max_model_len=512, vocab_size=512, output_scale=16)
    prompts = [r.prompt_token_ids for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs
    ]
    tmp = tempfile.mkdtemp(prefix="kvpage-tiers-")
    base = dict(block_size=16, num_blocks=num_blocks, max_num_seqs=8)
    configs = {
        "no tiers": base,
        "host only": dict(base, kv_host_tier_bytes=num_blocks * 4 * 20480),
        "host + disk": dict(
            base,
            kv_host_tier_bytes=num_blocks * 4 * 20480,
            kv_disk_tier_bytes=1 << 30,
            kv_disk_tier_path=tmp,
        ),
    }
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    outputs: dict[str, list[list[int]]] = {}
    for rnd in range(rounds):
        for label, kw in configs.items():
            if label == "host + disk":  # every round starts from an empty disk tier
                for f in Path(tmp).rglob("*.kvb"):
                    f.unlink()
            llm = LLM("stories260K", **kw)  # type: ignore[arg-type]
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            m = llm.get_metrics()
            toks = [list(o.outputs[0].token_ids) for o in outs]
            gen = sum(len(t) for t in toks)
            by_tier: dict[str, int] = {}
            for o in outs:
                for k, v in o.num_cached_tokens_by_tier.items():
                    by_tier[k] = by_tier.get(k, 0) + v
            q = sum(len(p) for p in prompts)
            results[label].append(
                {
                    "wall_s": wall,
                    "gen_tok_s": gen / wall,
                    "cpu_s": cpu,
                    "gen_tok_per_cpu_s": gen / cpu,
                    "prompt_tokens": q,
                    "hit_pct": 100.0 * sum(o.num_cached_tokens for o in outs) / q,
                    "hit_tokens_by_tier": by_tier,
                    "preemptions": m["kvpage:num_preemptions_total"],
                    "metrics": {k: v for k, v in m.items() if "tier" in k},
                }
            )
            if label in outputs:
                assert outputs[label] == toks, f"{label}: output changed between rounds"
            outputs[label] = toks
            _log(
                f"engine round {rnd} {label}: {gen / wall:.0f} tok/s, hit {results[label][-1]['hit_pct']:.1f}%"
            )
    same = outputs["no tiers"] == outputs["host + disk"] == outputs["host only"]
    # restart: a new engine over the disk tier the last round left
    llm = LLM("stories260K", **configs["host + disk"])  # type: ignore[arg-type]
    outs = llm.generate(prompts, params, use_tqdm=False)
    restart_same = [list(o.outputs[0].token_ids) for o in outs] == outputs["no tiers"]
    disk_hits = sum(o.num_cached_tokens_by_tier.get("disk", 0) for o in outs)
    return {
        "requests": len(prompts),
        "num_blocks": num_blocks,
        "rounds": results,
        "greedy_identical": same,
        "restart_greedy_identical": restart_same,
        "restart_disk_hit_tokens": disk_hits,
        "restart_hit_pct": 100.0
        * sum(o.num_cached_tokens for o in outs)
        / sum(len(p) for p in prompts),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="model,sim,swap,engine")
    ap.add_argument("--preset", default="pcie5-nvme", help="kvpage.sim.tiers.TRANSFER_PRESETS")
    ap.add_argument("--sim-requests", type=int, default=300)
    ap.add_argument("--swap-requests", type=int, default=200)
    ap.add_argument("--engine-requests", type=int, default=300)
    ap.add_argument("--engine-blocks", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/kvpage_tiers")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    res: dict[str, Any] = {}
    if "model" in sections:
        res["model"] = run_model(args.preset)
    if "sim" in sections:
        res["sim"] = run_sim(args.sim_requests, args.preset)
    if "swap" in sections:
        res["swap"] = run_swap(args.swap_requests, args.preset)
    if "engine" in sections:
        res["engine"] = run_engine(args.engine_requests, args.engine_blocks, args.rounds)
    (out / "tiers.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
