"""Every numeric option of ``kvpage generate`` / ``replay`` is checked up front: a bad
value exits 2 with ``argument --x: expected X, got Y`` and no traceback (break-it
findings, engine items 1-4, 8-10, 12)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvpage.apps.replay as replay_mod
from kvpage.cli import build_parser, main

ENGINE_BAD = [
    ("--block-size", "0"),
    ("--block-size", "x"),
    ("--num-blocks", "0"),
    ("--num-blocks", "1"),
    ("--kv-cache-memory-bytes", "0"),
    ("--max-num-seqs", "0"),
    ("--max-num-batched-tokens", "-5"),
    ("--max-model-len", "0"),
    ("--seed", "-1"),
    ("--seed", str(2**63)),
    ("--threads", "-1"),
    ("--threads", "-3"),
]
GENERATE_BAD = [
    ("--max-tokens", "0"),
    ("--max-tokens", str(2**63)),
    ("--temperature", "-1"),
    ("--temperature", "nan"),
    ("--temperature", "inf"),
    ("--top-p", "0"),
    ("--top-p", "1.5"),
    ("--top-k", "-2"),
    ("-n", "0"),
    ("--sample-seed", "18446744073709551616"),
    ("--sample-seed", "-1"),
]
REPLAY_BAD = [
    ("--speedup", "0"),
    ("--speedup", "-2"),
    ("--speedup", "nan"),
    ("--speedup", "inf"),
    ("--num-requests", "-1"),
    ("--prompt-scale", "0"),
    ("--prompt-scale", "nan"),
    ("--output-scale", "0"),
    ("--output-scale", "-1"),
]


def _exit_code(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return int(e.value.code or 0), err


@pytest.mark.parametrize(("flag", "value"), ENGINE_BAD + GENERATE_BAD)
def test_generate_rejects_bad_numbers(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit_code(["generate", flag, value, "hi"], capsys)
    assert code == 2
    assert f"argument {flag}" in err and f"got '{value}'" in err and "expected" in err


@pytest.mark.parametrize(("flag", "value"), ENGINE_BAD + REPLAY_BAD)
def test_replay_rejects_bad_numbers(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit_code(["replay", flag, value], capsys)
    assert code == 2
    assert f"argument {flag}" in err and f"got '{value}'" in err and "expected" in err


def test_num_blocks_message_agrees_with_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = _exit_code(["generate", "--num-blocks", "1", "hi"], capsys)
    assert "expected None or an int >= 2 (block 0 is the reserved null block)" in err


def test_replay_output_folder_rejected_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*a: Any, **k: Any) -> None:  # the trace must not even be loaded
        raise AssertionError("ran")

    monkeypatch.setattr("kvpage.workload.traces.load_trace", boom)
    assert main(["replay", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--output: expected a file path, got the directory '{tmp_path}'" in err
    (tmp_path / "f").write_text("")
    assert main(["replay", "--output", str(tmp_path / "f" / "x.json")]) == 2
    assert "--output: expected a path whose folder can be created" in capsys.readouterr().err


def test_replay_records_prompt_scale_used_and_ctrl_c_exits_130(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = "replay --threads 0 --num-requests 3 --speedup 1000 --output-scale 40 --no-progress"
    argv = base.split() + ["--num-blocks", "128"]
    out = tmp_path / "sub" / "r.json"
    assert main([*argv, "--output", str(out)]) == 0
    assert json.loads(out.read_text())["prompt_scale"] == 8.0  # Azure default, not null
    assert main([*argv, "--prompt-scale", "4", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["prompt_scale"] == 4.0

    real = replay_mod.replay

    def interrupted(engine: Any, reqs: Any, **kw: Any) -> Any:
        def stop(_o: object) -> None:
            raise KeyboardInterrupt

        return real(engine, reqs, speedup=kw["speedup"], on_finish=stop)

    monkeypatch.setattr(replay_mod, "replay", interrupted)
    assert main([*argv, "--output", str(out)]) == 130
    s = json.loads(out.read_text())
    assert s["interrupted"] is True and s["completed"] == 1
    assert "(interrupted)" in capsys.readouterr().out


def test_ctrl_c_during_setup_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def ctrl_c(**kw: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("kvpage.engine.LLMEngine.from_config", ctrl_c)
    assert main(["generate", "hi"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_generate_help_names_the_default_prompt() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "Once upon a time" in sub["generate"].format_help()


def test_generate_huge_seed_is_clean(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model(**kw: Any) -> None:  # rejected before the model loads
        raise AssertionError("loaded")

    monkeypatch.setattr("kvpage.engine.LLMEngine.from_config", no_model)
    argv = ["generate", "--temperature", "1", "-n", "2", "--sample-seed", str(2**63 - 1), "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpage generate: seed: expected seed + n - 1 <=")
    assert "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_unavailable_device_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", "cuda", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpage generate: device: expected an available device, got 'cuda'")


def test_generate_pool_too_big_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--num-blocks", str(10**11), "--threads", "0", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpage generate: num_blocks: expected a KV cache that fits")


def test_replay_tiny_speedup_sleeps_in_slices() -> None:
    from kvpage.engine import LLMEngine

    eng = LLMEngine.from_config(block_size=16, num_blocks=64)
    reqs = [
        replay_mod.ReplayRequest("a", 0.0, [1, 5, 6], 2),
        replay_mod.ReplayRequest("b", 10.0, [1, 7, 8], 2),
    ]
    waits: list[float] = []

    def fake_sleep(s: float) -> None:
        waits.append(s)
        raise KeyboardInterrupt  # the user gives up waiting 1e301 s

    res = replay_mod.replay(eng, reqs, speedup=1e-300, sleep=fake_sleep)
    assert waits == [replay_mod.MAX_SLEEP_S] and res.summary["interrupted"]
    assert res.summary["completed"] == 1 and not eng.has_unfinished_requests()
