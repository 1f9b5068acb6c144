"""KV tiers on the bundled model: greedy output identical with tiers on and off (host
tier, disk tier, and across a restart with the disk tier), hits counted per tier in
RequestOutput and metrics, config refused by name, CLI flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpage.engine import LLM, SamplingParams
from kvpage.errors import SpecError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 6 distinct 50-token prompts (3 full blocks of 16 each): 6 * 4 blocks > the 9-block pool
PROMPTS = [[1 + (i * 37 + j * 11) % 500 for j in range(50)] for i in range(6)]
# second round: each prompt plus a follow-up turn (a conversation's next request)
FOLLOW = [p + [7, 8, 9, 10, 11] for p in PROMPTS]


def run(llm: LLM) -> tuple[list[list[int]], dict[str, int]]:
    outs, by_tier = [], {"device": 0, "host": 0, "disk": 0}
    for prompts in (PROMPTS, FOLLOW):
        for p in prompts:  # one at a time: every request's blocks are evicted later
            (o,) = llm.generate([p], GREEDY, use_tqdm=False)
            outs.append(list(o.outputs[0].token_ids))
            assert sum(o.num_cached_tokens_by_tier.values()) == o.num_cached_tokens
            for k, v in o.num_cached_tokens_by_tier.items():
                by_tier[k] += v
    llm.llm_engine.kv_cache_manager.check_integrity()
    return outs, by_tier


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    outs, by_tier = run(LLM("stories260K", block_size=16, num_blocks=10))
    assert by_tier["host"] == by_tier["disk"] == 0
    return outs


def test_host_tier_same_greedy_output_and_hits(baseline: list[list[int]]) -> None:
    llm = LLM("stories260K", block_size=16, num_blocks=10, kv_host_tier_bytes=1 << 22)
    outs, by_tier = run(llm)
    assert outs == baseline
    assert by_tier["host"] >= 5 * 48  # follow-ups find their prompt's blocks in host
    m = llm.get_metrics()
    assert m["kvpage:kv_tier_host_hit_tokens_total"] == by_tier["host"]
    assert m["kvpage:kv_tier_host_promotions_total"] > 0
    assert m["kvpage:kv_tier_host_usage_bytes"] <= 1 << 22
    assert "kvpage:kv_tier_disk_usage_bytes" not in m


def test_demotions_are_one_batched_copy_per_step(baseline: list[list[int]]) -> None:
    """Several requests evicting in the same step: at most one ``read_blocks`` call per
    step outside promotions (a promotion whose own allocation evicted blocks copies
    those out before overwriting them), covering every demoted block, flushed before the
    step's forward; output as without tiers."""
    llm = LLM("stories260K", block_size=16, num_blocks=10, kv_host_tier_bytes=1 << 22)
    eng = llm.llm_engine
    tiers = eng.tiers
    assert tiers is not None and tiers.host is not None
    reads: list[list[int]] = []
    read = tiers.mover.read_blocks
    step_of_read: list[int] = []
    steps = [0]

    in_promote = [False]

    def counting_read(ids: list[int]) -> list[object]:
        reads.append(list(ids))
        if not in_promote[0]:
            step_of_read.append(steps[0])
        return read(ids)  # type: ignore[return-value]

    promote = tiers.promote_prefix

    def flagged_promote(*a: object, **k: object) -> int:
        in_promote[0] = True
        try:
            return promote(*a, **k)  # type: ignore[arg-type]
        finally:
            in_promote[0] = False

    def counting_execute(*a: object, **k: object) -> object:
        assert tiers.pending == [], "the forward ran with pending demotions"
        steps[0] += 1
        return execute(*a, **k)

    execute = eng.runner.execute
    tiers.mover.read_blocks = counting_read  # type: ignore[assignment,method-assign]
    eng.runner.execute = counting_execute  # type: ignore[method-assign]
    tiers.promote_prefix = flagged_promote  # type: ignore[assignment,method-assign]
    outs = []
    for prompts in (PROMPTS, FOLLOW):  # a whole batch at once: many evictions per step
        res = llm.generate(prompts, GREEDY, use_tqdm=False)
        outs += [list(o.outputs[0].token_ids) for o in res]
    # same tokens as one request at a time without tiers (greedy, batch-invariant)
    assert outs == baseline
    assert len(step_of_read) == len(set(step_of_read)), "two copies in one step"
    assert any(len(r) > 1 for r in reads), "no step evicted more than one block"
    assert sum(map(len, reads)) == tiers.host.stats.demotions
    eng.kv_cache_manager.check_integrity()


