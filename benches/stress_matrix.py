"""Stress-test matrix: named workloads in the simulator (GPU scale) and through the real
engine (bundled stories260K on CPU), into one markdown table.

    .venv/bin/python benches/stress_matrix.py --sim-requests 200 --engine-requests 16 \
        --out /tmp/kvpage_stress.json > /tmp/stress.md

Simulator rows: Llama-3-8B bf16 on one H100-80GB (cost model), paged + prefix caching,
block 16, Poisson arrivals at the workload's default rate (``kvpage.workload.workloads``).
Engine rows: stories260K, float32, torch backend on this CPU, block 16, 4096-token KV
pool (256 blocks), prefix caching on; lengths / 16 (``scale="cpu"``); requests submitted
in waves of 4, each wave run to completion (multi-turn: one wave per turn, so turn k+1
sees turn k's committed blocks); one warm-up request first, outside the timings. Engine times are wall-clock on a shared 2-core machine: compare rows
with each other, not with the simulator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvpage.stats import summarize


def run_sim(name: str, n: int) -> dict[str, Any]:
    from kvpage.sim.simulator import SimConfig, simulate
    from kvpage.workload.workloads import make_workload

    trace = make_workload(name, n, scale="gpu")
    r = simulate(trace, SimConfig(policy="paged-prefix", max_model_len=8192)).to_dict()
    return {
        "where": "sim H100",
        "workload": name,
        "requests": r["requests"],
        "finished": r["finished"],
        "ttft_s": r["ttft_s"],
        "tpot_s": r["tpot_s"],
        "tok_s": r["throughput_tok_s"],
        "peak_kv_pct": r["peak_kv_usage_pct"],
        "alloc_failures": r["allocation_failures"],
        "preemptions": r["preemptions"],
        "hit_pct": r["prefix_hit_pct"],
        "peak_batch": r["peak_batch"],
    }


def run_engine(
    name: str, n: int, num_blocks: int = 257, threads: int | None = None
) -> dict[str, Any]:
    from kvpage.engine.engine import LLMEngine
    from kvpage.engine.params import SamplingParams
    from kvpage.workload.traces import TokenMapper
    from kvpage.workload.workloads import make_workload

    trace = make_workload(name, n, scale="cpu")
    eng = LLMEngine.from_config(
        model="stories260K",
        block_size=16,
        num_blocks=num_blocks,
        backend="torch",
        num_threads=threads,
    )
    vocab = int(eng.vocab_size)
    mapper = TokenMapper(seed=0, vocab_size=vocab, hash_block_tokens=trace.hash_block_tokens)
    reqs = list(trace)
    # waves: multi-turn by turn (4 turns per session, in arrival order), else one wave
    # waves: multi-turn by turn; else 4 requests at a time, in arrival order
    waves: list[list[Any]] = [reqs[i : i + 4] for i in range(0, len(reqs), 4)]
    if name == "multi-turn":
        waves = _turn_waves(reqs)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("warmup", [5, 6, 7, 8], warm)  # first-step costs out of the timings
    while eng.has_unfinished_requests():
        eng.step()
    ttft: list[float] = []
    tpot: list[float] = []
    out_tokens = 0
    peak_usage = 0.0
    peak_running = 0
    t_start = time.perf_counter()
    for wave in waves:
        sub: dict[str, float] = {}
        for q in wave:
            prompt = [max(3, t) for t in mapper.prompt(q)]  # keep clear of special ids
            params = SamplingParams(
                max_tokens=max(1, q.output_tokens), temperature=0.0, ignore_eos=True
            )
            eng.add_request(q.request_id, prompt, params)
            sub[q.request_id] = time.perf_counter()
        first: dict[str, float] = {}
        while eng.has_unfinished_requests():
            outs = eng.step()
            now = time.perf_counter()
            m = eng.get_metrics()
            peak_usage = max(peak_usage, m["kvpage:kv_cache_usage_perc"])
            peak_running = max(peak_running, int(m["kvpage:num_requests_running"]))
            for o in outs:
                toks = o.outputs[0].token_ids
                if toks and o.request_id not in first:
                    first[o.request_id] = now
                    ttft.append(now - sub[o.request_id])
                if o.finished:
                    k = len(toks)
                    out_tokens += k
                    if k > 1:
                        tpot.append((now - first[o.request_id]) / (k - 1))
    wall = time.perf_counter() - t_start
    m = eng.get_metrics()
    q = m["kvpage:prefix_cache_queries_total"]
    return {
        "where": "engine CPU",
        "workload": name,
        "requests": len(reqs),
        "finished": len(ttft),
        "ttft_s": summarize(ttft),
        "tpot_s": summarize(tpot),
        "tok_s": out_tokens / wall,
        "peak_kv_pct": 100.0 * peak_usage,
        "alloc_failures": int(m["kvpage:block_allocation_failures_total"]),
        "preemptions": int(m["kvpage:num_preemptions_total"]),
        "hit_pct": 100.0 * m["kvpage:prefix_cache_hits_total"] / q if q else 0.0,
        "peak_batch": peak_running,
    }


def _turn_waves(reqs: list[Any]) -> list[list[Any]]:
    """Split multi-turn requests into per-turn waves by following hash-id chains: a
    request whose leading ids extend an earlier request's ids is that session's next turn."""
    turn: dict[int, int] = {}
    for i, q in enumerate(reqs):
        turn[i] = 0
        for j in range(i - 1, -1, -1):
            p = reqs[j]
            n = len(p.hash_ids) - 1  # the partial last block may be shared too
            if n > 2 and q.hash_ids[:n] == p.hash_ids[:n]:
                turn[i] = turn[j] + 1
                break
    k = max(turn.values()) + 1
    return [[q for i, q in enumerate(reqs) if turn[i] == t] for t in range(k)]


def observe(sim: dict[str, Any], eng: dict[str, Any] | None) -> str:
    """One line of observation from the numbers (rules, not hand-written per run)."""
    notes = []
    if sim["preemptions"]:
        notes.append(f"KV-bound at GPU scale: {sim['preemptions']} preemptions")
    else:
        notes.append(f"fits: peak KV {sim['peak_kv_pct']:.0f}% at batch {sim['peak_batch']}")
    if sim["hit_pct"] > 1:
        notes.append(f"prefix cache serves {sim['hit_pct']:.0f}% of prompt tokens")
    ratio = sim["ttft_s"]["p99"] / max(sim["tpot_s"]["p50"], 1e-9)
    notes.append(f"TTFT p99 = {ratio:.0f} decode steps")
    if eng is not None:
        if eng["preemptions"]:
            notes.append(f"engine preempted {eng['preemptions']}x in a 4096-token pool")
        if eng["hit_pct"] > 1:
            notes.append(f"engine prefix hit {eng['hit_pct']:.0f}%")
        notes.append(f"engine peak KV {eng['peak_kv_pct']:.0f}%")
    return "; ".join(notes)


def table(rows: list[dict[str, Any]], notes: dict[str, str]) -> str:
    head = (
        "| workload | where | done | TTFT p50/p95/p99 (s) | TPOT p50/p95/p99 (ms) | out tok/s "
        "| peak KV % | alloc fail | preempt | hit % | observation |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        t, p = r["ttft_s"], r["tpot_s"]
        lines.append(
            f"| {r['workload']} | {r['where']} | {r['finished']}/{r['requests']} "
            f"| {t['p50']:.3f}/{t['p95']:.3f}/{t['p99']:.3f} "
            f"| {1e3 * p['p50']:.1f}/{1e3 * p['p95']:.1f}/{1e3 * p['p99']:.1f} "
            f"| {r['tok_s']:,.0f} | {r['peak_kv_pct']:.1f} | {r['alloc_failures']} "
            f"| {r['preemptions']} | {r['hit_pct']:.1f} "
            f"| {notes.get(r['workload'], '') if r['where'].startswith('sim') else ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from kvpage.workload.workloads import WORKLOADS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim-requests", type=int, default=200)
    ap.add_argument("--engine-requests", type=int, default=16)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument(
        "--threads", type=int, default=None, help="engine CPU threads (default 1; 0 = torch's)"
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--out", default=None, help="write all rows as JSON here")
    ap.add_argument("--render", default=None, help="only print the table of a saved JSON")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        rows = saved["rows"]
        sims = {r["workload"]: r for r in rows if r["where"].startswith("sim")}
        engs = {r["workload"]: r for r in rows if r["where"].startswith("engine")}
        print(table(rows, {w: observe(s, engs.get(w)) for w, s in sims.items()}))
        return 0
    rows = []
    notes = {}
    for name in args.workloads.split(","):
        t0 = time.perf_counter()
        s = run_sim(name, args.sim_requests)
        rows.append(s)
        e = None
        if not args.no_engine:
            try:
                e = run_engine(name, args.engine_requests, threads=args.threads)
                rows.append(e)
            except ImportError as err:  # engine not installed
                print(f"engine skipped: {err}", file=sys.stderr)
        notes[name] = observe(s, e)
        print(f"{name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        if args.out:  # save as we go: a long run keeps what it finished
            with open(args.out, "w") as f:
                json.dump({"rows": rows, "notes": notes}, f, indent=1)
    print(table(rows, notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
