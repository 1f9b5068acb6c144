"""The rollback-friendly config file and the `kvpage serve` argument handling."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from kvpage.errors import SpecError
from kvpage.server.cli import add_serve_parser, config_from_args
from kvpage.server.config import ServerConfig, dump_config, load_config


def _parser():
    p = argparse.ArgumentParser(prog="kvpage")
    add_serve_parser(p.add_subparsers(dest="cmd"))
    return p


def test_defaults_bind_loopback():
    cfg = config_from_args(_parser().parse_args(["serve"]))
    assert cfg.host == "127.0.0.1" and cfg.engine.model == "stories260K"
    assert cfg.model_name == "stories260K"


@pytest.mark.parametrize("fmt,suffix", [("yaml", ".yaml"), ("json", ".json")])
def test_dump_and_restore_roundtrip(tmp_path, fmt, suffix):
    cfg = ServerConfig.model_validate(
        {
            "port": 9001,
            "engine": {"block_size": 32, "num_blocks": 128, "enable_prefix_caching": False},
            "admission": {"tenants": {"team-a": {"rate": 50, "burst": 4000}}, "kv_high_water": 0.8},
            "degradation": {"max_tokens_cap": 16},
        }
    )
    path = tmp_path / ("cfg" + suffix)
    path.write_text(dump_config(cfg, fmt))  # type: ignore[arg-type]
    assert load_config(path) == cfg
    data = json.loads(path.read_text()) if fmt == "json" else yaml.safe_load(path.read_text())
    assert data["engine"]["max_num_batched_tokens"] == 2048  # defaults are written out too


def test_flags_override_file(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text("engine:\n  block_size: 32\n  max_num_seqs: 8\nport: 9000\n")
    args = _parser().parse_args(
        [
            "serve",
            "--config",
            str(path),
            "--port",
            "9100",
            "--no-enable-prefix-caching",
            "--tenant-rate",
            "10",
            "--tenant-burst",
            "500",
            "--dump-config",
            "--dump-format",
            "json",
        ]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["port"] == 9100 and out["engine"]["block_size"] == 32
    assert out["engine"]["max_num_seqs"] == 8 and out["engine"]["enable_prefix_caching"] is False
    assert out["admission"]["default_limit"] == {"rate": 10.0, "burst": 500.0}


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  block_size: 0\n")
    with pytest.raises(SpecError, match="block_size"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("engine:\n  blok_size: 16\n")  # typos are refused, not ignored
    with pytest.raises(SpecError, match="blok_size"):
        load_config(unknown)
    with pytest.raises(SpecError, match="mapping"):
        (tmp_path / "list.yaml").write_text("- 1\n")
        load_config(tmp_path / "list.yaml")
    with pytest.raises(SpecError, match="readable"):
        load_config(tmp_path / "missing.yaml")
    args = _parser().parse_args(["serve", "--config", str(bad), "--dump-config"])
    assert args.func(args) == 2
    assert "block_size" in capsys.readouterr().err
    args = _parser().parse_args(["serve", "--tenant-rate", "5"])
    with pytest.raises(SpecError, match="both or neither"):
        config_from_args(args)


def test_kvpage_cli_dump_config(capsys):
    from kvpage.cli import main

    assert main(["serve", "--dump-config", "--max-num-seqs", "7"]) == 0
    cfg = ServerConfig.model_validate(yaml.safe_load(capsys.readouterr().out))
    assert cfg.engine.max_num_seqs == 7 and cfg.host == "127.0.0.1"


def test_kvpage_serve_process_serves_and_stops_on_sigint(tmp_path):
    """`kvpage serve` as a real process: restored from a config file, answers, and shuts
    down cleanly on SIGINT (bounded waits throughout)."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServerConfig.model_validate({"port": port, "engine": {"num_blocks": 33}})
    path = tmp_path / "serve.yaml"
    path.write_text(dump_config(cfg))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpage.cli",
            "serve",
            "--config",
            str(path),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "stories260K", "prompt": "Once", "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        info = httpx.get(url + "/metrics", timeout=10).text
        assert 'num_blocks="33"' in info
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_docs_example_config_is_valid():
    """The example in docs/serving.md stays a loadable, complete config."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    block = re.search(r"```yaml\n(host:.*?)```", text, re.S)
    assert block is not None
    data = yaml.safe_load(block.group(1))
    cfg = ServerConfig.model_validate(data)
    assert set(data) == set(ServerConfig.model_fields)  # every top-level field shown
    assert set(data["engine"]) == set(cfg.engine.model_dump())


def test_flag_errors_are_one_clean_line(capsys):
    """Finding 6/7: flag errors printed raw pydantic output (with an errors.pydantic.dev
    URL); an invalid --kv-cache-dtype was dumped rc 0."""
    for flags, field in [
        (["--num-blocks", "1"], "engine.num_blocks: expected None or an int >= 2"),
        (["--kv-cache-dtype", "nonsense"], "engine.kv_cache_dtype: expected 'auto'"),
        (["--kv-pressure-action", "drop"], "admission.kv_pressure_action: expected"),
    ]:
        args = _parser().parse_args(["serve", *flags, "--dump-config"])
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert field in err and "pydantic.dev" not in err and "validation error" not in err
        assert len(err.strip().splitlines()) == 1
    args = _parser().parse_args(["serve", "--kv-cache-dtype", "int8", "--dump-config"])
    assert args.func(args) == 0
    assert "kv_cache_dtype: int8" in capsys.readouterr().out


def test_unknown_backend_is_a_clean_error_not_a_traceback(capsys):
    args = _parser().parse_args(["serve", "--backend", "nonsense", "--port", "0"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpage serve: ") and "nonsense" in err and "Traceback" not in err


def test_threads_flag_reaches_the_engine_config():
    """``kvpage serve --threads N`` sets ``engine.num_threads`` (None = the engine's
    default of 1; 0 = torch's default); a negative count is refused by name."""
    assert config_from_args(_parser().parse_args(["serve"])).engine.num_threads is None
    cfg = config_from_args(_parser().parse_args(["serve", "--threads", "2"]))
    assert cfg.engine.num_threads == 2
    assert cfg.engine.engine_kwargs()["num_threads"] == 2
    with pytest.raises(SpecError, match="num_threads"):
        config_from_args(_parser().parse_args(["serve", "--threads", "-1"]))


def test_every_config_flag_has_help_naming_its_field() -> None:
    import argparse

    from kvpage.server.cli import _FLAGS, add_serve_parser

    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    helps = {a.dest: a.help or "" for a in parser._actions}
    for flag, (section, field, _) in _FLAGS.items():
        where = field if section is None else f"{section}.{field}"
        assert helps[flag].startswith(f"config {where}; default "), (flag, helps[flag])
    assert "one of queue, reject" in helps["kv_pressure_action"]


def test_serve_without_server_packages_names_them(monkeypatch, capsys):
    """The core venv of scripts/run.sh has no FastAPI/uvicorn: `kvpage serve` says what to
    install instead of a traceback."""
    import sys

    from kvpage.server.cli import serve_main

    monkeypatch.setitem(sys.modules, "kvpage.server.runner", None)  # import -> ImportError
    assert serve_main(_parser().parse_args(["serve"])) == 2
    err = capsys.readouterr().err
    assert "kvpage serve: needs the server packages" in err
    assert "scripts/bootstrap.sh" in err and "kvpage[server]" in err


def test_serve_replicas_without_ray_names_both_extras(monkeypatch, capsys):
    """--replicas on a venv without Ray Serve (or the server packages): one clear line."""
    import sys

    from kvpage.cli import main

    monkeypatch.setitem(sys.modules, "kvpage.cluster.launch", None)  # import -> ImportError
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "need Ray Serve and the server packages" in err and "kvpage[server,cluster]" in err
