"""The ``kvpage`` command line refuses abbreviated options by name."""

from __future__ import annotations

import pytest

from kvpage.cli import build_parser


def test_abbreviated_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    full = parser.parse_args(["plan", "--model", "llama-3-8b", "--memory", "80"])
    assert full.memory is not None
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["plan", "--model", "llama-3-8b", "--mem", "80"])
    assert e.value.code == 2
    assert "--mem" in capsys.readouterr().err
