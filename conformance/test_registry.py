"""Registry and selection: lazy plugins, reasons instead of crashes, explicit choices."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
import torch

from kvpage.backends import (
    available_backends,
    backend_reasons,
    get_backend,
    registry,
    select_backend,
)
from kvpage.errors import BackendUnavailableError
from kvpage.specs import make_cache_spec

SPEC = make_cache_spec(
    num_layers=1,
    block_size=16,
    num_blocks=8,
    layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=64)],
)


def test_builtins_and_reference_is_not_a_backend() -> None:
    assert available_backends()[0] == "torch"
    assert get_backend("torch").name == "torch"
    with pytest.raises(BackendUnavailableError) as e:
        get_backend("reference")
    assert "reference" in e.value.reasons
    with pytest.raises(BackendUnavailableError):
        get_backend("no-such-backend")


def test_cpu_auto_selects_torch() -> None:
    assert select_backend(SPEC, "cpu").name == "torch"
    assert select_backend(SPEC, torch.device("cpu"), prefer="torch").name == "torch"


def test_broken_plugin_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="broken", value="kvpage_no_such_module:Nope", group="kvpage.backends")
    eps = dict(registry._plugin_entry_points())
    eps["broken"] = broken
    monkeypatch.setattr(registry, "_plugin_entry_points", lambda: eps)
    assert "broken" in available_backends()
    why = backend_reasons("broken", SPEC, "cpu")
    assert why and "import failed" in why[0] and "kvpage_no_such_module" in why[0]
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(SPEC, "cpu", prefer="broken")
    assert e.value.reasons["broken"] == why
    monkeypatch.setitem(registry.PRIORITY, "cpu", ("broken", "torch"))
    assert select_backend(SPEC, "cpu").name == "torch"


def test_no_candidate_lists_every_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.PRIORITY, "meta", ("torch",))
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(SPEC, "meta")
    assert set(e.value.reasons) == {"torch"} and e.value.reasons["torch"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cuda_without_gpu_lists_all_candidates() -> None:
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(SPEC, "cuda")
    assert set(e.value.reasons) == set(registry.PRIORITY["cuda"])
    assert all(e.value.reasons[n] for n in registry.PRIORITY["cuda"])
    with pytest.raises(BackendUnavailableError):
        select_backend(SPEC, "cuda", prefer="torch")
