"""Each engine's tokens/s in a ``bench_peers.py`` result as a fraction of this machine's
roofline bound for the same workload (limits from ``benches/roofline.py``'s JSON, at the
run's thread count).

Bound (seconds) of a group of requests submitted together, ``(prompt P_r, output O_r)``,
on the ideal schedule (every request prefilled at once, then one token per request per
decode step): prefill time = prefill FLOP / matmul peak, plus for each decode step ``s``
(``1 .. max O_r - 1``, the first output token coming from the prefill) ``max(bytes_s /
read bandwidth, FLOP_s / matmul peak)``, where

* bytes_s = weight bytes (every tensor read per step, roofline's ``weight_mb``) + the KV
  of the requests still decoding (context tokens x ``2 x layers x kv_heads x head_dim x
  element size``);
* FLOP = ``2 x`` (layer linear parameters) per token through the layers, ``2 x`` (lm_head
  parameters) per output token, and attention ``4 x context x heads x head_dim x layers``
  per token (causal: context = position + 1).

With ``concurrency`` 1 the requests run one after another and the bound is the sum of
each one's. Bound tokens/s = output tokens / bound seconds; fraction = measured / bound
(1.0 = at the limit). The model shape is ``bench_peers.py``'s ``llama125m``.

Usage: ``.venv/bin/python benches/peers/workload_bound.py ROOFLINE.json PEERS.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_engine import workload  # noqa: E402

# llama125m (bench_peers.prepare_model): hidden 768, 12 layers, 12 / 4 heads of 64,
# intermediate 2048, vocab 32000, untied
HID, LAYERS, HQ, HKV, HD, INTER, VOCAB = 768, 12, 12, 4, 64, 2048, 32000
LAYER_LINEAR = LAYERS * (2 * HID * HQ * HD + 2 * HID * HKV * HD + 3 * HID * INTER)
HEAD_LINEAR = HID * VOCAB


def _attn_flop(ctx: int) -> float:
    return 4.0 * ctx * HQ * HD * LAYERS


def group_bound_s(
    reqs: list[tuple[int, int]], weight_bytes: float, elem: int, bw: float, peak: float
) -> float:
    """Bound in seconds of ``reqs`` (``(prompt, output)`` lengths) run together on the
    ideal schedule (module docstring); ``bw`` bytes/s, ``peak`` FLOP/s."""
    kv_tok = 2 * LAYERS * HKV * HD * elem
    pre = sum(
        2.0 * LAYER_LINEAR * p + 2.0 * HEAD_LINEAR + sum(_attn_flop(i + 1) for i in range(p))
        for p, _ in reqs
    )
    t = pre / peak
    for s in range(1, max(o for _, o in reqs)):
        live = [(p, o) for p, o in reqs if o > s]
        ctx = [p + s for p, _ in live]
        nbytes = weight_bytes + kv_tok * sum(ctx)
        flop = sum(2.0 * (LAYER_LINEAR + HEAD_LINEAR) + _attn_flop(c + 1) for c in ctx)
        t += max(nbytes / bw, flop / peak)
    return t


def main() -> None:
    roof = json.loads(Path(sys.argv[1]).read_text())
    res = json.loads(Path(sys.argv[2]).read_text())
    lim = roof["limits"][str(res["threads"])]
    wmb = {r["dtype"]: r["weight_mb"] for r in roof["rows"] if r["model"] == "llama125m"}
    work = workload(res["num_requests"])
    conc = res.get("concurrency") or len(work)
    if conc not in (1, len(work)):
        sys.exit("only concurrency 1 or all-at-once is bounded here")
    for m in res["models"]:
        bf16 = m["dtype"] == "bfloat16"
        peak = 1e9 * lim["matmul_bf16_gflop_s" if bf16 else "matmul_fp32_gflop_s"]
        args = (1e6 * wmb[m["dtype"]], 2 if bf16 else 4, 1e9 * lim["read_gb_s"], peak)
        groups = [[r] for r in work] if conc == 1 else [work]
        secs = sum(group_bound_s([(len(p), o) for p, o in g], *args) for g in groups)
        toks = sum(o for _, o in work)
        print(
            f"{m['model']} {res['threads']} thread(s): bound {secs:.2f} s = {toks / secs:.1f} tok/s"
        )
        for eng, e in m["engines"].items():
            if "tokens_per_s" in e:
                f = e["tokens_per_s"] / (toks / secs)
                print(f"  {eng}: {e['tokens_per_s']:.1f} tok/s = {f:.3f} of the bound")


if __name__ == "__main__":
    main()
