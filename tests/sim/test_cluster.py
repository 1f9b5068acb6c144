"""The multi-instance simulator: routing code over N instances, events each step, and
``kvpage simulate --instances``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpage.cli import main
from kvpage.errors import SpecError
from kvpage.sim.cluster import simulate_cluster
from kvpage.sim.simulator import SimConfig
from kvpage.workload.traces import TraceRequest

# 5 conversations x 4 turns: each turn repeats the previous prompt and adds 2 hash blocks
# (32-token hash blocks), so a turn routed to its conversation's instance hits its prefix;
# round robin over 3 instances sends turn t of conversation c to instance (c + 5t) mod 3
CONV = [
    TraceRequest(
        index=c * 4 + t,
        arrival_s=0.05 * (c + 5 * t),
        prompt_tokens=64 * (t + 1),
        output_tokens=2,
        hash_ids=tuple(range(1000 * c, 1000 * c + 2 * (t + 1))),
    )
    for t in range(4)
    for c in range(5)
]
CFG = SimConfig(block_size=16, num_blocks=200, max_model_len=1024, max_num_batched_tokens=512)


def _run(router: str, **kw):
    from kvpage.workload.traces import Trace

    tr = Trace("conv", "", "synthetic", sorted(CONV, key=lambda r: r.arrival_s), 32)
    return simulate_cluster(tr, CFG, instances=3, router=router, **kw)


def test_kv_precise_follows_the_blocks_round_robin_does_not() -> None:
    rr, kv, orc = _run("round_robin"), _run("kv_precise"), _run("oracle")
    for r in (rr, kv, orc):
        assert r.finished == len(CONV) and r.rejected == {}
        assert sum(r.finished_per_instance) == len(CONV)
        assert r.index["gaps"] == 0 and r.index["joins"] == 3
        assert r.index["batches_applied"] > 0
    assert kv.prefix_hit_pct > rr.prefix_hit_pct
    assert kv.prefix_hit_pct >= 0.9 * orc.prefix_hit_pct
    assert kv.extra["routes_with_matched_blocks"] == 15  # every later turn found its blocks
    assert set(kv.ttft_s) >= {"p50", "p90", "p99"} and kv.imbalance >= 1.0


def test_event_delay_is_lag_and_every_policy_runs() -> None:
    late = _run("kv_precise", event_delay_s=0.5)
    assert late.index["max_lag_s"] == pytest.approx(0.5)
    for name in ("power_of_two", "prefix_approx"):
        assert _run(name).finished == len(CONV)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SpecError, match="instances"):
        simulate_cluster(CONV, CFG, instances=0, router="kv_precise")
    with pytest.raises(SpecError, match="router"):
        simulate_cluster(CONV, CFG, instances=2, router="fastest")
    with pytest.raises(SpecError, match="paged-prefix"):
        simulate_cluster(CONV, SimConfig(policy="paged"), instances=2, router="oracle")


def test_simulate_cli_instances(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.json"
    args = ["simulate", "--trace", "mooncake-conv", "--limit", "12", "--instances", "2"]
    args += ["--router", "round_robin,kv_precise", "--max-output-tokens", "4"]
    args += ["--max-model-len", "131072", "--block-sizes", "64", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| router | N | done |" in text and "| kv_precise | 2 | 12 |" in text
    rows = json.loads(out.read_text())
    assert [r["router"] for r in rows] == ["round_robin", "kv_precise"]
    assert all(r["instances"] == 2 and r["finished"] == 12 for r in rows)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--instances", "0"], "--instances: expected an int in [1, 256]"),
        (["--instances", "100000"], "--instances: expected an int in [1, 256]"),
        (["--instances", "2", "--router", "nope"], "--router: expected"),
        (["--instances", "2", "--policies", "paged"], "--policies: expected 'paged-prefix'"),
        (["--router", "kv_precise"], "--router/--event-delay: expected only with --instances"),
        (["--router", "all"], "--router/--event-delay: expected only with --instances"),
        (["--max-output-tokens", "0"], "--max-output-tokens: expected an int >= 1"),
    ],
)
def test_simulate_cli_instances_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--trace", "azure-code", "--limit", "3", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
