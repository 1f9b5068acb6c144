"""Start-up refuses API keys that could never log in (whitespace, control characters)
and an empty ``--served-model-name`` (it silently became the model's name)."""

from __future__ import annotations

import argparse
import os

import pytest

from kvpage.errors import SpecError
from kvpage.server.auth import Authenticator
from kvpage.server.cli import add_serve_parser, config_from_args
from kvpage.server.config import SecurityConfig, ServerConfig


def _keys_file(tmp_path, key: str) -> str:
    p = tmp_path / "keys.yaml"
    p.write_text(f'tenants:\n  alice:\n    keys: ["{key}"]\n')
    os.chmod(p, 0o600)
    return str(p)


@pytest.mark.parametrize(
    "key,why",
    [
        (" sk-alice-1 ", "leading or trailing whitespace"),
        ("sk-alice-1\\t", "leading or trailing whitespace"),
        ("sk-al ice-1", "whitespace inside"),
        ("sk-alice\\u0001-1", "a control character"),
    ],
)
def test_keys_file_key_with_whitespace_or_control_chars_is_refused(tmp_path, key, why):
    with pytest.raises(SpecError) as ei:
        Authenticator(SecurityConfig(api_keys_file=_keys_file(tmp_path, key)))
    msg = str(ei.value)
    assert "api key of alice" in msg and why in msg
    assert "sk-al" not in msg  # the key itself is never quoted


def test_api_key_flag_with_spaces_is_refused_and_a_clean_key_works(tmp_path):
    with pytest.raises(SpecError, match="leading or trailing whitespace"):
        Authenticator(SecurityConfig(api_keys=[" sk-solo-1 "]))
    auth = Authenticator(SecurityConfig(api_keys_file=_keys_file(tmp_path, "sk-alice-1")))
    t = auth.authenticate("sk-alice-1")
    assert t is not None and t.name == "alice"


def _parser():
    p = argparse.ArgumentParser(prog="kvpage")
    add_serve_parser(p.add_subparsers(dest="cmd"))
    return p


@pytest.mark.parametrize("name", ["", " ", " tiny "])
def test_empty_served_model_name_is_refused(name, capsys):
    with pytest.raises(SpecError, match="served_model_name: expected a non-empty name"):
        config_from_args(_parser().parse_args(["serve", "--served-model-name", name]))
    args = _parser().parse_args(["serve", "--served-model-name", name, "--dump-config"])
    assert args.func(args) == 2
    assert "served_model_name" in capsys.readouterr().err
    assert ServerConfig(served_model_name="tiny").model_name == "tiny"
    assert ServerConfig().model_name == "stories260K"
