"""Registry and selection: lazy plugins, reasons instead of crashes, explicit choices."""

from __future__ import annotations

import importlib.util
from importlib.metadata import EntryPoint

import pytest
import torch

from kvpage.attention.protocol import BackendCapabilities
from kvpage.backends import (
    auto_order,
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


#: what "auto" picks on CPU: the native-cpu C kernel (priority 5) where a C compiler
#: builds it, else the torch backend (priority 0); the numba-cpu kernel ranks after
#: torch (priority -10: slower on the bundled model, docs/benchmarks.md)
CPU_AUTO = "native-cpu" if not backend_reasons("native-cpu", SPEC, "cpu") else "torch"


def test_cpu_auto_selects_the_c_kernel_then_torch_then_numba() -> None:
    assert select_backend(SPEC, "cpu").name == CPU_AUTO
    order = auto_order("cpu")
    assert order[:2] == ["native-cpu", "torch"]
    if importlib.util.find_spec("numba") is not None:
        assert order.index("numba-cpu") > order.index("torch")
    assert select_backend(SPEC, torch.device("cpu"), prefer="torch").name == "torch"
    fp16 = make_cache_spec(
        num_layers=1, block_size=16, num_blocks=8, dtype="float16",
        layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=64)],
    )  # fmt: skip
    assert select_backend(fp16, "cpu").name == "torch"  # native-cpu, numba-cpu refuse it


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
    assert select_backend(SPEC, "cpu").name == CPU_AUTO  # the broken plugin is a reason
    reasons: dict[str, list[str]] = {}
    assert "broken" not in auto_order("cpu", reasons) and "import failed" in reasons["broken"][0]


class _Declared:
    """A plugin that declares its own priority (no registry edit needed)."""

    def __init__(self, name: str, priority: dict[str, int]) -> None:
        self.name = name
        self.capabilities = BackendCapabilities(devices=frozenset(priority), priority=priority)

    def unsupported_reasons(self, spec: object, device: torch.device) -> list[str]:
        return [] if torch.device(device).type in self.capabilities.devices else ["device"]


def test_auto_ranks_plugins_by_their_declared_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    made = {"fast": _Declared("fast", {"cpu": 5}), "slow": _Declared("slow", {"cpu": -1}),
            "cudaonly": _Declared("cudaonly", {"cuda": 99})}  # fmt: skip
    real = registry.get_backend
    monkeypatch.setattr(registry, "available_backends", lambda: ["torch", *made])
    monkeypatch.setattr(registry, "get_backend", lambda n: made[n] if n in made else real(n))
    reasons: dict[str, list[str]] = {}
    assert auto_order("cpu", reasons) == ["fast", "torch", "slow"]
    assert "declares none for cpu" in reasons["cudaonly"][0]
    assert select_backend(SPEC, "cpu").name == "fast"
    assert auto_order("cuda") == ["cudaonly", "torch"]


def test_no_candidate_lists_every_reason() -> None:
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(SPEC, "meta")
    assert e.value.reasons["torch"] and all(e.value.reasons.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cuda_without_gpu_lists_all_candidates() -> None:
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(SPEC, "cuda")
    assert {"triton", "cupy", "numba", "torch"} <= set(e.value.reasons)
    assert auto_order("cuda")[:3] == ["triton", "cupy", "numba"]  # declared by each plugin
    assert all(e.value.reasons.values())
    with pytest.raises(BackendUnavailableError):
        select_backend(SPEC, "cuda", prefer="torch")
