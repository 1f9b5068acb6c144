"""Unified block pool vs per-group pools vs the bound (issue 25): tokens that fit and
peak concurrent sequences on one 80 GB device, driven through the real allocator.

Per model, the KV budget is ``80e9 x 0.9 - weight bytes`` (weights below, with their
source); DeepSeek-V3 (671e9 parameters) does not fit one device: it is one rank of
:data:`DSV3_TP` under tensor parallelism, its weight bytes the rank's share and its
cache the whole MLA latent (one KV group, so per-group and unified pools are the same). For each pool design the budget is turned into blocks
(``budget // CacheSpec.bytes_per_block``) and:

* **tokens that fit**: the longest single sequence
  (``kvpage.workload.workload_stats.max_sequence_tokens``);
* **peak concurrent sequences**, measured: sequences are admitted into a
  :class:`~kvpage.cache.KVCacheManager` (prefix caching off) one after the other and
  held, each grown to its full length by chunked prefill (2,048-token chunks) and then
  64 decode steps of one token (the sliding groups' steady state), until one does not
  fit; counted are the sequences held at full length. Workloads: ``long`` = sequences
  of 32,768 tokens; ``mooncake`` = the Mooncake conversation trace's prompt + output
  lengths, in trace order (first 2,000 requests).
* **bound**: the bytes actually needed, without blocks: per sequence of ``L`` tokens
  ``sum over full layers(L) + sum over sliding layers(min(L, W))`` x layer bytes per
  token; the same greedy admission in the same order.

Simulator section (``--sim``): output tok/s, peak concurrent sequences (peak batch),
preemptions and TTFT from ``kvpage.sim.simulate`` (the real scheduler and
``KVCacheManager``, step times from the roofline cost model with window-limited KV
reads and MoE active parameters) on an H100-80GB for the same models and budgets
(``SimConfig.weight_bytes``; DeepSeek-V3: ``SimConfig.tp`` = :data:`DSV3_TP`, one rank
simulated, all-reduces not modelled), per-group vs unified pool: ``long`` = :data:`LONG_N`
requests of 32,768 prompt + 256 output tokens (distinct prompts, all at t = 0, policy
``paged``) at two step budgets (``max_num_batched_tokens`` 8,192 and 2,048);
``mooncake`` = the first :data:`MOONCAKE_N` requests of the Mooncake conversation
trace at its own arrival rate (policy ``paged-prefix``). The bound's column is the
greedy count of sequences at full length that fit in the bound's bytes (no simulated
tok/s for the bound: it has no allocator).

Run: ``.venv/bin/python benches/bench_unified_pool.py [--sim]`` (prints Markdown tables).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Any

from kvpage.cache import KVCacheManager
from kvpage.sim.simulator import SimConfig, SimResult, simulate
from kvpage.specs import CacheSpec, load_preset, make_cache_spec
from kvpage.workload.traces import TraceRequest, load_trace
from kvpage.workload.workload_stats import max_sequence_tokens

DEVICE = 80_000_000_000
UTIL = 0.9
BS = 16
CHUNK = 2048
DECODE = 64


def gemma3_27b() -> tuple[CacheSpec, int]:
    """google/gemma-3-27b-it text config (HF config.json): 62 layers, 32 query / 16 KV
    heads, head_dim 128, sliding_window 1024, every 6th layer global
    (sliding_window_pattern 6: 10 global, 52 sliding); bf16; 27.4e9 parameters."""
    layers = [
        dict(
            num_q_heads=32,
            num_kv_heads=16,
            head_dim=128,
            sliding_window=None if (i + 1) % 6 == 0 else 1024,
        )
        for i in range(62)
    ]
    spec = make_cache_spec(num_layers=62, block_size=BS, dtype="bfloat16", layers=layers)
    return spec, int(27.4e9 * 2)


def gpt_oss_120b() -> tuple[CacheSpec, int]:
    """The gpt-oss-120b preset (specs/gpt-oss-120b.yaml: 36 layers alternating sliding
    (window 128) / full, 64 query / 8 KV heads, head_dim 64), bf16 KV. Weights: the
    MXFP4 checkpoint, ~65 GB (model card: fits one 80 GB GPU)."""
    p = load_preset("gpt-oss-120b")
    return p.cache_spec(block_size=BS, dtype="bfloat16"), 65_000_000_000


#: DeepSeek-V3's assumed deployment: tensor parallelism over 16 x H100-80GB (two 8-GPU
#: nodes), FP8 weights (the checkpoint's format: 1 byte per parameter; its block scales,
#: the bf16 norms and the multi-token-prediction layer are not counted). Every rank holds
#: 1/16 of the weights and the whole MLA latent cache (kvpage.capacity.shard_cache_spec).
DSV3_TP = 16
DSV3_WEIGHTS = 671_000_000_000


def deepseek_v3() -> tuple[CacheSpec, int]:
    """The deepseek-v3 preset (specs/deepseek-v3.yaml: 61 MLA layers, latent 512 + rope
    64 = 576 elements per token and layer), bf16 latent, one rank of :data:`DSV3_TP`:
    its spec (all of the latent: 70,272 bytes per token) and its weight share."""
    from kvpage.capacity import shard_cache_spec

    p = load_preset("deepseek-v3")
    spec = shard_cache_spec(p.cache_spec(block_size=BS, dtype="bfloat16"), DSV3_TP)
    return spec, -(-DSV3_WEIGHTS // DSV3_TP)


def llama3_8b() -> tuple[CacheSpec, int]:
    """The llama-3-8b preset (specs/llama-3-8b.yaml), bf16 weights."""
    p = load_preset("llama-3-8b")
    return p.cache_spec(block_size=BS, dtype="bfloat16"), p.num_parameters * 2


def bound_bytes(spec: CacheSpec, n: int) -> int:
    """Bytes a sequence of ``n`` tokens needs without blocks (module docstring)."""
    tot = 0
    for i, a in enumerate(spec.layers):
        w = a.sliding_window
        tot += spec.layer_bytes_per_token(i) * (n if w is None else min(n, w))
    return tot


def bound_tokens(spec: CacheSpec, budget: int, cap: int = 1 << 24) -> int:
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bound_bytes(spec, mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fill(spec: CacheSpec, lengths: list[int]) -> int:
    """Sequences held at full length before one does not fit (module docstring)."""
    mgr = KVCacheManager(spec, enable_prefix_caching=False)
    for k, n in enumerate(lengths):
        rid = str(k)
        toks = range(n)
        pre = max(1, n - DECODE)
        done = 0
        ok = True
        while done < n:
            step = min(CHUNK, pre - done) if done < pre else 1
            if mgr.allocate(rid, toks, step) is None:
                ok = False
                break
            done += step
        if not ok:
            return k
    return len(lengths)


def fill_bound(spec: CacheSpec, budget: int, lengths: list[int]) -> int:
    used = 0
    for k, n in enumerate(lengths):
        used += bound_bytes(spec, n)
        if used > budget:
            return k
    return len(lengths)


#: name, preset, weight bytes of the whole model (None = parameters x 2), tensor-parallel
#: degree: the budgets of the capacity table (one rank simulated)
SIM_MODELS: list[tuple[str, str, int | None, int]] = [
    ("Gemma-3-27B", "gemma-3-27b", int(27.4e9 * 2), 1),
    ("gpt-oss-120b", "gpt-oss-120b", 65_000_000_000, 1),
    ("DeepSeek-V3", "deepseek-v3", DSV3_WEIGHTS, DSV3_TP),
    ("Llama-3-8B", "llama-3-8b", None, 1),
]
LONG_N = 24
LONG_PROMPT = 32768
LONG_OUT = 256
MOONCAKE_N = 300


def long_requests(n: int = LONG_N) -> list[TraceRequest]:
    """``n`` distinct requests of :data:`LONG_PROMPT` + :data:`LONG_OUT` tokens at t = 0."""
    return [TraceRequest(i, 0.0, LONG_PROMPT, LONG_OUT) for i in range(n)]


def sim_config(preset: str, weights: int | None, pool: str, tp: int = 1, **kw: Any) -> SimConfig:
    """The simulator config of one bench row (H100-80GB, bf16, block 16, 128k context
    except Llama-3-8B's 8k, which the long workload's 32k prompts exceed; ``tp`` ranks,
    one simulated)."""
    mml = None if preset == "llama-3-8b" else 131072
    return SimConfig(
        model=preset,
        gpu="H100-80GB",
        kv_pool=pool,
        weight_bytes=weights,
        tp=tp,
        max_model_len=mml,
        **kw,
    )


def sim_rows() -> list[list[Any]]:
    """Rows of the simulator table (module docstring)."""
    trace = load_trace("mooncake-conv", limit=MOONCAKE_N)
    rows: list[list[Any]] = []
    for name, preset, weights, tp in SIM_MODELS:
        runs: list[tuple[str, Any, dict[str, Any]]] = [
            ("mooncake", trace, dict(policy="paged-prefix")),
        ]
        if preset != "llama-3-8b":  # 32k prompts exceed Llama-3-8B's 8k context
            runs += [
                ("long, 8k step", long_requests(), dict(policy="paged")),
                (
                    "long, 2k step",
                    long_requests(),
                    dict(policy="paged", max_num_batched_tokens=2048),
                ),  # fmt: skip
            ]
        for wl, reqs, kw in runs:
            for pool in ("per_group", "unified"):
                t0 = time.perf_counter()
                r: SimResult = simulate(reqs, sim_config(preset, weights, pool, tp, **kw))
                print(f"# {name} {wl} {pool}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
                rows.append(
                    [
                        name,
                        wl,
                        pool,
                        f"{r.finished}/{r.requests}",
                        f"{r.throughput_tok_s:,.1f}",
                        r.peak_batch,
                        r.preemptions,
                        f"{r.ttft_s.get('p50', 0.0):,.1f}",
                        f"{r.prefix_hit_pct:.1f}",
                    ]
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim", action="store_true", help="also the simulator table (minutes)")
    args = ap.parse_args()
    trace = load_trace("src/kvpage/data/traces/mooncake_conversation_trace.jsonl", limit=2000)
    mooncake = [r.prompt_tokens + max(r.output_tokens, 1) for r in trace.requests]
    rows: list[list[Any]] = []
    for name, make in (("Gemma-3-27B", gemma3_27b), ("gpt-oss-120b", gpt_oss_120b), ("DeepSeek-V3", deepseek_v3), ("Llama-3-8B", llama3_8b)):  # fmt: skip
        base, weights = make()
        budget = int(DEVICE * UTIL) - weights
        specs = {k: base.model_copy(update={"kv_pool": k}) for k in ("per_group", "unified")}
        res: dict[str, dict[str, Any]] = {}
        for k, s in specs.items():
            nb = (budget - s.fixed_scale_bytes) // s.bytes_per_block
            s = s.with_blocks(int(nb))
            fit = max_sequence_tokens(s, s.num_blocks - 1)
            longest = max(1, (fit or 1 << 20) // 32768)
            res[k] = dict(
                groups=len(s.kv_groups),
                blocks=s.num_blocks,
                tokens=fit,
                long=fill(s, [32768] * (4 * longest + 8)),
                mooncake=fill(s, mooncake),
            )
        bt = bound_tokens(base, budget)
        b_long = fill_bound(base, budget, [32768] * 4096)
        b_moon = fill_bound(base, budget, mooncake)
        for k in ("per_group", "unified"):
            r = res[k]
            rows.append([name, k, r["groups"], r["blocks"], r["tokens"], r["long"], r["mooncake"]])
        rows.append([name, "bound", "-", "-", bt, b_long, b_moon])
        u = res["unified"]
        print(
            f"# {name}: budget {budget / 1e9:.2f} GB; unified/bound tokens "
            f"{u['tokens'] / bt:.3f}, long {u['long']}/{b_long}, mooncake "
            f"{u['mooncake']}/{b_moon}",
            file=sys.stderr,
        )
    print(f"python {platform.python_version()}, {platform.machine()}")
    print("| model | pool | KV groups | blocks | tokens that fit | peak seqs (32k) | peak seqs (Mooncake) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    if args.sim:
        print()
        print("| model | workload | pool | finished | output tok/s | peak batch | preemptions | TTFT p50 s | prefix hit % |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for r in sim_rows():
            print("| " + " | ".join(str(x) for x in r) + " |")


if __name__ == "__main__":
    main()
