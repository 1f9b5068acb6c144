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
