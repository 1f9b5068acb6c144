"""Recurrent-state snapshots in the disk KV tier across an engine restart (issue 26):
time to first token of a prompt whose shared prefix is served from disk (KV blocks and
the recurrent-state snapshot at its last full-block boundary) by a freshly started
engine, against the same prompt computed cold by a fresh engine without the files.

Model: a small random-weight ``qwen3_next`` (Gated DeltaNet + gated attention) built
offline from transformers' ``Qwen3NextConfig`` (sizes in :data:`SIZES`; no hub), float32,
on this machine's CPU, one thread (``OMP_NUM_THREADS=1``). Prompt: ``--prefix`` shared
tokens then a 5-token question; one generated token (``max_tokens=1``, greedy), so the
measured ``generate`` wall time is the TTFT of one request alone.

Preparation: an engine with a disk tier (``kv_disk_tier_bytes``, no host tier, one
snapshot slot, a small pool) runs the prompt, then other prompts that evict its KV
blocks and its snapshot to disk files. Then ``--rounds`` alternating rounds, each: a new
engine over that directory runs the prompt (hit from disk), and a new engine over an
empty directory runs it (cold); engine construction is not timed. Greedy tokens of the
two are checked equal. Reported: median TTFT of each, the ratio, ``cached_tokens`` and
its tiers, and the disk tier's files.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benches/bench_state_disk.py [--prefix 960]``
(Markdown on stdout).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the model's sizes (transformers' Qwen3NextConfig keywords)
SIZES: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
BS = 16


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.CONFIG_MAPPING["qwen3_next"](**SIZES)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=960, help="shared prefix tokens")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = ap.parse_args()

    from kvpage.engine import LLM
    from kvpage.engine.params import SamplingParams

    tmp = Path(tempfile.mkdtemp(prefix="bench_state_disk_"))
    folder = tmp / "model"
    build_model(folder)
    n = args.prefix
    prompt = [(7 * i + 3) % 500 + 3 for i in range(n)] + [11, 12, 13, 14, 15]
    others = [[(k * 13 + 5 * i) % 500 + 3 for i in range(n)] + [9, 9] for k in (1, 2)]
    blocks = -(-len(prompt) // BS)
    kw: dict[str, Any] = dict(
        model=str(folder),
        block_size=BS,
        max_model_len=n + 64,
        seed=0,
        max_num_batched_tokens=n + 64,
        state_snapshot_slots=1,
        num_blocks=blocks + 4,  # the next prompt evicts this one's blocks
        kv_disk_tier_bytes=1 << 30,
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(llm: Any, p: list[int]) -> tuple[float, Any]:
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        return time.perf_counter() - t0, out

    disk = tmp / "disk"
    llm = LLM(**kw, kv_disk_tier_path=str(disk))
    for p in [prompt, *others]:
        run(llm, p)
    pool = llm.llm_engine.kv_cache_manager.state
    assert pool is not None and pool.disk is not None
    files, snap_files = len(pool.disk), pool.num_disk_used
    state_bytes = llm.llm_engine.cache_spec.state_bytes_per_sequence
    del llm, pool
    hit_s: list[float] = []
    cold_s: list[float] = []
    cached: set[int] = set()
    tiers: dict[str, int] = {}
    for r in range(args.rounds):
        for mode in ("disk", "cold"):
            path = disk if mode == "disk" else tmp / f"empty{r}"
            llm = LLM(**kw, kv_disk_tier_path=str(path))
            dt, out = run(llm, prompt)
            if mode == "disk":
                hit_s.append(dt)
                cached.add(out.num_cached_tokens)
                tiers = dict(out.num_cached_tokens_by_tier)
                hit_tok = list(out.outputs[0].token_ids)
            else:
                cold_s.append(dt)
                assert out.num_cached_tokens == 0
                assert list(out.outputs[0].token_ids) == hit_tok, "greedy tokens differ"
            _log(f"round {r} {mode}: {dt * 1e3:.1f} ms, cached {out.num_cached_tokens}")
            del llm
    h, c = statistics.median(hit_s), statistics.median(cold_s)
    print(f"qwen3_next (random, {SIZES['num_hidden_layers']} layers, hidden {SIZES['hidden_size']}),"
          f" prompt {len(prompt)} tokens, one snapshot {state_bytes:,} bytes;"
          f" disk tier after preparation: {files} files ({snap_files} snapshot)\n")  # fmt: skip
    print("| run | TTFT median (ms) | rounds | cached_tokens | by tier |")
    print("|---|---|---|---|---|")
    print(f"| restart, hit from disk | {h * 1e3:.1f} | {len(hit_s)} | {sorted(cached)} | {tiers} |")
    print(f"| fresh engine, cold | {c * 1e3:.1f} | {len(cold_s)} | 0 | - |")
    print(f"\nratio cold / disk hit: {c / h:.2f}x "
          f"(per round: {', '.join(f'{a / b:.2f}' for a, b in zip(cold_s, hit_s))})")  # fmt: skip


if __name__ == "__main__":
    main()
