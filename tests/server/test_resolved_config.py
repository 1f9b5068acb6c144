"""``kvpage serve --dump-config --resolved``: the values start-up decided, pinned.

Dump -> restore -> dump is a fixed point; a server started from the resolved file has
the original's pool and answers the same greedy tokens; ``GET /admin/config`` of the
running server is the same resolved configuration; a file resolved on another machine
starts with a warning naming each difference.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvpage.server.cli import add_serve_parser, serve_main
from kvpage.server.config import ServerConfig, load_config

pytestmark = pytest.mark.xdist_group("server_resolved_config")

PROMPTS = ["Once upon a time", "The little dog"]


def _dump(capsys: Any, *argv: str) -> str:
    p = argparse.ArgumentParser(prog="kvpage")
    add_serve_parser(p.add_subparsers(dest="cmd"))
    assert serve_main(p.parse_args(["serve", *argv, "--dump-config"])) == 0
    return str(capsys.readouterr().out)


def _greedy_and_pool(cfg: ServerConfig) -> tuple[list[str], int, dict[str, Any]]:
    from kvpage.server.app import create_app
    from kvpage.server.runner import BackgroundServer

    srv = BackgroundServer(create_app(cfg)).start()
    try:
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(
                srv.base_url + "/v1/completions",
                json={"model": "stories260K", "prompt": prompt, "max_tokens": 12, "temperature": 0},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        admin = httpx.get(srv.base_url + "/admin/config", timeout=30).json()
        return texts, int(srv.app.state.serving.engine.cache_spec.num_blocks), admin
    finally:
        srv.stop()


def test_resolved_dump_is_a_fixed_point_and_restores_identically(
    tmp_path: Path, capsys: Any
) -> None:
    plain = yaml.safe_load(_dump(capsys, "--max-num-seqs", "8"))
    for k in ("num_blocks", "max_model_len", "num_threads"):
        assert plain["engine"][k] is None, k  # decided at start-up, again on every start
    assert plain["engine"]["backend"] == "auto" and plain["resolved_on"] is None

    first = _dump(capsys, "--max-num-seqs", "8", "--resolved")
    data = yaml.safe_load(first)
    e = data["engine"]
    # stories260K: max_model_len 512, ceil(8 * 512 / 16) + 1 blocks, 1 thread, a backend
    assert (e["max_model_len"], e["num_blocks"], e["num_threads"]) == (512, 257, 1)
    assert e["backend"] not in ("auto", None)
    assert data["resolved_on"]["cpu_count"] and data["resolved_on"]["kvpage"]
    path = tmp_path / "resolved.yaml"
    path.write_text(first)
    again = _dump(capsys, "--config", str(path), "--resolved")
    assert again == first  # dump -> restore -> dump: a fixed point
    assert _dump(capsys, "--config", str(path)) == first  # nothing left to resolve

    original = ServerConfig.model_validate({**plain, "log_level": "warning"})
    restored = load_config(path).model_copy(update={"log_level": "warning"})
    texts_a, blocks_a, admin_a = _greedy_and_pool(original)
    texts_b, blocks_b, admin_b = _greedy_and_pool(restored)
    assert texts_a == texts_b and all(texts_a)
    assert blocks_a == blocks_b == 257
    # the running server's effective config is the resolved file (same machine)
    assert admin_a["config"]["engine"] == admin_b["config"]["engine"] == e
    assert admin_a["config"]["resolved_on"] == data["resolved_on"]
    assert admin_a["machines"]["server"] == data["resolved_on"]


def test_resolved_only_with_dump_config(capsys: Any) -> None:
    p = argparse.ArgumentParser(prog="kvpage")
    add_serve_parser(p.add_subparsers(dest="cmd"))
    assert serve_main(p.parse_args(["serve", "--resolved"])) == 2
    assert "--resolved: expected with --dump-config" in capsys.readouterr().err


def test_a_restore_elsewhere_names_what_differs(caplog: Any) -> None:
    from kvpage.server.resolved import machine_facts, warn_if_elsewhere

    here = machine_facts()
    assert warn_if_elsewhere(ServerConfig()) == []  # not a resolved dump
    assert warn_if_elsewhere(ServerConfig(resolved_on=here)) == []  # same machine
    other = {**here, "cpu_count": "96", "torch": "0.0.1"}
    with caplog.at_level(logging.WARNING, logger="kvpage.server"):
        diff = warn_if_elsewhere(ServerConfig(resolved_on=other))
    assert diff == [f"cpu_count: 96 -> {here['cpu_count']}", f"torch: 0.0.1 -> {here['torch']}"]
    assert "cpu_count: 96 -> " in caplog.text and "pinned values" in caplog.text


def test_admin_config_needs_an_operator_key(tmp_path: Path) -> None:
    from kvpage.server.app import create_app
    from kvpage.server.runner import BackgroundServer

    cfg = ServerConfig.model_validate(
        {
            "log_level": "warning",
            "engine": {"num_blocks": 65},
            "security": {"api_keys": ["sk-user"], "metrics_api_keys": ["sk-op"]},
        }
    )
    srv = BackgroundServer(create_app(cfg)).start()
    try:
        url = srv.base_url + "/admin/config"
        assert httpx.get(url, timeout=30).status_code == 401
        r = httpx.get(url, headers={"Authorization": "Bearer sk-user"}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "operator_key_required"
        r = httpx.get(url, headers={"Authorization": "Bearer sk-op"}, timeout=30)
        assert r.status_code == 200
        body = r.json()
        assert body["config"]["engine"]["num_blocks"] == 65
        assert "sk-user" not in r.text and "sk-op" not in r.text  # secrets never shown
    finally:
        srv.stop()
