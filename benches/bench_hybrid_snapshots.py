"""Recurrent-state prefix caching on a hybrid model (issue 26): kvpage's snapshot policy
vs an emulation of vLLM's block-aligned policy vs the attention-only bound, simulated.

Model: a Qwen3-Next-80B-A3B-like config (:data:`QWEN3_NEXT_80B`: the published
``Qwen/Qwen3-Next-80B-A3B-Instruct`` config.json values; ``layer_types`` written out by
``Qwen3NextConfig``'s rule, every ``full_attention_interval``-th layer full attention):
12 gated full-attention layers (2 KV heads x 256) and 36 Gated DeltaNet layers, whose
state per sequence comes from ``kvpage.specs.state`` (conv ``8192 x 3`` + SSM
``32 x 128 x 128`` per layer, bf16: 39,518,208 bytes). Weights: 80e9 parameters (model
card) at 4 bits (an int4 checkpoint, 40 GB: bf16's 160 GB does not fit one 80 GB
device); 3e9 active parameters (model card) for the FLOPs. One H100-80GB, 90 %
utilization, ``max_num_seqs`` 64, the Mooncake conversation trace (first
:data:`MOONCAKE_N` requests, ``--limit``, at their own arrival times x ``--time-scale``),
policy ``paged-prefix``.

Rows (the real scheduler, ``KVCacheManager`` and ``kvpage.cache.state_pool.StatePool``
with ``kvpage.cache.snapshot_policy.SnapshotPolicy``, as the engine):

* **kvpage**: block size 16, snapshots at the last full-block boundary of each prompt,
  the rolling decode boundary (the finished sequence's last full block) and
  predicted-shared boundaries; ``state_snapshot_share`` of the memory after the live
  states holds snapshots.
* **vLLM-aligned (emulated)**: the same machinery with the attention block size raised
  as vLLM does for hybrids so one attention page holds one layer's state: the smallest
  multiple of 16 with ``block_size x KV bytes per token of one attention layer >=
  state bytes of one recurrent layer`` (:func:`vllm_block_size`; 544 here; vLLM issues
  #51250, #54504 report >= 528), so a hit ends only at those aligned boundaries. It is
  generous to vLLM: it gets kvpage's snapshot slots and policy, only the granularity
  differs.
* **attention-only bound**: block size 16, state free (no state memory, every KV
  prefix hit usable; the same KV blocks as the kvpage row).

Reported: prefix hit ratio (prompt tokens served from the cache at first admission /
prompt tokens), TTFT p50/p90 and output tok/s (cost model), snapshots taken/hit and the
snapshot memory share.

Host tier (``--kv-host-tier-bytes X``, e.g. ``64GiB``): every row runs without and with
a host KV tier of ``X`` bytes (transfer preset ``pcie5-nvme``, 50 GB/s host link); on the
hybrid rows the pool then also has the engine's host snapshot rows
(``kvpage.capacity.host_snapshot_rows``: ``floor(X x state_snapshot_share) // state
bytes``), where evicted snapshots go. Reported instead: snapshot slots / host rows,
snapshot hits from the device / the host, prompt tokens whose KV came from the host
tier, and the state slot copies' share of all step time
(``kvpage.sim.tiers.StateCopyMeter``: device copies at the achieved HBM bandwidth, host
rows at the host link).

``--no-decode-snapshots`` runs every row with ``state_decode_snapshots=False`` (no
rolling decode snapshots: in this simulation generated tokens never return in a later
prompt, so those snapshots cannot hit); ``--policies`` picks the rows.

Run: ``.venv/bin/python benches/bench_hybrid_snapshots.py [--limit N]
[--kv-host-tier-bytes 64GiB] [--no-decode-snapshots] [--policies kvpage,aligned]``
(Markdown).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpage.capacity import parse_bytes
from kvpage.sim.simulator import SimConfig, SimResult, simulate
from kvpage.specs import CacheSpec
from kvpage.workload.traces import load_trace

#: Qwen/Qwen3-Next-80B-A3B-Instruct config.json (Hugging Face) values; ``layer_types``
#: expanded from ``full_attention_interval`` (Qwen3NextConfig.__init__, transformers 5.23)
QWEN3_NEXT_80B: dict[str, Any] = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(48)],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
NUM_PARAMETERS = 80_000_000_000  # model card: 80B total
ACTIVE_PARAMETERS = 3_000_000_000  # model card: 3B activated
WEIGHT_BYTES = NUM_PARAMETERS // 2  # 4-bit weights
MOONCAKE_N = 400
MAX_NUM_SEQS = 64


def write_preset(folder: Path) -> str:
    """The config as a preset file (``kvpage.specs.presets``) for ``SimConfig.model``."""
    path = folder / "qwen3-next-80b-a3b.json"
    path.write_text(
        json.dumps(
            dict(
                name="qwen3-next-80b-a3b",
                source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json; 80B parameters",
                num_parameters=NUM_PARAMETERS,
                max_model_len=QWEN3_NEXT_80B["max_position_embeddings"],
                hf_config=QWEN3_NEXT_80B,
            )
        )
    )
    return str(path)


def vllm_block_size(spec: CacheSpec, align: int = 16) -> int:
    """vLLM's hybrid attention block size: the smallest multiple of ``align`` whose page
    of one attention layer (``block_size x layer KV bytes per token``) holds one
    recurrent layer's state (the largest, ``StateSpec.bytes``)."""
    per_token = spec.layer_bytes_per_token(0)
    state = max(s.bytes for s in spec.state_layers)
    return -(-state // (align * per_token)) * align


def config(model: str, block_size: int, mode: str, **kw: Any) -> SimConfig:
    return SimConfig(
        model=model,
        gpu="H100-80GB",
        policy="paged-prefix",
        block_size=block_size,
        weight_bytes=WEIGHT_BYTES,
        active_parameters=ACTIVE_PARAMETERS,
        max_num_seqs=MAX_NUM_SEQS,
        recurrent_state=mode,
        **kw,
    )


def row(name: str, bs: int, r: SimResult) -> list[Any]:
    st = r.extra.get("state", {})
    return [
        name,
        bs,
        f"{r.finished}/{r.requests}",
        f"{r.prefix_hit_pct:.1f}",
        f"{r.ttft_s.get('p50', 0.0):.3f}",
        f"{r.ttft_s.get('p90', 0.0):.3f}",
        f"{r.throughput_tok_s:,.0f}",
        st.get("snapshot_slots", "-"),
        st.get("snapshots_taken", "-"),
        st.get("snapshot_hits", "-"),
        f"{st['snapshot_memory_share_pct']:.1f}" if st else "-",
    ]


def host_row(name: str, bs: int, host_b: int, r: SimResult) -> list[Any]:
    """One row of the host-tier table (module docstring)."""
    st = r.extra.get("state", {})
    tier = r.extra.get("tiers", {}).get("host", {})
    copies = st.get("copies", {})
    return [
        name,
        bs,
        f"{host_b / (1 << 30):g} GiB" if host_b else "none",
        f"{r.finished}/{r.requests}",
        f"{r.prefix_hit_pct:.1f}",
        f"{r.ttft_s.get('p50', 0.0):.3f}",
        f"{r.ttft_s.get('p90', 0.0):.3f}",
        f"{r.throughput_tok_s:,.0f}",
        f"{st['snapshot_slots']} / {st['host_snapshot_rows']}" if st else "-",
        f"{st['snapshot_hits_device']} / {st['snapshot_hits_host']}" if st else "-",
        f"{tier.get('hits_tokens', 0):,}" if host_b else "-",
        f"{copies['copy_time_share_pct']:.2f}" if copies else "-",
        r.preemptions,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=MOONCAKE_N, help="first N trace requests")
    ap.add_argument("--share", type=float, default=0.1, help="state_snapshot_share")
    ap.add_argument("--time-scale", type=float, default=1.0, help="> 1 stretches arrivals")
    ap.add_argument(
        "--kv-host-tier-bytes",
        default="0",
        help="host KV tier (64GiB, bytes; 0 = none): each row without and with it",
    )
    ap.add_argument(
        "--no-decode-snapshots",
        action="store_true",
        help="state_decode_snapshots=False (no rolling decode snapshots) in every row",
    )
    ap.add_argument(
        "--policies",
        default="kvpage,aligned,bound",
        help="rows to run, comma-separated: kvpage, aligned, bound",
    )
    args = ap.parse_args()
    wanted = set(args.policies.split(","))
    if not wanted or not wanted <= {"kvpage", "aligned", "bound"}:
        ap.error(f"--policies: expected some of kvpage, aligned, bound; got {args.policies!r}")
    host_b = parse_bytes(args.kv_host_tier_bytes, "--kv-host-tier-bytes")
    trace = load_trace("mooncake-conv", limit=args.limit)
    with tempfile.TemporaryDirectory() as d:
        model = write_preset(Path(d))
        spec = CacheSpec.from_hf_config(QWEN3_NEXT_80B)
        vbs = vllm_block_size(spec)
        print(
            f"# state bytes/sequence {spec.state_bytes_per_sequence:,}; KV bytes/token "
            f"{spec.bytes_per_token:,}; vLLM block size {vbs}",
            file=sys.stderr,
        )
        rows = []
        for key, name, bs, mode in (
            ("kvpage", "kvpage", 16, "snapshots"),
            ("aligned", "vLLM-aligned (emulated)", vbs, "snapshots"),
            ("bound", "attention-only bound", 16, "free"),
        ):
            if key not in wanted:
                continue
            for tier in (0, host_b) if host_b else (0,):
                t0 = time.perf_counter()
                cfg = config(model, bs, mode, state_snapshot_share=args.share)
                cfg.time_scale = args.time_scale
                cfg.kv_host_tier_bytes = tier
                cfg.state_decode_snapshots = not args.no_decode_snapshots
                r = simulate(trace, cfg)
                took = time.perf_counter() - t0
                print(f"# {name} host {tier}: {took:.1f} s {r.extra}", file=sys.stderr)
                rows.append(host_row(name, bs, tier, r) if host_b else row(name, bs, r))
    print(
        f"python {platform.python_version()}, {platform.machine()}; {args.limit} requests, "
        f"time scale {args.time_scale}, snapshot share {args.share}"
        + (", no decode snapshots" if args.no_decode_snapshots else "")
        + (f", host tier {args.kv_host_tier_bytes}" if host_b else "")
    )
    if host_b:
        print("| policy | block size | host tier | finished | prefix hit % | TTFT p50 s | TTFT p90 s | output tok/s | snapshot slots / host rows | snapshot hits device / host | KV hit tokens from host tier | state copy time % | preemptions |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| policy | block size | finished | prefix hit % | TTFT p50 s | TTFT p90 s | output tok/s | snapshot slots | snapshots taken | snapshot hits | snapshot memory % |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print("| " + " | ".join(str(v) for v in x) + " |")


if __name__ == "__main__":
    main()
