"""`kvpage serve MODEL`, --allow-unknown-fields and the degraded-mode cap default
(issue 15), without starting a server."""

from __future__ import annotations

import argparse

import pytest

from kvpage.errors import SpecError
from kvpage.server.cli import add_serve_parser, config_from_args
from kvpage.server.config import DegradationConfig, ServerConfig
from kvpage.server.degradation import DegradationController


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_positional_model_and_allow_unknown_fields():
    cfg = config_from_args(_args("my-model", "--allow-unknown-fields"))
    assert cfg.engine.model == "my-model" and cfg.allow_unknown_fields
    assert config_from_args(_args("m", "--model", "m")).engine.model == "m"
    assert not config_from_args(_args()).allow_unknown_fields
    with pytest.raises(SpecError, match="MODEL: expected the same model as --model"):
        config_from_args(_args("a", "--model", "b"))


def test_degraded_mode_never_caps_max_tokens_by_default():
    assert ServerConfig().degradation.max_tokens_cap is None
    cfg = DegradationConfig(enter_p99_ttft_s=0.001, exit_p99_ttft_s=0.0)
    ctl = DegradationController(cfg, now=0.0)
    ctl.record_ttft(1.0, 0.1)
    assert ctl.evaluate(0.2) and ctl.degraded
    assert ctl.cap_max_tokens(500) == 500  # degraded, but no cap configured
    ctl.config.max_tokens_cap = 64
    assert ctl.cap_max_tokens(500) == 64
