"""Per-layer argument checks run at plan time in the engine (``check_layers`` once for
the runner's caches, ``check_step_layers`` once per step and KV group), not in every
layer's ``forward``; a plan used directly still has ``forward`` check every call, and
``KVPAGE_CHECK_EVERY_LAYER=1`` turns the per-layer checks back on."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvpage.attention import checks
from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.backends.torch_backend import TorchBackend
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import make_attention_spec

SPEC = make_attention_spec(num_q_heads=4, num_kv_heads=2, head_dim=8)


def _cache(num_kv_heads: int = 2, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    return allocate_kv_cache(4, 2, num_kv_heads, 8, dtype=dtype)


def _meta() -> AttentionMetadata:
    return AttentionMetadata.build([1], [3], [[1, 2]], 2)


def test_check_layers_catches_what_forward_did() -> None:
    checks.check_layers([_cache(), _cache()], [SPEC, SPEC], torch.device("cpu"))
    with pytest.raises(ShapeError, match=r"^caches\[1\]: expected num_kv_heads=2, head_dim=8"):
        checks.check_layers([_cache(), _cache(num_kv_heads=1)], [SPEC, SPEC], torch.device("cpu"))
    with pytest.raises(DTypeError, match=r"^caches\[0\].kv.dtype: expected float32"):
        checks.check_layers([_cache(dtype=torch.int16)], [SPEC], torch.device("cpu"))
    with pytest.raises(ShapeError, match=r"^caches\[0\].kv.device: expected meta, got cpu"):
        checks.check_layers([_cache()], [SPEC], torch.device("meta"))
    with pytest.raises(ShapeError, match=r"^caches: expected 2 \(one per layer spec\), got 1"):
        checks.check_layers([_cache()], [SPEC, SPEC], torch.device("cpu"))


def test_check_step_layers_catches_bad_tables_and_marks_the_plan() -> None:
    backend = TorchBackend()
    plan = backend.plan(_meta())
    assert not plan.layers_checked
    with pytest.raises(ShapeError, match=r"^meta.block_tables\[0\]: expected ids in \[0, 2\)"):
        checks.check_step_layers(plan, [(2, 2)], torch.device("cpu"))  # block 2 of a 2-block pool
    assert not plan.layers_checked
    with pytest.raises(ShapeError, match=r"^meta.device: expected meta"):
        checks.check_step_layers(plan, [(2, 4)], torch.device("meta"))
    checks.check_step_layers(plan, [(2, 4)], torch.device("cpu"))
    assert plan.layers_checked


def test_marked_plan_skips_the_per_layer_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpage.backends.torch_backend.backend as tb

    calls: list[int] = []
    real = tb.check_forward
    monkeypatch.setattr(tb, "check_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    backend, cache = TorchBackend(), _cache()
    q = torch.randn(1, 4, 8)
    backend.forward(q, cache, backend.plan(_meta()), SPEC)  # unmarked: checked
    assert calls == [1]
    marked = backend.plan(_meta())
    checks.check_step_layers(marked, [(2, 4)], torch.device("cpu"))
    out = backend.forward(q, cache, marked, SPEC)
    assert calls == [1]  # marked: no per-layer check, same result
    torch.testing.assert_close(out, backend.forward(q, cache, backend.plan(_meta()), SPEC))
    with pytest.raises(ShapeError, match=r"^query: expected \[1, 4, 8\]"):  # direct use: caught
        backend.forward(torch.randn(2, 4, 8), cache, backend.plan(_meta()), SPEC)


def test_debug_option_keeps_every_layer_checking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "CHECK_EVERY_LAYER", True)
    plan = TorchBackend().plan(_meta())
    checks.check_step_layers(plan, [(2, 4)], torch.device("cpu"))
    assert not plan.layers_checked


def test_engine_runner_checks_its_caches_at_construction() -> None:
    from kvpage.engine import LLMEngine
    from kvpage.engine.runner import ModelRunner

    eng = LLMEngine.from_config(num_blocks=8)
    r = eng.runner
    bad = list(r.kv_caches)
    bad[1] = _cache()  # another layer's shape
    with pytest.raises(ShapeError, match=r"^caches\[1\]"):
        ModelRunner(r.model, r.backend, bad, r.cache_spec, r.device)
    eng.add_request("a", [1, 5, 6], __import__("kvpage").SamplingParams(max_tokens=2))
    seen: list[object] = []  # the runner marks every step's plans
    real_plan = r.backend.plan

    def spy(meta):  # type: ignore[no-untyped-def]
        p = real_plan(meta)
        seen.append(p)
        return p

    r.backend.plan = spy  # type: ignore[method-assign]
    while eng.has_unfinished_requests():
        eng.step()
    assert seen and all(p.layers_checked for p in seen)


def test_check_step_layers_checks_and_records_the_slot_mapping() -> None:
    meta = _meta()  # 1 sequence of 3 tokens, block size 2, blocks [1, 2]: slot 4
    meta.slot_mapping = torch.tensor([6])  # block 3: inside a 4-block pool only
    plan = TorchBackend().plan(meta)
    slots = meta.slot_mapping
    with pytest.raises(
        ShapeError, match=r"^slot_mapping: expected values in \[-1, 5\], got \[6, 6\]"
    ):
        checks.check_step_layers(plan, [(2, 4), (2, 3)], torch.device("cpu"))  # 2nd pool: 6 slots
    assert not plan.layers_checked and plan.checked_slot_mapping is None
    checks.check_step_layers(plan, [(2, 4), (2, 4)], torch.device("cpu"))
    assert plan.layers_checked and plan.checked_slot_mapping is slots
    other = TorchBackend().plan(_meta())  # each step's plan owns its own record
    assert other.checked_slot_mapping is None


def test_no_pool_or_the_debug_option_records_no_slot_mapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = TorchBackend().plan(_meta())
    checks.check_step_layers(plan, [], torch.device("cpu"))  # no pool checked the slots
    assert plan.layers_checked and plan.checked_slot_mapping is None
    monkeypatch.setattr(checks, "CHECK_EVERY_LAYER", True)
    plan = TorchBackend().plan(_meta())
    checks.check_step_layers(plan, [(2, 4)], torch.device("cpu"))
    assert not plan.layers_checked and plan.checked_slot_mapping is None


def test_the_checks_keep_no_module_state() -> None:
    """No module-level container in checks.py (the old id -> slot mapping registry was
    one): what a step checked lives on its plan only."""
    tree = ast.parse(Path(checks.__file__).read_text())
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    found = [
        ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and (
            isinstance(node.value, mutable)
            or (
                isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) in {"dict", "list", "set"}
            )
        )
    ]
    assert found == []


@pytest.mark.parametrize("name", ["torch", "native-cpu"])
def test_write_kv_skips_its_check_only_for_the_recorded_slot_mapping(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvpage.backends.torch_backend.backend as tb
    from kvpage.backends import get_backend

    backend = get_backend(name)
    calls: list[int] = []
    real = checks.check_write_kv

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(tb, "check_write_kv", spy)
    monkeypatch.setattr(type(backend).__module__ + ".check_write_kv", spy)
    meta = _meta()
    plan = backend.plan(meta)
    checks.check_step_layers(plan, [(2, 4)], torch.device("cpu"))
    k = torch.randn(1, 2, 8)  # the step's one query token
    skipped, checked, unplanned = _cache(), _cache(), _cache()
    backend.write_kv(k, k, skipped, meta.slot_mapping, plan=plan)  # the engine's path: no check
    assert calls == []
    backend.write_kv(k, k, checked, meta.slot_mapping.clone(), plan=plan)  # another tensor
    assert calls == [1]
    backend.write_kv(k, k, unplanned, meta.slot_mapping)  # no plan: a direct call
    assert calls == [1, 1]
    unchecked_plan = backend.plan(_meta())  # a plan check_step_layers never saw
    backend.write_kv(k, k, _cache(), unchecked_plan.meta.slot_mapping, plan=unchecked_plan)
    assert calls == [1, 1, 1]
    torch.testing.assert_close(skipped.kv, checked.kv, rtol=0, atol=0)
    torch.testing.assert_close(skipped.kv, unplanned.kv, rtol=0, atol=0)
    with pytest.raises(ShapeError, match=r"^key: expected \[num_tokens, 2, 8\]"):  # direct: caught
        backend.write_kv(torch.randn(1, 1, 8), k, _cache(), meta.slot_mapping.clone(), plan=plan)
