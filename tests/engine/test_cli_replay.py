"""``kvpage generate`` / ``kvpage replay`` and the trace length rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpage.apps.replay import fit_trace, replay
from kvpage.cli import SUBCOMMANDS, build_parser, main
from kvpage.engine import LLMEngine
from kvpage.workload.traces import load_trace


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_config(block_size=16, num_blocks=512)


def test_parser_lists_engine_subcommands() -> None:
    assert SUBCOMMANDS[0] == "kvpage.apps.engine_cli:add_generate_parser"
    help_text = build_parser().format_help()
    assert "generate" in help_text and "replay" in help_text


def test_generate_prints_the_story(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--threads",
            "0",
            "--max-tokens",
            "20",
            "--num-blocks",
            "64",
            "Once upon a time",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.startswith("Once upon a time, there was a little girl named Lily")
    assert "tokens/s" in out.err


def test_generate_json_and_rejection(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "generate --threads 0 --json --max-tokens 5 --num-blocks 64 -n 2 --temperature 1.0"
    rc = main(argv.split() + ["--sample-seed", "3", "Hi", ""])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 1  # the empty prompt was rejected
    assert len(rows[0]["completions"]) == 2 and rows[1]["error"].startswith("prompt:")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--threads", "0", "--temperature", "-1", "x"])
    assert e.value.code == 2


def test_fit_trace_azure_rule(engine: LLMEngine) -> None:
    trace = load_trace("azure-conv", limit=50)
    reqs = fit_trace(trace, max_model_len=512, vocab_size=512)
    for tr, r in zip(trace.requests, reqs):
        p = len(r.prompt_token_ids)
        assert p == min(max(1, -(-tr.prompt_tokens // 8)), 256)
        assert r.max_tokens == min(max(1, tr.output_tokens), 512 - p)
        assert r.arrival_s == tr.arrival_s
    assert len({tuple(r.prompt_token_ids[:8]) for r in reqs}) == len(reqs)


def test_fit_trace_mooncake_shared_hash_ids_share_tokens() -> None:
    trace = load_trace("mooncake-conv", limit=40)
    reqs = fit_trace(trace, max_model_len=512, vocab_size=512)
    a, b = trace.requests[0], trace.requests[1]
    assert a.hash_ids is not None and b.hash_ids is not None and a.hash_ids[0] == b.hash_ids[0]
    assert reqs[0].prompt_token_ids[:16] == reqs[1].prompt_token_ids[:16]  # hash id 0
    assert reqs[0].prompt_token_ids[16:32] != reqs[1].prompt_token_ids[16:32]
    assert all(len(r.prompt_token_ids) <= 256 for r in reqs)


def test_replay_summary_counts(engine: LLMEngine) -> None:
    trace = load_trace("mooncake-conv", limit=12)
    reqs = fit_trace(trace, max_model_len=512, vocab_size=512, output_scale=16)
    res = replay(engine, reqs, speedup=1000.0)
    s = res.summary
    assert s["completed"] == 12 and s["rejected"] == 0
    assert s["generated_tokens"] == sum(r.max_tokens for r in reqs)
    assert s["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)
    assert s["prefix_hit_ratio"] > 0  # requests share hash id 0
    assert 0 < s["kv_usage_peak"] <= 1 and s["kv_usage_mean"] <= s["kv_usage_peak"]
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert s[k]["p50"] <= s[k]["p95"] <= s[k]["p99"]
    assert engine.get_metrics()["kvpage:kv_cache_usage_perc"] == 0.0


def test_replay_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = "replay --threads 0 --num-requests 6 --speedup 1000 --output-scale 20 --no-progress"
    rc = main(argv.split() + ["--num-blocks", "256", "--output", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["completed"] == 6 and s["trace"] == "azure-conv"
    err = capsys.readouterr()
    assert "the first 6" in err.err and "TTFT" in err.out


def test_registry_skips_missing_parts_and_stubs_broken_ones(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys
    import types

    import kvpage.cli as cli

    broken = types.ModuleType("kvpage_test_broken_cli")
    monkeypatch.setitem(sys.modules, "kvpage_test_broken_cli", broken)  # no registrar in it
    monkeypatch.setattr(
        cli,
        "SUBCOMMANDS",
        [
            *cli.SUBCOMMANDS,
            "kvpage.not_a_module.cli:add_x_parser",
            "kvpage_test_broken_cli:add_broken_parser",
        ],
    )
    parser = cli.build_parser()
    text = parser.format_help()
    assert "broken" in text and " x " not in text
    assert cli.main(["broken"]) == 2
    assert "unavailable" in capsys.readouterr().err


def test_replay_ctrl_c_summarizes_and_frees(engine: LLMEngine) -> None:
    trace = load_trace("azure-conv", limit=8)
    reqs = fit_trace(trace, max_model_len=512, vocab_size=512, output_scale=8)

    def stop(_out: object) -> None:
        raise KeyboardInterrupt

    res = replay(engine, reqs, speedup=1000.0, on_finish=stop)
    assert res.summary["interrupted"] and res.summary["completed"] == 1
    assert not engine.has_unfinished_requests()
    assert engine.get_metrics()["kvpage:kv_cache_usage_perc"] == 0.0


def test_tiny_prompt_scale_keeps_runs_short_and_prefixes_shared():
    import tracemalloc

    trace = load_trace("mooncake-conv", limit=200)
    tracemalloc.start()
    reqs = fit_trace(trace, max_model_len=512, vocab_size=512, prompt_scale=0.001)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 5 << 20  # runs capped at 256 tokens (2 MB peak), not 512,000 (10 MB)
    assert all(1 <= len(r.prompt_token_ids) <= 256 for r in reqs)
    by_first: dict[int, list[int]] = {}
    for t, r in zip(trace.requests, reqs):
        if t.hash_ids:
            first = by_first.setdefault(t.hash_ids[0], r.prompt_token_ids)
            n = min(len(first), len(r.prompt_token_ids))
            assert first[:n] == r.prompt_token_ids[:n]  # same first hash id: same tokens


def test_replay_output_write_failure_keeps_the_summary_and_the_old_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: on a full disk the whole trace ran, then the JSON was lost. The write
    is now atomic (an existing file stays whole, no temp file is left) and on failure
    the summary goes to stdout."""
    import errno
    import os

    out = tmp_path / "r.json"
    out.write_text('{"old": true}\n')

    def full(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    argv = "replay --threads 0 --num-requests 3 --speedup 1000 --output-scale 20 --no-progress"
    rc = main(argv.split() + ["--num-blocks", "256", "--output", str(out)])
    assert rc == 1
    got = capsys.readouterr()
    assert "No space left on device" in got.err and "follows on stdout" in got.err
    summary = json.loads(got.out[got.out.index('{\n  "') :])  # after the table
    assert summary["completed"] == 3
    assert out.read_text() == '{"old": true}\n'  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left


def test_replay_refuses_an_unwritable_output_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be created under a file (even as root)
    rc = main(["replay", "--threads", "0", "--output", str(blocker / "r.json")])
    assert rc == 2
    got = capsys.readouterr()
    assert "--output: expected a path whose folder can be created" in got.err
    assert "Replaying" not in got.err  # checked before the trace ran
