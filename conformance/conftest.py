"""Conformance suite configuration: which backends run, on which device, how big.

Options:
    --backend NAME   run only this backend (repeatable). Default: every registered
                     backend that can run the probe spec on --device, plus the
                     example backends of the docs (``EXAMPLE_BACKENDS``).
    --device DEV     cpu (default) or cuda.
    --budget-scale X multiply every backend's example count (e.g. 0.2 for a quick look).

A backend that cannot run here is listed with its reasons in the pytest header. An
explicit --backend that cannot run is a usage error (with the reasons), not a skip.
Hypothesis profiles (``ci`` default, ``thorough``) come from the root conftest.py.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

from kvpage.attention.protocol import AttentionBackend
from kvpage.backends import available_backends, backend_reasons, get_backend
from kvpage.specs import make_cache_spec
from kvpage.testing import AttentionCase, TestBudget, attention_cases, budget_for

# The plugin packages live in <repo>/backends; an editable install of kvpage only puts
# src/ on sys.path, so make them importable for an in-repo run.
_PLUGINS = Path(__file__).resolve().parents[1] / "backends"
if _PLUGINS.is_dir() and str(_PLUGINS) not in sys.path:
    sys.path.append(str(_PLUGINS))

#: backends written in the docs (not registered: never selectable by the engine), run
#: by this suite so that docs/backend-authoring.md is proven to be enough
EXAMPLE_BACKENDS = {
    "example-loop": Path(__file__).resolve().parents[1] / "docs/examples/loop_backend.py",
}


def _example(name: str) -> AttentionBackend:
    """Instantiate the example backend ``name`` from its file."""
    path = EXAMPLE_BACKENDS[name]
    spec = importlib.util.spec_from_file_location(f"kvpage_docs_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    backend: AttentionBackend = module.LoopBackend()
    return backend


def _get(name: str) -> AttentionBackend:
    return _example(name) if name in EXAMPLE_BACKENDS else get_backend(name)


def _reasons(name: str, device: str) -> list[str]:
    if name in EXAMPLE_BACKENDS:
        return _example(name).unsupported_reasons(PROBE_SPEC, torch.device(device))
    return backend_reasons(name, PROBE_SPEC, device)


PROBE_SPEC = make_cache_spec(
    num_layers=1,
    block_size=16,
    num_blocks=16,
    dtype="float32",
    kv_dtype="auto",
    layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=64)],
)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kvpage conformance")
    g.addoption("--backend", action="append", default=[], help="backend name (repeatable)")
    g.addoption("--device", default="cpu", help="device to run on (cpu, cuda)")
    g.addoption("--budget-scale", type=float, default=1.0, help="scale example counts")


def _runnable(device: str) -> tuple[list[str], dict[str, list[str]]]:
    ok, refused = [], {}
    for name in [*available_backends(), *EXAMPLE_BACKENDS]:
        why = _reasons(name, device)
        if why:
            refused[name] = why
        else:
            ok.append(name)
    return ok, refused


def _selected(config: pytest.Config) -> list[str]:
    device = config.getoption("--device")
    ok, refused = _runnable(device)
    wanted = config.getoption("--backend")
    if not wanted:
        return ok
    bad = {n: refused.get(n, ["not registered"]) for n in wanted if n not in ok}
    if bad:
        lines = [f"{n}: {'; '.join(w)}" for n, w in bad.items()]
        raise pytest.UsageError(f"--backend cannot run on {device}:\n  " + "\n  ".join(lines))
    return list(wanted)


def pytest_report_header(config: pytest.Config) -> list[str]:
    device = config.getoption("--device", "cpu")
    ok, refused = _runnable(device)
    lines = [f"kvpage conformance on {device}: runnable backends {ok}"]
    for n, why in refused.items():
        lines.append(f"  not runnable: {n}: {'; '.join(why)}")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", _selected(metafunc.config))


@dataclass
class BackendContext:
    """What a conformance test gets: the backend, the device and its budget."""

    name: str
    backend: AttentionBackend
    device: torch.device
    budget: TestBudget

    def examples(self, base: int | None = None) -> int:
        """Example count: the profile's ``max_examples`` (or ``base``) times the budget."""
        return self.budget.examples(base if base is not None else settings().max_examples)

    def settings(self, base: int | None = None) -> settings:
        return settings(max_examples=self.examples(base))

    def supports(self, spec_reasons: list[str]) -> None:
        """Skip a (non-Hypothesis) test whose fixed spec the backend refuses. Inside
        ``@given`` use ``cases()`` instead: a skip there would skip the whole property
        on one refused draw."""
        if spec_reasons:
            pytest.skip(f"{self.name} does not support this case: {'; '.join(spec_reasons)}")

    def cases(
        self, budget: TestBudget | None = None, **kw: Any
    ) -> st.SearchStrategy[AttentionCase]:
        """``attention_cases`` within the budget and capabilities, filtered to the cases
        whose spec the backend accepts on this device (``unsupported_reasons``)."""
        strat = attention_cases(budget or self.budget, self.backend.capabilities, **kw)
        return strat.filter(
            lambda c: not self.backend.unsupported_reasons(c.cache_spec(), self.device)
        )


@pytest.fixture
def ctx(backend_name: str, request: pytest.FixtureRequest) -> BackendContext:
    device = torch.device(request.config.getoption("--device"))
    backend = _get(backend_name)
    budget = budget_for(backend, device)
    scale = request.config.getoption("--budget-scale")
    if scale != 1.0:
        budget = replace(budget, example_fraction=budget.example_fraction * scale)
    return BackendContext(backend_name, backend, device, budget)
