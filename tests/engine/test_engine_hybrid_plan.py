"""Hybrid presets and their memory accounting: exact KV bytes per token (attention
layers only) and recurrent-state bytes per sequence of the Qwen3-Next-80B-A3B,
Nemotron-H-8B and Granite-4.0-H-Tiny presets by hand from their configs; ``kvpage plan``
splitting the budget as the engine does; the engine's allocated KV and state tensors
within ``kv_cache_memory_bytes`` with the same slot counts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpage.cache.state_pool import snapshot_slots_for, split_state_memory
from kvpage.capacity import plan_capacity
from kvpage.errors import SpecError
from kvpage.specs import load_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

GIB = 1 << 30


def _mamba2_bytes(heads: int, hd: int, d_state: int, groups: int, kernel: int, el: int) -> int:
    conv_dim = heads * hd + 2 * groups * d_state  # x, B, C through the conv1d
    return conv_dim * (kernel - 1) * el + heads * hd * d_state * el


#: preset -> (state layers, state bytes per sequence by hand, bf16)
HAND = {
    # 36 Gated DeltaNet layers: conv over q, k (16 x 128 each) and v (32 x 128), kernel
    # 4; a 128 x 128 matrix per value head
    "qwen3-next-80b-a3b": (36, 36 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 2)),
    # 24 Mamba-2 layers: 128 heads x 64, d_state 128, 8 groups, kernel 4
    "nemotron-h-8b": (24, 24 * _mamba2_bytes(128, 64, 128, 8, 4, 2)),
    # 36 Mamba-2 layers: 48 heads x 64, d_state 128, 1 group, kernel 4
    "granite-4.0-h-tiny": (36, 36 * _mamba2_bytes(48, 64, 128, 1, 4, 2)),
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_presets_state_bytes_by_hand(name: str) -> None:
    spec = load_preset(name).cache_spec()
    n, want = HAND[name]
    assert len(spec.state_layers) == n
    assert spec.state_bytes_per_sequence == want
    assert all(s.dtype == "bfloat16" and s.ssm_dtype == "bfloat16" for s in spec.state_layers)


def test_qwen3_next_numbers() -> None:
    spec = load_preset("qwen3-next-80b-a3b").cache_spec()
    assert spec.bytes_per_token == 24_576  # 12 x 2 x 256 x (K + V) x 2 bytes
    assert spec.state_bytes_per_sequence == 39_518_208  # ~1,608 tokens of KV
    # one sequence's recurrent state is as large as this many tokens of all its KV
    assert spec.state_bytes_per_sequence // spec.bytes_per_token == 1608


def test_plan_splits_budget_as_the_engine() -> None:
    p = plan_capacity("qwen3-next-80b-a3b", device_bytes="80GiB", weight_dtype="int4")
    spec = load_preset("qwen3-next-80b-a3b").cache_spec()
    S, bpb = spec.state_bytes_per_sequence, spec.bytes_per_block
    budget = int(80 * GIB * 0.9) - 40_000_000_000
    assert p.kv_budget_bytes == budget and p.state_bytes_per_sequence == S
    rest = budget - 256 * S
    snap = int(rest * 0.1)
    blocks = (rest - snap - spec.fixed_scale_bytes) // bpb
    assert p.num_blocks == blocks == 62_239
    assert p.state_live_slots == 256
    assert p.state_snapshot_slots == min(snap // S, blocks - 1) == 68
    assert p.state_snapshot_bytes == 68 * S
    per_seq = math.ceil(262_144 / 16) * bpb + S
    assert p.state_seqs_that_fit == (budget - spec.fixed_scale_bytes) // per_seq == 5
    # the accounting adds up: live + snapshots + KV blocks within the budget
    assert 256 * S + p.state_snapshot_bytes + p.num_blocks * bpb <= budget
    with pytest.raises(SpecError, match="tp"):
        plan_capacity("qwen3-next-80b-a3b", device_bytes="80GiB", weight_dtype="int4", tp=2)
    with pytest.raises(SpecError, match="live recurrent states"):
        plan_capacity("nemotron-h-8b", device_bytes="24GiB")
    q = plan_capacity("nemotron-h-8b", device_bytes="24GiB", max_num_seqs=32)
    assert q.state_live_slots == 32 and q.bytes_per_token == 16_384


def test_plan_cli_shows_state_rows() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpage", "plan", "--model", "granite-4.0-h-tiny",
         "--memory", "24GiB", "--max-model-len", "32768", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    d = json.loads(out.stdout)
    assert d["state_bytes_per_sequence"] == HAND["granite-4.0-h-tiny"][1]
    assert d["bytes_per_token"] == 8192 and d["num_state_layers"] == 36
    assert d["state_seqs_that_fit"] == 30


def test_engine_allocates_within_the_budget(tmp_path: Any) -> None:
    from test_models_hybrid import make_hf

    from kvpage.engine import LLM

    hf = make_hf("qwen3_next", max_position_embeddings=512)
    hf.save_pretrained(tmp_path)
    budget = 3_000_000
    llm = LLM(model=str(tmp_path), kv_cache_memory_bytes=budget, max_num_seqs=8, block_size=16)
    eng = llm.llm_engine
    spec = eng.cache_spec
    S = spec.state_bytes_per_sequence
    kv_bytes, snap_bytes = split_state_memory(budget, S, 8, 0.1)
    assert spec.num_blocks == (kv_bytes - spec.fixed_scale_bytes) // spec.bytes_per_block
    pool = eng.kv_cache_manager.state
    assert pool is not None and pool.num_live_slots == 8
    assert pool.num_snapshot_slots == snapshot_slots_for(
        S, 0.1, spec.num_blocks - 1, snapshot_bytes=snap_bytes
    )
    runner = eng.runner
    assert runner.state_caches is not None
    state_nbytes = sum(c.conv.nbytes + c.ssm.nbytes for c in runner.state_caches)
    assert state_nbytes == pool.num_slots * S  # exact: the planner's bytes per slot
    kv_nbytes = sum(c.kv.nbytes for c in runner.kv_caches)
    assert kv_nbytes == spec.num_blocks * spec.bytes_per_block
    assert kv_nbytes + state_nbytes <= budget


def test_plan_recurrent_only_model(tmp_path: Any) -> None:
    cfg = dict(
        model_type="mamba2", hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64,
        state_size=128, n_groups=1, conv_kernel=4, expand=2, vocab_size=50288,
        max_position_embeddings=4096, torch_dtype="bfloat16",
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = plan_capacity(str(tmp_path), device_bytes="8GiB", weight_bytes="1GiB", max_num_seqs=16)
    S = 64 * _mamba2_bytes(80, 64, 128, 1, 4, 2)
    assert p.state_bytes_per_sequence == S and p.num_kv_groups == 0 and p.bytes_per_token == 0
    assert p.tokens_unbounded and p.num_blocks == 2
    rest = p.kv_budget_bytes - 16 * S
    assert p.state_snapshot_slots == int(rest * 0.1) // S  # no KV block caps them
    assert p.state_seqs_that_fit == p.kv_budget_bytes // S
    with pytest.raises(SpecError, match="workload"):
        from kvpage.capacity import Workload

        plan_capacity(
            str(tmp_path), device_bytes="8GiB", weight_bytes="1GiB", max_num_seqs=16,
            workload=Workload.from_percentiles((10, 20, 30), (10, 20, 30)),
        )  # fmt: skip


@pytest.mark.parametrize(
    "name, memory, seqs",
    [
        ("qwen3-next-80b-a3b", "80GiB", 256),
        ("nemotron-h-8b", "24GiB", 32),
        ("granite-4.0-h-tiny", "24GiB", 256),
    ],  # fmt: skip
)
def test_plan_host_snapshot_rows_for_the_hybrid_presets(name: str, memory: str, seqs: int) -> None:
    """With a host KV tier the plan reports the host snapshot rows the engine gives the
    StatePool: floor(host tier bytes x state_snapshot_share) // state bytes (by hand from
    the presets' state bytes), host memory beside the tier, none without a tier."""
    kw: dict[str, Any] = dict(device_bytes=memory, max_num_seqs=seqs, max_model_len=8192)
    if name == "qwen3-next-80b-a3b":
        kw["weight_dtype"] = "int4"
    off = plan_capacity(name, **kw)
    assert off.kv_host_tier_bytes == 0 and off.state_host_snapshot_rows == 0
    on = plan_capacity(name, kv_host_tier_bytes="64GiB", **kw)
    S = HAND[name][1]
    rows = int(64 * GIB * 0.1) // S
    assert on.kv_host_tier_bytes == 64 * GIB and on.state_snapshot_slots > 0
    assert on.state_host_snapshot_rows == rows and on.state_host_snapshot_bytes == rows * S
    # the device side does not change: the rows are host memory
    assert (on.num_blocks, on.state_snapshot_slots) == (off.num_blocks, off.state_snapshot_slots)
    if name == "qwen3-next-80b-a3b":
        assert rows == 173  # 6,871,947,673 // 39,518,208
    half = plan_capacity(name, kv_host_tier_bytes="64GiB", state_snapshot_share=0.05, **kw)
    assert half.state_host_snapshot_rows == int(64 * GIB * 0.05) // S
    with pytest.raises(SpecError, match="kv_host_tier_bytes"):
        plan_capacity(name, kv_host_tier_bytes="-1GiB", **kw)


