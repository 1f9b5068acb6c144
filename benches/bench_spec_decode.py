"""Speculative decoding (n-gram prompt lookup) vs plain decoding on the bundled model.

Workloads (stories260K, CPU, float32, greedy, ``ignore_eos``, 128 output tokens):

* ``repeat``: natural text that repeats its context. Stories are generated once by the
  bundled model itself (temperature 0.8, seeded, 160 tokens, from story openings); each
  prompt is a story followed by its first 24 tokens again, so the continuation copies
  the context (summarisation/RAG-like outputs that quote the prompt).
* ``random``: random token-id prompts (seeded) with the lengths of the first requests
  of the bundled Azure conversation trace (ContextTokens // 8 clipped to [16, 256], BOS then random ids);
  drafts rarely match, so this measures the cost of proposing and verifying.

Batch 1 runs 4 requests one at a time; batch B (8, 64) runs B at once. Engines (spec
off, and ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}`` by default with ``draft_policy`` ``"fixed"`` and
``"adaptive"``) are built in one process on the same weights and run in alternating
rounds (off, fixed, adaptive, off, ...); each round reports generated tokens per wall
second and per process CPU-second (``time.process_time``: on a shared machine the
wall rate moves with the other jobs, the CPU rate much less), the mean TTFT, (spec) the acceptance rate ``accepted / draft tokens`` and the
1-minute load average at its end. The adaptive engine keeps its measurements across
rounds (as a server would); each engine gets one unreported warm-up request per row.

Usage: ``.venv/bin/python benches/bench_spec_decode.py [--rounds 3] [--k 4]
[--batches 1,8,64] [--lookup-min 2] [--lookup-max 4]
[--out out/bench_spec_decode.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

OPENINGS = [
    "Once upon a time",
    "One day, a little boy",
    "Lily and Ben",
    "There was a big red",
    "Tom wanted to",
    "The sun was",
    "Sara had a cat",
    "Max liked to",
]


def story_prompts(n: int) -> list[list[int]]:
    """``n`` repeat-context prompts (see the module docstring)."""
    from kvpage.engine import LLM, SamplingParams

    llm = LLM(model="stories260K")
    outs = llm.generate(
        [OPENINGS[i % len(OPENINGS)] for i in range(n)],
        [
            SamplingParams(temperature=0.8, seed=i, max_tokens=160, ignore_eos=True)
            for i in range(n)
        ],
        use_tqdm=False,
    )
    return [
        list(o.prompt_token_ids)
        + list(o.outputs[0].token_ids)
        + list(o.prompt_token_ids)
        + list(o.outputs[0].token_ids[:24])
        for o in outs
    ]


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random-id prompts with trace lengths (see the module docstring)."""
    from kvpage.workload.traces import load_trace

    trace = load_trace("azure-conv", limit=n)
    rng = np.random.default_rng(seed)
    lens = [int(min(256, max(16, r.prompt_tokens // 8))) for r in trace.requests]
    return [[1, *rng.integers(3, vocab, size=L - 1).tolist()] for L in lens]  # BOS first


def run_round(llm: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, float]:
    from kvpage.engine import SamplingParams

    eng = llm.llm_engine
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = eng.get_metrics()
    toks = 0
    ttft: list[float] = []
    t0 = time.perf_counter()
    c0 = time.process_time()
    for i in range(0, len(prompts), batch):
        chunk = [{"prompt_token_ids": q} for q in prompts[i : i + batch]]
        for o in llm.generate(chunk, p, use_tqdm=False):
            toks += len(o.outputs[0].token_ids)
            ttft.append(o.first_token_time - o.arrival_time)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    after = eng.get_metrics()
    eng.kv_cache_manager.check_integrity()

    def d(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)

    drafts = d("kvpage:spec_decode_num_draft_tokens_total")
    acc = d("kvpage:spec_decode_num_accepted_tokens_total")
    return {
        "tok_s": toks / wall,
        "tok_cpu_s": toks / cpu,
        "ttft_ms": 1e3 * statistics.mean(ttft),
        "draft_tokens": drafts,
        "accepted_tokens": acc,
        "acceptance_rate": acc / drafts if drafts else 0.0,
        "tokens": toks,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--out", default="out/bench_spec_decode.json")
    a = ap.parse_args()
    from kvpage.engine import LLM

    torch.manual_seed(0)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": a.k,
        "prompt_lookup_max": a.lookup_max,
        "prompt_lookup_min": a.lookup_min,
    }
    batches = [int(b) for b in a.batches.split(",")]
    engines = {
        "off": LLM(model="stories260K", enable_prefix_caching=False),
        "fixed": LLM(
            model="stories260K",
            enable_prefix_caching=False,
            speculative_config={**spec, "draft_policy": "fixed"},
        ),
        "adaptive": LLM(
            model="stories260K",
            enable_prefix_caching=False,
            speculative_config={**spec, "draft_policy": "adaptive"},
        ),
    }
    vocab = int(engines["off"].llm_engine.vocab_size)
    n = max(8, *batches)
    workloads = {"repeat": story_prompts(n), "random": random_prompts(n, vocab)}
    rows = []
    for wname, prompts in workloads.items():
        for batch in batches:
            ps = prompts[:4] if batch == 1 else prompts[:batch]
            res: dict[str, list[dict[str, float]]] = {m: [] for m in engines}
            for llm in engines.values():  # warm-up, not reported
                run_round(llm, ps[:1], 1, 8)
            for _ in range(a.rounds):
                for mode, llm in engines.items():
                    res[mode].append(run_round(llm, ps, batch, a.max_tokens))
            row: dict[str, Any] = {"workload": wname, "batch": batch}
            for mode in engines:
                row[f"{mode}_tok_s"] = [round(r["tok_s"], 1) for r in res[mode]]
                row[f"{mode}_tok_cpu_s"] = [round(r["tok_cpu_s"], 1) for r in res[mode]]
                row[f"{mode}_ttft_ms"] = [round(r["ttft_ms"], 1) for r in res[mode]]
                if mode != "off":
                    row[f"{mode}_ratio"] = [
                        round(s["tok_s"] / o["tok_s"], 3) for s, o in zip(res[mode], res["off"])
                    ]
                    row[f"{mode}_cpu_ratio"] = [
                        round(s["tok_cpu_s"] / o["tok_cpu_s"], 3)
                        for s, o in zip(res[mode], res["off"])
                    ]
                    row[f"{mode}_acceptance"] = [round(r["acceptance_rate"], 3) for r in res[mode]]
                    row[f"{mode}_draft_tokens"] = [int(r["draft_tokens"]) for r in res[mode]]
            row["load"] = [round(r["load"], 1) for r in res["off"]]
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "k": a.k,
        "rounds": a.rounds,
        "max_tokens": a.max_tokens,
        "prompt_lookup": [a.lookup_min, a.lookup_max],
        "batches": batches,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