def test_disk_tier_same_output_and_survives_restart(
    baseline: list[list[int]], tmp_path: Path
) -> None:
    kw = dict(
        block_size=16,
        num_blocks=10,
        kv_host_tier_bytes=2 * 20480,  # 2 blocks of 20480 bytes: the rest spills to disk
        kv_disk_tier_bytes=1 << 24,
        kv_disk_tier_path=str(tmp_path),
    )
    llm = LLM("stories260K", **kw)
    outs, by_tier = run(llm)
    assert outs == baseline and by_tier["disk"] > 0
    del llm
    # a restarted engine, same model and config: the first requests already hit (disk)
    llm2 = LLM("stories260K", **kw)
    (o,) = llm2.generate([FOLLOW[0]], GREEDY, use_tqdm=False)
    assert o.num_cached_tokens_by_tier.get("disk", 0) == 48
    assert list(o.outputs[0].token_ids) == baseline[6]
    outs2, by_tier2 = run(llm2)
    assert outs2 == baseline
    # another block size is another fingerprint: none of those files is served
    llm3 = LLM("stories260K", **{**kw, "block_size": 8, "num_blocks": 20})
    (o,) = llm3.generate([FOLLOW[0]], GREEDY, use_tqdm=False)
    assert o.num_cached_tokens == 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(kv_host_tier_bytes=-1), "kv_host_tier_bytes: expected an int >= 0"),
        (dict(kv_disk_tier_bytes=10), "kv_disk_tier_path: expected a directory"),
        (dict(kv_disk_tier_path="/tmp/x"), "kv_disk_tier_bytes: expected > 0"),
        (
            dict(kv_host_tier_bytes=10, enable_prefix_caching=False),
            "enable_prefix_caching: expected True",
        ),
        (dict(preemption_mode="drop"), "preemption_mode: expected 'recompute' or 'swap'"),
        (dict(swap_space_bytes=True), "swap_space_bytes"),
        (dict(kv_host_tier_bytes=10), r"kv_host_tier_bytes: expected 0 \(off\) or at least one"),
        (
            dict(kv_disk_tier_bytes=100, kv_disk_tier_path="/tmp/kvpage-test-tiny-disk"),
            r"kv_disk_tier_bytes: expected 0 \(off\) or at least one",
        ),
    ],
)
def test_bad_tier_config_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        LLM("stories260K", num_blocks=8, **kw)  # type: ignore[arg-type]


def test_cli_flags_reach_the_engine(tmp_path: Path) -> None:
    import argparse

    from kvpage.apps.engine_cli import _add_engine_args, _engine

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    args = p.parse_args(
        [
            "--num-blocks",
            "8",
            "--kv-host-tier-bytes",
            "65536",
            "--kv-disk-tier-bytes",
            "1000000",
            "--kv-disk-tier-path",
            str(tmp_path),
            "--preemption-mode",
            "swap",
        ]
    )
    eng = _engine(args)
    assert eng.config.kv_host_tier_bytes == 65536
    assert eng.config.preemption_mode == "swap"
    assert eng.tiers is not None and eng.tiers.disk is not None
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-host-tier-bytes", "-5"])


def test_tier_and_swap_metrics_exported_to_prometheus() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvpage.server.metrics import ServerMetrics

    llm = LLM(
        "stories260K",
        block_size=16,
        num_blocks=10,
        kv_host_tier_bytes=1 << 22,
        preemption_mode="swap",
    )
    run(llm)
    eng = llm.llm_engine
    sm = ServerMetrics(eng.get_metrics, model_name="m")
    fams = {
        f.name: f for f in text_string_to_metric_families(generate_latest(sm.registry).decode())
    }
    hits = fams["kvpage:kv_tier_host_hit_tokens"]
    assert hits.type == "counter"
    assert hits.samples[0].value == eng.get_metrics()["kvpage:kv_tier_host_hit_tokens_total"] > 0
    assert fams["kvpage:kv_tier_host_usage_bytes"].type == "gauge"
    assert "kvpage:swap_outs" in fams and "kvpage:swap_space_usage_bytes" in fams
