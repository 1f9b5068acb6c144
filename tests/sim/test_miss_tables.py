"""The cache-miss reason tables of ``kvpage simulate`` and ``kvpage replay``: reasons
aggregated over a Mooncake conversation trace, counts that add up, the tables printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpage.apps.replay import fit_trace, replay
from kvpage.cache.explain import MISS_REASONS
from kvpage.cli import main
from kvpage.engine import LLMEngine
from kvpage.sim.simulator import SimConfig, simulate
from kvpage.workload.traces import load_trace


def test_simulate_aggregates_reasons_small_vs_large_pool() -> None:
    trace = load_trace("mooncake-conv", limit=150)
    rows = {}
    for nb in (1200, 40000):  # blocks of 16: a small pool evicts what the next turn needs
        r = simulate(trace, SimConfig(policy="paged-prefix", num_blocks=nb))
        agg = r.miss_reasons
        assert set(agg) <= set(MISS_REASONS)
        assert sum(v["requests"] for v in agg.values()) == r.finished
        assert sum(v["missed_share"] for v in agg.values()) == pytest.approx(1.0)
        rows[nb] = agg
    small, large = rows[1200], rows[40000]
    assert small["evicted"]["requests"] > 0
    assert large.get("evicted", {"requests": 0})["requests"] < small["evicted"]["requests"]
    paged = simulate(trace, SimConfig(policy="paged", num_blocks=1200)).miss_reasons
    assert set(paged) == {"prefix_caching_disabled"}
    contiguous = simulate(trace, SimConfig(policy="contiguous-max")).miss_reasons
    assert contiguous == {}


def test_simulate_cli_prints_the_reason_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--trace", "mooncake-conv", "--limit", "150", "--policies"]
    assert main([*argv, "paged-prefix,contiguous-max", "--num-blocks", "1200"]) == 0
    out = capsys.readouterr().out
    assert "| policy | block | miss reason | requests | missed tokens | share | suggests |" in out
    assert "| paged-prefix | 16 | evicted |" in out
    assert "buy memory or add a host/disk tier" in out


def test_replay_summary_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = LLMEngine.from_config(block_size=16, num_blocks=40, max_num_seqs=8)
    trace = load_trace("mooncake-conv", limit=10)
    reqs = fit_trace(trace, max_model_len=512, vocab_size=512, output_scale=16)
    res = replay(engine, reqs, speedup=1000.0)
    agg = res.summary["miss_reasons"]
    assert sum(v["requests"] for v in agg.values()) == res.summary["completed"]
    missed = sum(v["missed_tokens"] for v in agg.values())
    assert missed == res.summary["prompt_tokens"] - sum(o.num_cached_tokens for o in res.outputs)
    out = tmp_path / "r.json"
    argv = ["replay", "--trace", "mooncake-conv", "--num-requests", "6", "--speedup", "1000"]
    rc = main([*argv, "--num-blocks", "40", "--no-progress", "--output", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["miss_reasons"] and sum(v["requests"] for v in s["miss_reasons"].values()) == 6
    assert (
        "| miss reason | requests | missed tokens | share | suggests |" in capsys.readouterr().out
    )
