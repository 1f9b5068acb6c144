"""``import kvpage`` sets GNU OpenMP's wait policy only where the user has not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = (
    "import os, json, kvpage; "
    "print(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))"
)


def _env_after_import(**overrides: str) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(overrides)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5000"}),
        ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
    ],
)
def test_wait_policy_defaults_and_explicit_settings_win(
    given: dict[str, str], expected: dict[str, str | None]
) -> None:
    assert _env_after_import(**given) == expected
