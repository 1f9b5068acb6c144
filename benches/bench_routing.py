"""Router policies at scale in the weight-free simulator: one table, one plot.

Runs ``kvpage.sim.cluster.simulate_cluster`` (the routing code of ``kvpage.routing`` over N
simulated instances, each the real scheduler + KVCacheManager + KV-event publisher, step
times from the roofline cost model: Llama-3-8B bf16 on an H100-80GB, 2 ms per step) for
every router x N on each workload, and writes

* ``docs/sim_routing.md``: the markdown table (also printed);
* ``docs/sim_routing.png``: prefix hit ratio and TTFT p90 against N, per workload;
* ``--out DIR/routing.json``: every result.

Subsets (so the study runs in tens of minutes on one shared core, not hours):

* Mooncake conversation: the first 2,000 requests (the first 669 s of the trace);
  Azure conv: the first 2,000; Azure code: the first 1,000; ``rag`` (the synthetic
  shared-system-prompt + passage-pool workload of ``kvpage.workload.workloads``, a
  stand-in for Mooncake's tool-agent trace, which could not be obtained): 1,000.
* Arrivals compressed by ``c / N`` (``c`` per workload, below), so the load *per
  instance* is the same at every N: a larger cluster serves proportionally more traffic.
* Output lengths capped at 64 tokens (the simulation cost grows with decode steps;
  prompts, arrivals and prefix sharing, which routing acts on, are unchanged).
* Block size 64 (a Mooncake hash block of 512 tokens = 8 blocks; fewer blocks per long
  prompt keeps the per-block bookkeeping affordable); max_model_len 131,072.

``ideal`` is the hit ratio of one instance with an infinite cache receiving every
request in order (the engine's cap: at most ``(len - 1) // block_size`` blocks): no
router can beat it.

    .venv/bin/python benches/bench_routing.py --out /tmp/kvpage_routing
    .venv/bin/python benches/bench_routing.py --quick   # smoke run, not for the docs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: (workload, first N requests, c: time_scale = c / instances)
WORKLOADS = [
    ("mooncake-conv", 2000, 3.0),
    ("rag", 1000, 1.5),
    ("azure-conv", 2000, 0.4),
    ("azure-code", 1000, 0.5),
]
INSTANCES = [2, 4, 8, 16, 32, 64]
ROUTERS = ["round_robin", "power_of_two", "prefix_approx", "kv_precise", "oracle"]
BLOCK_SIZE = 64
OUTPUT_CAP = 64
MAX_MODEL_LEN = 131072


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(name: str, limit: int) -> Any:
    from kvpage.apps.cluster_cli import cap_outputs
    from kvpage.workload.traces import load_trace
    from kvpage.workload.workloads import make_workload

    tr = make_workload(name, limit) if name == "rag" else load_trace(name, limit=limit)
    return cap_outputs(tr, OUTPUT_CAP)


def ideal_hit_pct(trace: Any) -> float:
    """Hit blocks / full prompt blocks for one infinite cache, requests in arrival order."""
    from kvpage.cache import hash_request_blocks
    from kvpage.workload.traces import TokenMapper

    mapper = TokenMapper(hash_block_tokens=trace.hash_block_tokens)
    seen: set[bytes] = set()
    hit = blocks = 0
    for r in trace.requests:
        toks = mapper.prompt(r)
        hs = hash_request_blocks(toks, BLOCK_SIZE)
        cap = max(len(toks) - 1, 0) // BLOCK_SIZE
        m = 0
        for h in hs[:cap]:
            if h not in seen:
                break
            m += 1
        hit += m
        blocks += len(hs)
        seen.update(hs)
    return 100.0 * hit / blocks if blocks else 0.0


def run(quick: bool, workloads: list[str] | None, sink: Path) -> list[dict[str, Any]]:
    from kvpage.sim.cluster import simulate_cluster
    from kvpage.sim.simulator import SimConfig

    rows = []
    for name, limit, c in WORKLOADS:
        if workloads and name not in workloads:
            continue
        n_req = min(limit, 200) if quick else limit
        trace = load(name, n_req)
        ideal = ideal_hit_pct(trace)
        _log(f"{name}: {len(trace)} requests over {trace.duration_s:.0f} s, ideal {ideal:.1f} %")
        for n in [2, 8] if quick else INSTANCES:
            cfg = SimConfig(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, time_scale=c / n)
            for router in ROUTERS:
                t0 = time.perf_counter()
                d = simulate_cluster(trace, cfg, instances=n, router=router).to_dict()
                d.update(workload=name, ideal_hit_pct=ideal, wall_s=time.perf_counter() - t0)
                rows.append(d)
                sink.write_text(json.dumps(rows, indent=1) + "\n")  # partial results survive
                _log(
                    f"  N={n:2d} {router:13s} hit {d['prefix_hit_pct']:5.1f} % "
                    f"TTFT p90 {d['ttft_s']['p90']:.2f} s ({d['wall_s']:.0f} s wall)"
                )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "workload",
        "N",
        "router",
        "hit % (blocks)",
        "ideal %",
        "TTFT p50 / p90 / p99 s",
        "out tok/s",
        "imbalance",
        "preempt",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    for d in rows:
        t = d["ttft_s"]
        out.append(
            f"| {d['workload']} | {d['instances']} | {d['router']} | "
            f"{d['prefix_hit_pct']:.1f} | {d['ideal_hit_pct']:.1f} | "
            f"{t['p50']:.2f} / {t['p90']:.2f} / {t['p99']:.2f} | "
            f"{d['throughput_tok_s']:,.0f} | {d['imbalance']:.2f} | {d['preemptions']} |"
        )
    return "\n".join(out)


def targets(rows: list[dict[str, Any]]) -> str:
    """The issue's targets on Mooncake conversation at N = 8 and 32, as measured."""
    lines = []
    for n in (8, 32):
        by = {
            d["router"]: d for d in rows if d["workload"] == "mooncake-conv" and d["instances"] == n
        }
        if len(by) < len(ROUTERS):
            continue
        kv, rr, orc = by["kv_precise"], by["round_robin"], by["oracle"]
        ratio = kv["prefix_hit_pct"] / max(rr["prefix_hit_pct"], 1e-9)
        vs_orc = kv["prefix_hit_pct"] / max(orc["prefix_hit_pct"], 1e-9)
        p90 = {r: by[r]["ttft_s"]["p90"] for r in ("kv_precise", "prefix_approx", "power_of_two")}
        lines.append(
            f"- N={n}: kv_precise hit {kv['prefix_hit_pct']:.1f} % = {ratio:.2f}x round robin "
            f"({'met' if ratio >= 3 else 'MISSED'}: >= 3x); {100 * vs_orc:.0f} % of oracle "
            f"({'met' if vs_orc >= 0.9 else 'MISSED'}: >= 90 %); TTFT p90 "
            f"{p90['kv_precise']:.2f} s vs prefix_approx {p90['prefix_approx']:.2f} s, "
            f"power_of_two {p90['power_of_two']:.2f} s "
            f"({'met' if p90['kv_precise'] < min(p90['prefix_approx'], p90['power_of_two']) else 'MISSED'})"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w[0] for w in WORKLOADS if any(d["workload"] == w[0] for d in rows)]
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 7), squeeze=False)
    for j, name in enumerate(names):
        for router in ROUTERS:
            pts = sorted(
                (d["instances"], d["prefix_hit_pct"], d["ttft_s"]["p90"])
                for d in rows
                if d["workload"] == name and d["router"] == router
            )
            xs = [p[0] for p in pts]
            axes[0][j].plot(xs, [p[1] for p in pts], marker="o", label=router)
            axes[1][j].plot(xs, [p[2] for p in pts], marker="o", label=router)
        ideal = next(d["ideal_hit_pct"] for d in rows if d["workload"] == name)
        axes[0][j].axhline(ideal, color="gray", ls="--", lw=1, label="ideal (infinite cache)")
        axes[0][j].set_title(name)
        axes[0][j].set_ylabel("prefix hit % (blocks)")
        axes[1][j].set_ylabel("TTFT p90 (s)")
        axes[1][j].set_yscale("log")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("instances N")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Routers over N simulated instances (Llama-3-8B, H100, per-instance load fixed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/kvpage_routing", help="folder for routing.json")
    ap.add_argument("--workloads", default=None, help="comma list (default: all)")
    ap.add_argument("--quick", action="store_true", help="200 requests, N in {2, 8}")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/sim_routing.*")
    ap.add_argument(
        "--from-json",
        default=None,
        help="comma list of routing.json files of earlier runs: tabulate and plot them "
        "instead of running (e.g. workloads run in two processes)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        rows = [d for f in args.from_json.split(",") for d in json.loads(Path(f).read_text())]
        order = {w[0]: i for i, w in enumerate(WORKLOADS)}
        rows.sort(key=lambda d: (order.get(d["workload"], 99), d["instances"]))
    else:
        wl = args.workloads.split(",") if args.workloads else None
        rows = run(args.quick, wl, out / "routing.json")
    (out / "routing.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = table(rows)
    tg = targets(rows)
    print(md)
    print(tg)
    if not args.no_docs:
        (DOCS / "sim_routing.md").write_text(
            "# Routers at scale (simulator): results table\n\n"
            "Written by `benches/bench_routing.py` (settings in its docstring and in "
            "[benchmarks.md](benchmarks.md#routers-at-scale-simulator)).\n\n"
            + md
            + "\n\nTargets (Mooncake conversation):\n\n"
            + tg
            + "\n"
        )
        plot(rows, DOCS / "sim_routing.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
