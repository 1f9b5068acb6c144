"""A wrong file given as a model preset (e.g. the API keys file) is refused naming the
file and its first failing field, never printing the file's contents; values quoted
by spec errors are bounded (``kvpage.errors.got_repr``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpage.cli import main
from kvpage.errors import SpecError
from kvpage.specs.presets import load_preset

SECRET = "sk-secret-alice-0123456789abcdef"


def test_plan_with_a_keys_file_does_not_print_it(tmp_path: Path, capsys) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(f"tenants:\n  alice:\n    keys: [{SECRET}]\n    rate: 50\n")
    assert main(["plan", "--model", str(f), "--memory", "80GB"]) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and "tenants" not in err
    assert str(f) in err and "invalid Preset" in err
    with pytest.raises(SpecError) as ei:
        load_preset(str(f))
    assert SECRET not in str(ei.value)


def test_spec_error_values_are_bounded() -> None:
    from kvpage.specs.core import validated
    from kvpage.specs.presets import Preset

    with pytest.raises(SpecError) as ei:
        validated(Preset, {"name": "x" * 100_000, "source": ["y" * 100_000]})
    assert len(str(ei.value)) < 2000
