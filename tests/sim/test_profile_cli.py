"""Trace profiling (checked against /work/shared/traces/README.md) and the CLI handlers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpage.cli import main
from kvpage.sim.profile import arrival_stats, prefix_stats, profile_trace
from kvpage.workload.traces import Trace, TraceRequest, load_trace


def test_mooncake_prefix_statistics_match_published():
    prof = profile_trace(load_trace("mooncake-conv"))
    pre = prof["prefix"]
    expect = {
        "first_1_shared_pct": 100.00,
        "first_2_shared_pct": 57.49,
        "first_4_shared_pct": 46.80,
        "causal_ge_1_pct": 99.99,
        "causal_ge_2_pct": 38.72,
        "causal_block_hit_pct": 36.64,
        "causal_token_hit_pct": 37.36,
        "blocks_per_request_p50": 14,
        "unique_blocks": 182790,
        "block_references": 288500,
    }
    for k, v in expect.items():
        assert pre[k] == pytest.approx(v, abs=0.006), k
    assert prof["arrivals"]["mean_rate_rps"] == pytest.approx(3.40, abs=0.005)


def test_azure_rates_match_published():
    assert profile_trace(load_trace("azure-conv"))["arrivals"]["mean_rate_rps"] == pytest.approx(
        5.53, abs=0.005
    )
    p = profile_trace(load_trace("azure-code"))
    assert p["arrivals"]["mean_rate_rps"] == pytest.approx(2.57, abs=0.005)
    assert p["prefix"] == {}
    assert p["output_tokens"]["mean"] == pytest.approx(27.9, abs=0.05)


def test_arrival_stats_by_hand():
    s = arrival_stats(np.array([0.0, 1.0, 2.0, 3.0, 100.0]))
    assert s["span_s"] == 100.0
    assert s["peak_1min_rate_rps"] == pytest.approx(4 / 60)
    gaps = np.array([1, 1, 1, 97.0])
    assert s["interarrival_cv"] == pytest.approx(gaps.std() / gaps.mean())
    even = arrival_stats(np.arange(0.0, 10.0))
    assert even["interarrival_cv"] == 0.0


def test_prefix_stats_by_hand():
    reqs = [
        TraceRequest(0, 0.0, 1024, 1, (1, 2)),
        TraceRequest(1, 1.0, 1500, 1, (1, 2, 3)),  # 2 leading hits
        TraceRequest(2, 2.0, 100, 1, (9,)),  # miss
    ]
    s = prefix_stats(Trace("t", "", "mooncake", reqs))
    assert s["causal_block_hit_pct"] == pytest.approx(100 * 2 / 6)
    assert s["causal_token_hit_pct"] == pytest.approx(100 * 1024 / 2624)
    assert s["causal_ge_2_pct"] == pytest.approx(100 / 3)
    assert s["first_2_shared_pct"] == pytest.approx(200 / 3)


def test_cli_plan_profile(tmp_path, capsys):
    assert main(["plan", "--model", "llama-3-8b", "--memory", "80GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bytes_per_token"] == 131072
    rc = main(["plan", "--model", "llama-3-8b", "--memory", "80GiB", "--tp", "16"])
    assert rc == 2 and "num_kv_heads=8" in capsys.readouterr().err
    rc = main(
        [
            "plan",
            "--model",
            "stories260K",
            "--memory",
            "1GiB",
            "--prompt-pct",
            "100,400,500",
            "--output-pct",
            "50,200,300",
            "--num-seqs",
            "8",
        ]
    )
    assert rc == 0 and "max_model_len_for_num_seqs" in capsys.readouterr().out
    js = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--trace",
            "azure-code",
            "--limit",
            "500",
            "--json",
            str(js),
            "--plots",
            str(tmp_path / "az"),
        ]
    )
    assert rc == 0 and json.loads(js.read_text())["arrivals"]["requests"] == 500
    assert (tmp_path / "az" / "azure-code_lengths.png").stat().st_size > 1000
    assert (tmp_path / "az" / "azure-code_arrivals.png").stat().st_size > 1000
    assert main(["profile", "--trace", "nope"]) == 2
