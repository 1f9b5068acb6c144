"""Cost of a mixture-of-experts step against a dense step of the same active size (CPU).

Two levels, each as alternating rounds in one process (ratios, not absolute times,
are the result on a shared machine):

* **MLP**: ``kvpage.models.moe.MoEMLP`` (``E`` experts of width ``I``, top-``k``,
  Mixtral routing) vs the dense ``kvpage.models.layers.MLP`` of width ``k * I`` (the
  same multiply-adds per token), at several token counts (decode batches and prefill
  chunks). Reported: median CPU time per call of each and the ratio MoE / dense.
* **engine**: ``LLM.generate`` of a random-weight Mixtral and of the Llama of the same
  active size (same attention, dense MLP of width ``k * I``), greedy, ``ignore_eos``:
  tokens per CPU-second of each and the ratio.

Usage::

    python benches/bench_moe.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def _cpu(fn: Any, reps: int) -> float:
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps


def bench_mlp(
    rounds: int, hidden: int, inter: int, experts: int, top_k: int
) -> list[dict[str, Any]]:
    from kvpage.models.config import arch_from_hf
    from kvpage.models.layers import MLP
    from kvpage.models.moe import MoEMLP
    from kvpage.specs.moe import moe_params_from_hf

    torch.manual_seed(0)
    base = dict(
        hidden_size=hidden, num_attention_heads=8, num_hidden_layers=1, vocab_size=256,
        num_key_value_heads=8,
    )  # fmt: skip
    params = moe_params_from_hf(
        dict(model_type="mixtral", intermediate_size=inter, num_local_experts=experts,
             num_experts_per_tok=top_k), 1
    )  # fmt: skip
    assert params is not None
    moe = MoEMLP(hidden, params).requires_grad_(False)
    dense = MLP(arch_from_hf(dict(model_type="llama", intermediate_size=top_k * inter, **base)))
    dense.requires_grad_(False)
    for m in (moe, dense):
        for p in m.parameters():
            p.normal_(0, 0.05)
    rows = []
    for tokens in (1, 8, 64, 256):
        x = torch.randn(tokens, hidden)
        reps = max(3, 2000 // tokens)
        t_moe, t_dense = [], []
        with torch.no_grad():
            moe(x), dense(x)  # warm up (fused weights, oneDNN packing)
            for _ in range(rounds):
                t_moe.append(_cpu(lambda x=x: moe(x), reps))
                t_dense.append(_cpu(lambda x=x: dense(x), reps))
        ratios = [a / b for a, b in zip(t_moe, t_dense)]
        rows.append(
            dict(
                tokens=tokens,
                moe_us=1e6 * statistics.median(t_moe),
                dense_us=1e6 * statistics.median(t_dense),
                ratio=statistics.median(ratios),
                ratios=[round(r, 2) for r in ratios],
            )
        )
    return rows


def bench_engine(rounds: int, hidden: int, inter: int, experts: int, top_k: int) -> dict[str, Any]:
    import transformers

    from kvpage.engine import LLM, SamplingParams

    common = dict(
        vocab_size=512, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=hidden // 8, max_position_embeddings=1024,
        initializer_range=0.05, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    moe_hf = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k, **common
        )
    )
    dense_hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(intermediate_size=top_k * inter, **common)
    )
    llms = {
        "moe": LLM(moe_hf, block_size=16, num_blocks=512),
        "dense": LLM(dense_hf, block_size=16, num_blocks=512),
    }
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(16, 64, (32,), generator=g)]  # fmt: skip
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    res: dict[str, list[float]] = {"moe": [], "dense": []}
    for llm in llms.values():
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm up
    for _ in range(rounds):
        for name, llm in llms.items():
            t0 = time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            cpu = time.process_time() - t0
            res[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / cpu)
    ratios = [a / b for a, b in zip(res["moe"], res["dense"])]
    return dict(
        moe_tok_per_cpu_s=statistics.median(res["moe"]),
        dense_tok_per_cpu_s=statistics.median(res["dense"]),
        ratio=statistics.median(ratios),
        ratios=[round(r, 2) for r in ratios],
        backend=llms["moe"].llm_engine.backend.name,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-engine", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, threads {a.threads}")
    for hidden, inter, experts, top_k in ((512, 256, 8, 2), (512, 128, 32, 4)):
        print(f"\nMLP hidden={hidden} expert width={inter} experts={experts} top_k={top_k} "
              f"vs dense width={top_k * inter}")  # fmt: skip
        for r in bench_mlp(a.rounds, hidden, inter, experts, top_k):
            print(f"  tokens={r['tokens']:4d}  moe {r['moe_us']:9.1f} us  dense {r['dense_us']:9.1f} us"
                  f"  moe/dense {r['ratio']:.2f}  rounds {r['ratios']}")  # fmt: skip
    if not a.skip_engine:
        e = bench_engine(a.rounds, 256, 128, 8, 2)
        print(f"\nengine (4 layers, hidden 256, 8 experts x 128, top-2 vs dense 256; "
              f"32 prompts 16-63 tokens, 32 new; backend {e['backend']}): moe "
              f"{e['moe_tok_per_cpu_s']:.0f} tok/CPU-s, dense {e['dense_tok_per_cpu_s']:.0f}, "
              f"moe/dense {e['ratio']:.2f}, rounds {e['ratios']}")  # fmt: skip


if __name__ == "__main__":
    main()