def test_plan_cli_shows_host_snapshot_rows() -> None:
    args = [sys.executable, "-m", "kvpage", "plan", "--model", "qwen3-next-80b-a3b",
            "--memory", "80GiB", "--weight-dtype", "int4", "--kv-host-tier-bytes", "64GiB"]  # fmt: skip
    table = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "host snapshot rows" in table and "173 / 6.37 GiB" in table
    d = json.loads(subprocess.run(args + ["--json"], capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert d["state_host_snapshot_rows"] == 173
    assert d["state_host_snapshot_bytes"] == 173 * 39_518_208
    plain = subprocess.run(args[:-2], capture_output=True, text=True, check=True).stdout
    assert "host snapshot rows" not in plain


def test_plan_host_snapshot_rows_equal_the_engines_pool(tmp_path: Any) -> None:
    """A tiny random qwen3_next: the plan of a budget (utilization 1, no weights) gives
    the KV blocks, snapshot slots and host snapshot rows the engine builds for the same
    kv_cache_memory_bytes and host tier, and the rows' bytes equal the engine's host
    StateCache tensors (exact)."""
    from test_models_hybrid import make_hf

    from kvpage.engine import LLM

    hf = make_hf("qwen3_next", max_position_embeddings=512)
    hf.save_pretrained(tmp_path)
    budget, host = 3_000_000, 1_500_000
    llm = LLM(
        model=str(tmp_path),
        kv_cache_memory_bytes=budget,
        max_num_seqs=8,
        block_size=16,
        kv_host_tier_bytes=host,
    )
    eng = llm.llm_engine
    pool = eng.kv_cache_manager.state
    assert pool is not None
    p = plan_capacity(
        str(tmp_path),
        device_bytes=budget,
        utilization=1.0,
        weight_bytes=0,
        max_num_seqs=8,
        kv_host_tier_bytes=host,
    )
    S = eng.cache_spec.state_bytes_per_sequence
    assert p.state_bytes_per_sequence == S and p.num_blocks == eng.cache_spec.num_blocks
    assert p.state_snapshot_slots == pool.num_snapshot_slots > 0
    assert p.state_host_snapshot_rows == pool.num_host_snapshots == int(host * 0.1) // S > 0
    hosts = eng.runner.state_host_caches
    assert hosts is not None and all(c.conv.device.type == "cpu" for c in hosts)
    assert sum(c.conv.nbytes + c.ssm.nbytes for c in hosts) == p.state_host_snapshot_bytes
