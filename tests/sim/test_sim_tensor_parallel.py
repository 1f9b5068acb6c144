"""One tensor-parallel rank in the simulator (``SimConfig.tp``): DeepSeek-V3 (671e9
parameters, FP8) does not fit one 80 GB device, 1/16 of it does; its MLA latent is not
split over the ranks (``kvpage.capacity.shard_cache_spec``), so every rank holds
70,272 bytes per token (61 layers x 576 x 2) and the tokens that fit are the rank's KV
budget over that (issue 25's accounting for DeepSeek-V3)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpage.capacity import resolve_model
from kvpage.errors import SpecError
from kvpage.sim.simulator import SimConfig, active_parameters, build_setup, simulate
from kvpage.workload.trace_types import TraceRequest
from kvpage.workload.workload_stats import max_sequence_tokens

TP = 16
WEIGHTS = 671_000_000_000  # FP8: one byte per parameter


def _cfg(**kw: object) -> SimConfig:
    return SimConfig(
        model="deepseek-v3",
        weight_bytes=WEIGHTS,
        tp=TP,
        max_model_len=131072,
        **kw,  # type: ignore[arg-type]
    )


def test_deepseek_v3_rank_holds_the_whole_latent() -> None:
    spec, cost, mml, slots = build_setup(_cfg())
    assert spec.bytes_per_token == 61 * 576 * 2 == 70_272
    assert len(spec.kv_groups) == 1 and spec.layers[0].num_q_heads == 128 // TP
    budget = int(80e9 * 0.9) - -(-WEIGHTS // TP)
    bound = budget // 70_272  # tokens the rank's KV budget holds without blocks
    assert spec.num_blocks == budget // (70_272 * 16)
    fit = max_sequence_tokens(spec, spec.num_blocks - 1)
    assert fit == (spec.num_blocks - 1) * 16 == slots
    assert bound - 2 * 16 < fit <= bound
    assert mml == 131072


def test_deepseek_v3_rank_costs_a_share_of_the_model() -> None:
    _, cost, _, _ = build_setup(_cfg())
    src = resolve_model("deepseek-v3")
    # 58 MoE layers (first_k_dense_replace 3 of 61) x 248 idle routed experts of
    # 3 x 7168 x 2048 (gate, up, down); the shared expert and the router are active
    act = active_parameters(src.hf_config, src.num_parameters)
    assert act == src.num_parameters - 58 * 248 * 3 * 7168 * 2048 == 37_552_297_472
    assert cost.active_parameters == -(-act // TP)
    assert cost.num_parameters == -(-src.num_parameters // TP)
    assert cost.weight_bytes == -(-WEIGHTS // TP)
    assert cost.num_q_heads == 128 // TP and cost.kv_bytes_per_token == 70_272
    # 8 x H200: half the ranks, twice the share each
    half = build_setup(replace(_cfg(), tp=8, gpu="H200"))[1]
    assert half.weight_bytes == -(-WEIGHTS // 8) and half.active_parameters == -(-act // 8)


def test_tp_refused_by_name() -> None:
    with pytest.raises(SpecError, match="tp"):
        build_setup(SimConfig(model="deepseek-v3", weight_bytes=WEIGHTS, tp=0))
    with pytest.raises(SpecError, match="device_bytes"):  # 671e9 x 2 bytes on one rank
        build_setup(SimConfig(model="deepseek-v3"))
    with pytest.raises(SpecError, match="tp"):  # recurrent states are not sharded
        build_setup(SimConfig(model="qwen3-next-80b-a3b", weight_bytes=40 * 10**9, tp=2))


def test_tp_1_is_the_single_device_setup() -> None:
    a = build_setup(SimConfig(model="llama-3-8b"))
    b = build_setup(SimConfig(model="llama-3-8b", tp=1))
    assert a[0] == b[0] and a[1] == b[1] and a[2:] == b[2:]


def test_deepseek_v3_simulates_long_requests_on_one_rank() -> None:
    reqs = [TraceRequest(i, 0.0, 8192, 8) for i in range(3)]
    r = simulate(reqs, _cfg(policy="paged"))
    assert r.finished == 3 and r.preemptions == 0 and r.peak_batch == 3


def test_simulate_cli_tp_flag(tmp_path, capsys) -> None:
    """``kvpage simulate --tp 16 --weight-bytes 671e9``: one rank of DeepSeek-V3 runs;
    without --tp it is refused with the planner's one-line error (exit 2)."""
    from kvpage.cli import main

    tr = tmp_path / "t.csv"
    tr.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,300,4\n")
    out = tmp_path / "r.json"
    base = ["simulate", "--trace", str(tr), "--model", "deepseek-v3", "--policies", "paged"]
    assert main([*base, "--weight-bytes", "671e9", "--tp", "16", "--json", str(out)]) == 0
    assert '"finished": 1' in out.read_text()
    assert main([*base, "--tp", "0", "--weight-bytes", "671e9"]) == 2
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "tp: expected an int >= 1, got 0" in err and "device_bytes: expected room" in err
    assert "Traceback" not in err
