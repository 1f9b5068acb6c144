"""Regression tests of the tool failures a new user hit with ``kvpage generate`` and
``kvpage replay`` (issue 10). Each test is named after what it guards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import kvpage.apps.replay as replay_mod
from kvpage.cli import build_parser, main

ROW = '{"timestamp": %s, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(**kw: Any) -> None:
        raise AssertionError("the engine was built")

    monkeypatch.setattr("kvpage.engine.LLMEngine.from_config", boom)


# ---- replay: a NaN timestamp is refused, not waited for -----------------------------------
def test_replay_refuses_nan_timestamp_instead_of_hanging(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_model(monkeypatch)  # refused while loading the trace, before the model
    p = tmp_path / "nan.jsonl"
    p.write_text(ROW % "0" + ROW % "NaN")
    assert main(["replay", "--trace", str(p), "--output", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvpage replay: nan.jsonl line 2: timestamp: expected a finite number, got nan"


def test_replay_function_refuses_non_finite_arrival() -> None:
    reqs = [replay_mod.ReplayRequest("r0", float("nan"), [1, 2], 1)]
    with pytest.raises(ValueError, match=r"requests\[r0\].arrival_s: expected a finite number"):
        replay_mod.replay(None, reqs)  # type: ignore[arg-type]  # refused before use


# ---- corrupt model folders: one line, exit 2 ----------------------------------------------
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    "files, message",
    [
        (
            {"config.json": b"not json {"},
            "config.json: expected a readable JSON config, got invalid JSON",
        ),
        ({"config.json": b"[1, 2]"}, "config.json: expected a JSON object"),
        (
            {"config.json": json.dumps({**LLAMA, "hidden_size": "big"}).encode()},
            "config.hidden_size: expected a positive integer, got 'big'",
        ),
        (
            {"config.json": json.dumps(LLAMA).encode(), "model.safetensors": os.urandom(300)},
            "model.safetensors: expected a safetensors file",
        ),
        (
            {"config.json": json.dumps(LLAMA).encode(), "pytorch_model.bin": b"junk" * 50},
            "pytorch_model.bin: expected a torch checkpoint",
        ),
    ],
    ids=["junk-config", "config-not-object", "config-bad-value", "junk-safetensors", "junk-bin"],
)
def test_generate_refuses_corrupt_model_folder_in_one_line(
    tmp_path: Path, files: dict[str, bytes], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert main(["generate", "--model", str(tmp_path), "--threads", "0", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpage generate: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_generate_refuses_unsupported_architecture_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "mamba_d_state": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--model", str(tmp_path), "--threads", "0", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "got 'jamba' (JambaForCausalLM): it needs hybrid SSM state" in err


# ---- replay --output: checked before the replay --------------------------------------------
@pytest.mark.parametrize("path", ["/proc/x/y.json", "/proc/y.json"])
def test_replay_unwritable_output_refused_before_the_replay(
    path: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not Path("/proc/self").exists():
        pytest.skip("needs /proc")

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("the trace was loaded")

    monkeypatch.setattr("kvpage.workload.traces.load_trace", boom)
    assert main(["replay", "--output", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpage replay: --output: expected a") and "Traceback" not in err


# ---- replay: interrupted and empty runs write strict JSON, SIGTERM like Ctrl-C --------------
def test_interrupted_replay_with_nothing_finished_writes_null_not_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "late.jsonl"  # Mooncake times are absolute: the first arrives at 5 s
    trace.write_text(ROW % "5000" + ROW % "6000")
    real = replay_mod.replay

    def ctrl_c_while_waiting(engine: Any, reqs: Any, **kw: Any) -> Any:
        def sleep(_s: float) -> None:
            raise KeyboardInterrupt

        return real(engine, reqs, speedup=kw["speedup"], sleep=sleep)

    monkeypatch.setattr(replay_mod, "replay", ctrl_c_while_waiting)
    out = tmp_path / "r.json"
    argv = ["replay", "--trace", str(trace), "--num-blocks", "64", "--threads", "0"]
    assert main([*argv, "--no-progress", "--output", str(out)]) == 130
    s = _strict_json(out.read_text())  # no bare NaN
    assert s["completed"] == 0 and s["interrupted_by"] == "SIGINT"
    assert set(s["ttft_ms"].values()) == {None}  # p50/p95/p99/mean/min/max: null, not NaN
    assert "n/a / n/a / n/a" in capsys.readouterr().out


def test_sigterm_in_process_stops_replay_like_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = replay_mod.replay

    def terminated_after_first(engine: Any, reqs: Any, **kw: Any) -> Any:
        def term(_o: object) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # handled in this (main) thread

        return real(engine, reqs, speedup=kw["speedup"], on_finish=term)

    monkeypatch.setattr(replay_mod, "replay", terminated_after_first)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "r.json"
    argv = "replay --threads 0 --num-requests 3 --speedup 1000 --output-scale 40 --no-progress"
    assert main([*argv.split(), "--num-blocks", "128", "--output", str(out)]) == 143
    s = _strict_json(out.read_text())
    assert s["interrupted"] is True and s["interrupted_by"] == "SIGTERM"
    assert s["completed"] >= 1
    assert signal.getsignal(signal.SIGTERM) == before  # handler restored


def test_sigterm_to_a_running_replay_writes_partial_results_and_exits_143(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "slow.jsonl"  # one request now, the next in 10 minutes
    trace.write_text(ROW % "0" + ROW % "600000")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "kvpage", "replay", "--trace", str(trace), "--no-progress"]
    cmd += ["--num-blocks", "64", "--threads", "1", "--output", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # "Replaying 2 requests ..." once the replay runs
        assert line.startswith("Replaying 2 requests"), line
        time.sleep(1.0)  # usually the first request (a few ms of work) has finished
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 143
    s = _strict_json(out.read_text())
    assert s["interrupted_by"] == "SIGTERM" and s["requests"] == 2
    assert s["completed"] in (0, 1)  # the second one was still 10 minutes away


# ---- flags ----------------------------------------------------------------------------------
def test_sample_seed_above_the_upper_bound_names_the_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--sample-seed", "99999999999999999999", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sample-seed: expected an int in [0, 2**63 - 1] (upper bound " in err
    assert "expected an int >= 0" not in err


@pytest.mark.parametrize("command", ["generate", "replay", "serve"])
def test_prefix_caching_flag_has_one_spelling_everywhere(command: str) -> None:
    parser = build_parser()
    for flag in ("--no-enable-prefix-caching", "--no-prefix-caching"):  # canonical, alias
        assert parser.parse_args([command, flag]).enable_prefix_caching is False
    assert parser.parse_args([command, "--enable-prefix-caching"]).enable_prefix_caching is True
    default = parser.parse_args([command]).enable_prefix_caching
    assert default is None  # not given: EngineConfig's default (serve: the config file) decides


def test_sigterm_during_replay_setup_exits_143_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def killed_while_loading(**kw: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # interrupted by the handler at once
        raise AssertionError("SIGTERM was not delivered")

    monkeypatch.setattr("kvpage.engine.LLMEngine.from_config", killed_while_loading)
    assert main(["replay", "--num-requests", "2", "--output", ""]) == 143
    err = capsys.readouterr().err
    assert err.strip().endswith("kvpage replay: terminated (SIGTERM)") and "Traceback" not in err
