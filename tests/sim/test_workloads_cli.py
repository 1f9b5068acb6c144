"""Synthetic workloads and the ``kvpage simulate`` command."""

from __future__ import annotations

import json

import pytest

from kvpage.errors import SpecError
from kvpage.sim.profile import prefix_stats
from kvpage.workload.traces import TokenMapper
from kvpage.workload.workloads import WORKLOADS, make_workload


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("scale, mml", [("gpu", 8192), ("cpu", 512)])
def test_workloads_fit_context_and_map_to_tokens(name, scale, mml):
    t = make_workload(name, 24, scale=scale)
    assert len(t) == 24 and t.requests[0].arrival_s == 0.0
    assert all(a <= b for a, b in zip(t.arrivals(), t.arrivals()[1:]))
    m = TokenMapper(hash_block_tokens=t.hash_block_tokens)
    for r in t:
        assert r.prompt_tokens >= 1 and r.output_tokens >= 1
        assert r.total_tokens <= mml
        assert len(m.prompt(r)) == r.prompt_tokens
    # deterministic
    assert make_workload(name, 24, scale=scale).requests == t.requests


def test_workload_prefix_sharing():
    hit = {
        n: prefix_stats(make_workload(n, 40)).get("causal_token_hit_pct", 0.0) for n in WORKLOADS
    }
    assert hit["short-short"] == hit["long-long"] == 0.0
    assert hit["rag"] > 30.0  # shared 1024-token system prompt of ~3.2k-token prompts
    assert hit["multi-turn"] > 60.0  # each turn extends the previous one
    mt = make_workload("multi-turn", 8, scale="cpu")
    m = TokenMapper(hash_block_tokens=mt.hash_block_tokens)
    # some later turn starts with an earlier turn's whole prompt
    prompts = [m.prompt(r) for r in mt]
    assert any(
        len(prompts[j]) > len(prompts[i]) and prompts[j][: len(prompts[i])] == prompts[i]
        for i in range(len(prompts))
        for j in range(i + 1, len(prompts))
    )
    with pytest.raises(SpecError):
        make_workload("chat", 4)
    with pytest.raises(SpecError):
        make_workload("rag", 4, scale="tpu")
    with pytest.raises(SpecError):
        make_workload("rag", 0)


def test_kvpage_simulate_command(capsys, tmp_path):
    from kvpage.cli import main

    out = tmp_path / "sim.json"
    rc = main(
        [
            "simulate",
            "--trace",
            "azure-code",
            "--limit",
            "40",
            "--policies",
            "contiguous-max,paged",
            "--block-sizes",
            "16,64",
            "--num-blocks",
            "1025",
            "--max-model-len",
            "8192",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "| contiguous-max | 16 |" in text and "| paged | 64 |" in text
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["block_size"]) for r in rows] == [
        ("contiguous-max", 16),
        ("paged", 16),
        ("paged", 64),
    ]
    assert rows[1]["num_slots"] == rows[2]["num_slots"] == 1024 * 16
    assert main(["simulate", "--trace", "azure-code", "--policies", "nope"]) == 2
