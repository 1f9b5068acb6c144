"""``requirements/core.txt`` (what ``scripts/run.sh`` installs) is a subset of
``requirements/lock.txt`` with the same pins, and holds none of the heavy optional
packages (issue 23: the main job installed a 3.2 GB venv with cupy, Ray and triton)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(name: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pkg, _, ver = line.partition("==")
            out[pkg.lower().replace("_", "-")] = ver
    return out


def test_core_requirements_are_lock_pins_without_heavy_extras() -> None:
    core, lock = _pins("core.txt"), _pins("lock.txt")
    assert core and all(v for v in core.values()), core  # every line pinned
    assert {k: lock.get(k) for k in core} == core  # same pins as the full lock
    heavy = {"ray", "triton", "cupy-cuda13x", "numba", "fastapi", "transformers", "pytest"}
    assert not heavy & set(core), heavy & set(core)
    assert "torch" in core and "pydantic" in core
