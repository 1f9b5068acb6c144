"""Regression tests of the tool failures a new user hit (issue 10): trace loaders,
``kvpage plan`` and ``kvpage profile``. Each test is named after what it guards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpage.cli import main
from kvpage.errors import SpecError
from kvpage.jsonout import dumps
from kvpage.sim.profile import arrival_stats, profile_trace, render_profile, window_counts
from kvpage.workload.traces import TraceError, load_azure_csv, load_mooncake_jsonl, load_trace

ROW = '{"timestamp": %s, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


# ---- trace loaders: non-finite values, named by file, editor line and field ----------------
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_mooncake_loader_refuses_non_finite_timestamp_with_file_line_and_field(
    tmp_path: Path, value: str
) -> None:
    p = tmp_path / "t.jsonl"
    # line 1 fine, line 2 blank (editors count it), line 3 bad: the message says line 3
    p.write_text(ROW % "0" + "\n" + ROW % value)
    with pytest.raises(TraceError) as e:
        load_mooncake_jsonl(p)
    assert str(e.value).startswith("t.jsonl line 3: timestamp: expected a finite number, got")


@pytest.mark.parametrize("field", ["input_length", "output_length"])
def test_mooncake_loader_refuses_non_finite_lengths_by_field(tmp_path: Path, field: str) -> None:
    rec = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}
    rec[field] = float("nan")
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(rec) + "\n")  # json.dumps writes NaN, as a careless tool would
    with pytest.raises(TraceError, match=rf"^t.jsonl line 1: {field}: expected a finite number"):
        load_mooncake_jsonl(p)


def test_azure_loader_names_editor_line_counting_the_header(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 00:00:00.0,10,5\n"
        "2023-11-16 00:00:01.0,nan,5\n"
    )
    with pytest.raises(TraceError, match=r"^a.csv line 3: ContextTokens: expected an int >= 0"):
        load_azure_csv(p)
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.nan,10,5\n")
    with pytest.raises(TraceError, match=r"^a.csv line 2: TIMESTAMP: expected"):
        load_azure_csv(p)


def test_profile_refuses_nan_timestamp_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "nan.jsonl"
    p.write_text(ROW % "0" + ROW % "NaN")
    assert main(["profile", "--trace", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvpage profile: nan.jsonl line 2: timestamp: expected a finite number, got nan")


# ---- strict JSON ------------------------------------------------------------------------
def test_json_output_writes_null_never_nan() -> None:
    text = dumps({"p50": float("nan"), "x": [float("inf"), 1.5, np.float64("nan")], "n": 3})
    assert _strict_json(text) == {"p50": None, "x": [None, 1.5, None], "n": 3}


# ---- plan --------------------------------------------------------------------------------
def test_plan_num_seqs_works_without_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3-8b", "--memory", "80GiB", "--json"]
    assert main([*argv, "--num-seqs", "64"]) == 0
    d = json.loads(capsys.readouterr().out)
    per_seq_blocks = d["usable_blocks"] // 64
    assert d["workload"] == {
        "num_seqs": 64,
        "max_model_len_for_num_seqs": per_seq_blocks * d["block_size"],
        "limited_by": "kv_memory",
    }
    assert per_seq_blocks * d["block_size"] < d["model_max_len"]
    assert main(argv) == 0  # without --num-seqs: no answer invented
    assert json.loads(capsys.readouterr().out)["workload"] == {}


def test_plan_refuses_max_model_len_beyond_the_models_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", "llama-3-8b", "--memory", "80GiB", "--max-model-len"]
    assert main([*argv, "10000000"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvpage plan: max_model_len: expected <= 8192 (the model's context, "
        "max_position_embeddings), got 10000000"
    )
    assert main([*argv, "8192"]) == 0


@pytest.mark.parametrize("size", ["999999999999999999999999999TB", "2PiB", "1e400"])
def test_plan_refuses_absurd_memory_sizes(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--memory", size]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpage plan: device_bytes (--memory): expected")
    assert "tokens" not in err


# ---- unsupported architectures -----------------------------------------------------------
ARCH_CONFIGS = {
    "jamba": (
        {"architectures": ["JambaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32},
        "hybrid SSM state",
    ),
    "mamba": ({"architectures": ["MambaForCausalLM"], "hidden_size": 768}, "SSM state"),
    "kimi_k2": ({"kv_lora_rank": 512, "n_routed_experts": 384}, "MLA"),
    "my_new_arch": ({"kv_lora_rank": 64}, "MLA"),  # unknown type: found from its keys
}


@pytest.mark.parametrize("model_type", sorted(ARCH_CONFIGS))
def test_plan_refuses_unsupported_architecture_in_one_line(
    tmp_path: Path, model_type: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, missing = ARCH_CONFIGS[model_type]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": model_type, **extra}))
    # even with --weight-bytes (no parameter counting needed) the refusal is the first error
    argv = ["plan", "--model", str(cfg), "--memory", "80GiB", "--weight-bytes", "10GB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"got '{model_type}'" in err and missing in err and "docs/models.md" in err
    assert "parameters" not in err


def test_plan_of_countless_config_asks_for_weight_bytes_only_when_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"  # gpt2: cache layout known, parameters not counted
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64}))
    assert main(["plan", "--model", str(cfg), "--memory", "1GiB", "--weight-bytes", "1MB"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", str(cfg), "--memory", "1GiB"]) == 2
    assert "weight_bytes: expected a value (--weight-bytes)" in capsys.readouterr().err


# ---- profile ------------------------------------------------------------------------------
def test_profile_plots_go_into_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "--trace", "azure-conv", "--limit", "300", "--plots", "out"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "azure-conv_arrivals.png",
        "azure-conv_lengths.png",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing beside it
    (tmp_path / "file").write_text("")
    assert main(["profile", "--trace", "azure-conv", "--plots", "file"]) == 2
    assert "--plots: expected a folder, got the file 'file'" in capsys.readouterr().err


def _figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Collect each figure plot_profile saves (its axes stay readable)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved: list[Any] = []
    real = Figure.savefig

    def keep(self: Any, *a: Any, **k: Any) -> None:
        saved.append(self)
        real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def test_profile_length_histogram_axis_fits_the_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpage.sim.profile import plot_profile

    saved = _figures(monkeypatch)
    trace = load_trace("mooncake-conv", limit=2000)
    plot_profile(trace, str(tmp_path / "m"))
    prompt_ax = saved[0].axes[0]
    lo, hi = prompt_ax.get_xlim()
    lens = trace.prompt_lens()
    assert lens.min() > 800  # the finding: the axis started at 1 for prompts of 891+
    assert lo == pytest.approx(lens.min()) and hi == pytest.approx(lens.max())


def test_profile_peak_in_table_equals_peak_in_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpage.sim.profile import plot_profile

    saved = _figures(monkeypatch)
    trace = load_trace("azure-conv")
    prof = profile_trace(trace)
    plot_profile(trace, str(tmp_path / "a"))
    line = saved[1].axes[0].get_lines()[0]
    assert float(np.max(line.get_ydata())) == prof["arrivals"]["peak_1min_rate_rps"]
    table = render_profile(prof)
    assert f"{prof['arrivals']['peak_1min_rate_rps']:,.3f}" in table
    # one definition: the most arrivals in a 60 s window starting at an arrival
    arr = np.array([0.0, 10.0, 59.9, 60.0, 61.0, 200.0])
    assert window_counts(arr).tolist() == [3, 4, 3, 2, 1, 1]
    assert arrival_stats(arr)["peak_1min_rate_rps"] == 4 / 60


def test_profile_prints_whole_numbers_without_decimals() -> None:
    prof = profile_trace(load_trace("mooncake-conv", limit=1500))
    assert prof["arrivals"]["requests"] == 1500 and isinstance(prof["arrivals"]["requests"], int)
    table = render_profile(prof)
    assert "1,500.000" not in table and " 1,500 " in table
    assert isinstance(prof["prefix"]["unique_blocks"], int)
    assert f" {prof['prefix']['unique_blocks']:,} " in table


def test_parse_bytes_names_the_option() -> None:
    from kvpage.capacity import parse_bytes

    with pytest.raises(SpecError, match=r"^overhead_bytes: expected at most 1 PiB"):
        parse_bytes("5PB", "overhead_bytes")
    assert parse_bytes("1PiB") == 1 << 50


@pytest.mark.parametrize("pct", ["inf,inf,inf", "1,2,inf", "nan,1,2"])
def test_plan_refuses_non_finite_percentiles(pct: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--prompt-pct inf used to print int64-overflowed percentiles with exit 0."""
    args = ["plan", "--model", "llama-3-8b", "--memory", "80GB"]
    assert main([*args, "--prompt-pct", pct, "--output-pct", "1,2,3"]) == 2
    assert "expected finite 0 < p50 <= p95 <= p99" in capsys.readouterr().err


def test_plan_refuses_percentiles_beside_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """With --trace the lengths come from the trace; --prompt-pct was silently ignored."""
    args = ["plan", "--model", "llama-3-8b", "--memory", "80GB", "--trace", "azure-conv"]
    assert main([*args, "--prompt-pct", "1,2,3", "--output-pct", "1,2,3"]) == 2
    assert "--prompt-pct/--output-pct: expected none with --trace" in capsys.readouterr().err
