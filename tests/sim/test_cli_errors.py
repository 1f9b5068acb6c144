"""``kvpage plan / profile / simulate``: bad input gives a one-line "name: expected X,
got Y" error and exit code 2 (no traceback), output paths are checked before any work,
and edge-case traces are handled (regressions of a break-it session's findings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpage.cli import main
from kvpage.errors import SpecError
from kvpage.sim.simulator import SimConfig, simulate
from kvpage.workload.traces import TraceRequest, load_trace

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
PLAN = ["plan", "--model", "llama-3-8b", "--memory", "80GiB"]
SIM = ["simulate", "--policies", "paged", "--num-blocks", "257"]


def _csv(tmp_path: Path, rows: str, name: str = "t.csv") -> str:
    p = tmp_path / name
    p.write_text(HEADER + rows)
    return str(p)


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_simulate_zero_output_and_zero_prompt_rows(tmp_path, capsys):
    # GeneratedTokens=0 used to raise IndexError; ContextTokens=0 was dropped silently
    tr = _csv(
        tmp_path,
        "2023-11-16 00:00:00.0,0,5\n2023-11-16 00:00:01.0,100,0\n2023-11-16 00:00:02.0,100,5\n",
    )
    out = tmp_path / "r.json"
    assert main([*SIM, "--trace", tr, "--json", str(out)]) == 0
    err = _err(capsys)
    assert "rejected 1: empty_prompt=1" in err
    (row,) = json.loads(out.read_text())
    assert row["finished"] == 2 and row["rejected"] == {"empty_prompt": 1}


def test_simulate_reports_why_nothing_finished(tmp_path, capsys):
    tr = _csv(tmp_path, "2023-11-16 00:00:00.0,100,5\n")
    assert main([*SIM, "--trace", tr, "--max-model-len", "10"]) == 0
    captured = capsys.readouterr()
    assert "prompt_too_long=1" in captured.err and "finished no requests" in captured.err
    assert "| done | rejected |" in captured.out


def test_simulate_zero_output_request_direct():
    reqs = [TraceRequest(0, 0.0, 20, 0), TraceRequest(1, 0.1, 20, 3)]
    res = simulate(reqs, SimConfig(policy="paged", num_blocks=64, max_model_len=128))
    assert res.finished == 2 and res.rejected == {}


@pytest.mark.parametrize("bad", ["-1", "0", "nan", "inf"])
def test_simulate_time_scale_must_be_positive_finite(tmp_path, capsys, bad):
    tr = _csv(tmp_path, "2023-11-16 00:00:00.0,10,5\n")
    assert main([*SIM, "--trace", tr, f"--time-scale={bad}"]) == 2
    assert "time_scale: expected a finite number > 0" in _err(capsys)
    with pytest.raises(SpecError, match="time_scale"):
        simulate(load_trace(tr), SimConfig(policy="paged", num_blocks=64, time_scale=-1.0))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-sizes", "a"], "--block-sizes: expected a comma list of ints >= 1, got 'a'"),
        (["--block-sizes", "16,0"], "--block-sizes: expected a comma list of ints >= 1, got '0'"),
        (["--num-blocks", "1"], "--num-blocks: expected an int >= 2"),
        (["--num-blocks", "2", "--block-sizes", "64"], "expected >= 2, got 1"),
        (["--policies", "paged,nope"], "--policies: expected"),
        (["--limit", "-1"], "--limit: expected an int >= 1, or 0 for all requests, got -1"),
    ],
)
def test_simulate_bad_arguments_are_clean_errors(tmp_path, capsys, args, message):
    tr = _csv(tmp_path, "2023-11-16 00:00:00.0,10,5\n")
    argv = ["simulate", "--policies", "paged", "--trace", tr, *args]
    assert main(argv) == 2
    err = _err(capsys)
    assert err.startswith("kvpage simulate: ") and message in err


def test_header_only_trace_is_refused_everywhere(tmp_path, capsys):
    tr = _csv(tmp_path, "")
    for argv in ([*SIM, "--trace", tr], ["profile", "--trace", tr], [*PLAN, "--trace", tr]):
        assert main(argv) == 2
        assert "no requests" in _err(capsys)


def test_output_paths_checked_up_front(tmp_path, capsys):
    tr = _csv(tmp_path, "2023-11-16 00:00:00.0,10,5\n")
    # a directory as --json: refused before any work (no simulation ran)
    assert main([*SIM, "--trace", tr, "--json", str(tmp_path)]) == 2
    err = _err(capsys)
    assert "--json: expected a file path, got the directory" in err and "done" not in err
    assert main(["profile", "--trace", tr, "--json", str(tmp_path)]) == 2
    assert "--json: expected a file path" in _err(capsys)
    # missing folders are created, for --json and for the --plots folder
    deep = tmp_path / "a" / "b" / "prof.json"
    plots = tmp_path / "nodir" / "x"
    assert main(["profile", "--trace", tr, "--json", str(deep), "--plots", str(plots)]) == 0
    assert json.loads(deep.read_text())["arrivals"]["requests"] == 1.0
    assert (tmp_path / "nodir" / "x" / "t_lengths.png").is_file()  # <trace name>_lengths
    # a parent that is a file cannot become a folder
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main([*SIM, "--trace", tr, "--json", str(blocker / "r.json")]) == 2
    assert "--json: expected a path whose folder can be created" in _err(capsys)


def test_profile_of_out_of_order_trace_has_positive_span(tmp_path, capsys):
    tr = _csv(
        tmp_path,
        "2023-11-16 00:00:02.0,10,5\n2023-11-16 00:00:00.3,10,5\n2023-11-16 00:00:01.0,10,5\n",
    )
    assert main(["profile", "--trace", tr, "--json", "-"]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert prof["arrivals"]["span_s"] == pytest.approx(1.7)


def test_limit_semantics_are_consistent(tmp_path, capsys):
    rows = "".join(f"2023-11-16 00:00:0{i}.0,10,5\n" for i in range(5))
    tr = _csv(tmp_path, rows)
    # 0 = all (as `kvpage replay --num-requests 0`), N = first N, negative refused
    for limit, n in (("0", 5.0), ("2", 2.0)):
        assert main(["profile", "--trace", tr, "--limit", limit, "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["arrivals"]["requests"] == n
    for argv in (["profile", "--trace", tr], [*PLAN, "--trace", tr], [*SIM, "--trace", tr]):
        assert main([*argv, "--limit", "-3"]) == 2
        assert "--limit: expected an int >= 1, or 0 for all requests, got -3" in _err(capsys)
    assert main([*PLAN, "--trace", tr, "--limit", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["requests"] == 5


def test_plan_num_seqs_and_model_errors(tmp_path, capsys):
    tr = _csv(tmp_path, "2023-11-16 00:00:00.0,10,5\n")
    assert main([*PLAN, "--trace", tr, "--num-seqs", "0"]) == 2
    assert "num_seqs: expected None or an int >= 1, got 0" in _err(capsys)
    assert main([*PLAN, "--trace", tr, "--num-seqs", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["num_seqs"] == 1
    assert main(["plan", "--model", tr, "--memory", "80GiB"]) == 2
    assert "model: expected a preset name" in _err(capsys)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["plan", "--model", str(bad), "--memory", "80GiB"]) == 2
    assert "expected a readable JSON config" in _err(capsys)


def test_plots_without_matplotlib_refused_up_front(tmp_path, capsys, monkeypatch):
    """scripts/run.sh's core venv has no matplotlib: --plots is refused by name before the
    profile is computed, not a traceback after it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    tr = _csv(tmp_path, "2023-11-16 00:00:00.0,10,5\n")
    assert main(["profile", "--trace", tr, "--plots", str(tmp_path / "p")]) == 2
    out, err = capsys.readouterr()
    assert "--plots: needs matplotlib" in err and "Traceback" not in err
    assert out == ""  # no table: refused before any work
