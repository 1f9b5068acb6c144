"""KV tiers and swap in the simulator: the timing-free tier chain reduces to the LRU
study with one tier, never loses hits with more capacity, and the full simulator runs
the engine's tier and swap code with transfer costs."""

from __future__ import annotations

import pytest

from kvpage.errors import SpecError
from kvpage.sim.eviction import simulate_eviction
from kvpage.sim.simulator import SimConfig, simulate
from kvpage.sim.tiers import TRANSFER_PRESETS, get_transfer_preset, simulate_tiered_eviction
from kvpage.workload.traces import load_trace
from kvpage.workload.workloads import make_workload


@pytest.fixture(scope="module")
def trace():  # type: ignore[no-untyped-def]
    return load_trace("mooncake-conv", limit=1500)


def test_one_tier_is_the_lru_study(trace) -> None:  # type: ignore[no-untyped-def]
    for cap in (50, 400, None):
        a = simulate_tiered_eviction(trace, [cap]).block_hit_pct
        assert a == pytest.approx(simulate_eviction(trace, cap, "lru").block_hit_pct)


def test_more_tier_capacity_never_fewer_hits(trace) -> None:  # type: ignore[no-untyped-def]
    unbounded = simulate_tiered_eviction(trace, [None]).block_hit_pct
    prev = 0.0
    for caps in ([100], [100, 400], [100, 400, 1000], [100, 400, 4000]):
        r = simulate_tiered_eviction(trace, caps)
        assert prev <= r.block_hit_pct <= unbounded + 1e-9
        assert sum(r.block_hit_pct_by_tier.values()) == pytest.approx(r.block_hit_pct)
        prev = r.block_hit_pct
    assert prev > simulate_tiered_eviction(trace, [100]).block_hit_pct


def test_service_ttft_counts_transfers(trace) -> None:  # type: ignore[no-untyped-def]
    from kvpage.sim.simulator import build_setup

    spec, cost, _, _ = build_setup(SimConfig())
    slow = get_transfer_preset("pcie4-nvme")
    r = simulate_tiered_eviction(
        trace, [100, 400, 1000], cost=cost, block_bytes=512 * spec.bytes_per_token, preset=slow
    )
    assert r.transfer_s > 0 and r.ttft_s["p50"] <= r.ttft_s["p90"]


def test_full_simulator_with_tiers_and_swap() -> None:
    w = make_workload("multi-turn", 20, scale="gpu")  # small pool: turns evicted
    kw = dict(max_model_len=8192, num_blocks=400)
    base = simulate(w, SimConfig(**kw))  # type: ignore[arg-type]
    tiered = simulate(w, SimConfig(kv_host_tier_bytes=4 * 2**30, **kw))  # type: ignore[arg-type]
    assert tiered.finished == base.finished == 20
    assert tiered.prefix_hit_pct > base.prefix_hit_pct
    host = tiered.extra["tiers"]["host"]
    assert host["promotions"] > 0 and host["hits_tokens"] > 0
    assert tiered.extra["transfer_s"] > 0
    w = make_workload("long-long", 8, scale="gpu")
    kw = dict(max_model_len=8192, num_blocks=900)
    rec = simulate(w, SimConfig(**kw))  # type: ignore[arg-type]
    swp = simulate(
        w,
        SimConfig(preemption_mode="swap", swap_space_bytes=64 * 2**30, **kw),  # type: ignore[arg-type]
    )
    assert rec.preemptions > 0 and swp.extra["swap"]["swap_outs"] > 0
    assert swp.extra["swap"]["swap_ins"] == swp.extra["swap"]["swap_outs"]
    assert swp.finished == rec.finished == 8


def test_bad_tier_configs_refused() -> None:
    tr = load_trace("mooncake-conv", limit=3)
    with pytest.raises(SpecError, match="paged policy"):
        simulate(tr, SimConfig(policy="contiguous-max", kv_host_tier_bytes=1 << 30))
    with pytest.raises(SpecError, match="transfer preset"):
        simulate(tr, SimConfig(kv_host_tier_bytes=1 << 30, transfer_preset="carrier-pigeon"))
    with pytest.raises(SpecError, match="preemption_mode"):
        simulate(tr, SimConfig(preemption_mode="drop"))
    assert set(TRANSFER_PRESETS) >= {"pcie4-nvme", "pcie5-nvme"}


def test_simulate_cli_tier_and_swap_flags(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from kvpage.cli import main

    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", "mooncake-conv", "--limit", "4", "--max-model-len", "131072"]
    rc = main(
        argv
        + ["--policies", "paged-prefix", "--kv-host-tier-bytes", str(10**11)]
        + ["--preemption-mode", "swap", "--json", str(out)]
    )
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert "tiers" in row["extra"] and "swap" in row["extra"]
    assert main(argv + ["--policies", "paged", "--kv-host-tier-bytes", "100"]) == 2
    assert "expected --policies with paged-prefix" in capsys.readouterr().err
