"""``--dump-config`` runs the start-up checks that need no model load and refuses
(exit 2) a config that could not start, instead of writing it."""

from __future__ import annotations

import os

import pytest
import yaml

from kvpage.cli import main
from kvpage.errors import SpecError
from kvpage.server.config import ServerConfig


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--max-model-len", "100000"], "max_model_len: expected <= 512"),
        (["--host", "0.0.0.0"], "host: expected a loopback address"),
        (["--metrics-port", "8013", "--port", "8013"], "security.metrics_port: expected a port"),
        (["--replicas", "1000"], "deployment: expected replicas needing"),
    ],
)
def test_dump_config_refuses_what_start_up_refuses(argv, named, capsys):
    assert main(["serve", "--dump-config", *argv]) == 2
    io = capsys.readouterr()
    assert named in io.err and io.out == ""


def test_dump_config_still_writes_good_configs(capsys):
    assert main(["serve", "--dump-config", "--max-model-len", "256", "--port", "8013"]) == 0
    cfg = ServerConfig.model_validate(yaml.safe_load(capsys.readouterr().out))
    assert cfg.engine.max_model_len == 256
    n = max(1, (os.cpu_count() or 1) // 2)
    assert main(["serve", "--dump-config", "--replicas", str(n)]) == 0


def test_equal_ports_named_at_start_up():
    with pytest.raises(Exception, match="other than port \\(8013\\)"):
        ServerConfig.model_validate({"port": 8013, "security": {"metrics_port": 8013}})
    ServerConfig.model_validate({"port": 0, "security": {"metrics_port": 0}})  # any free ports
    with pytest.raises(SpecError, match="metrics_port"):
        from test_config_cli import _parser

        from kvpage.server.cli import config_from_args

        config_from_args(_parser().parse_args(["serve", "--port", "9", "--metrics-port", "9"]))
