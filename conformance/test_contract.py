"""The protocol's non-numeric contract: the typed plan, each named error without side
effects (every check of ``kvpage.attention.checks`` and ``kvpage.attention.plan`` has a
test here that fails when the check is removed: docs/mutation-testing.md), copy_blocks.

Spec: docs/edge-cases.md (section "Contract")."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_layer_cache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import AttentionBackend, BackendCapabilities
from kvpage.errors import DTypeError, KVPageError, ShapeError
from kvpage.specs import make_cache_spec
from kvpage.testing import AttentionCase, assert_cache_bits_equal, clone_cache, materialize

KV_DTYPES = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]


def _spec(kv_dtype: str = "auto", **kw):  # type: ignore[no-untyped-def]
    return make_cache_spec(
        num_layers=1,
        block_size=kw.pop("block_size", 4),
        num_blocks=kw.pop("num_blocks", 6),
        kv_dtype=kv_dtype,
        layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=8)],
        **kw,
    )


def test_protocol_and_capabilities(ctx) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(ctx.backend, AttentionBackend)
    caps = ctx.backend.capabilities
    assert isinstance(caps, BackendCapabilities)
    assert isinstance(ctx.backend.name, str) and ctx.backend.name
    assert all(isinstance(v, int) for v in caps.priority.values())
    assert set(caps.priority) <= set(caps.devices)
    budget = ctx.backend.test_budget(ctx.device)
    assert budget is None or isinstance(budget, Mapping)
    why = ctx.backend.unsupported_reasons(_spec(), torch.device("meta"))
    assert isinstance(why, list) and why, "a meta device must be refused with a reason"


def _step(ctx, query_lens, seq_lens, tables):  # type: ignore[no-untyped-def]
    return AttentionMetadata.build(query_lens, seq_lens, tables, 4, device=ctx.device)


def test_plan_is_typed_frozen_and_validates_the_step(ctx) -> None:  # type: ignore[no-untyped-def]
    """plan() returns a frozen StepPlan subclass; an inconsistent step raises a named
    error there (once per step), before any layer runs."""
    ctx.supports(ctx.backend.unsupported_reasons(_spec(), ctx.device))
    meta = _step(ctx, [1, 1], [3, 5], [[1], [2, 3]])
    plan = ctx.backend.plan(meta)
    assert isinstance(plan, StepPlan) and plan.meta is meta
    assert (plan.num_seqs, plan.num_tokens, plan.max_query_len, plan.is_decode) == (2, 2, 1, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 3  # type: ignore[misc]
    pre = ctx.backend.plan(_step(ctx, [2, 1], [3, 5], [[1], [2, 3]]))
    assert (pre.num_tokens, pre.max_query_len, pre.is_decode) == (3, 2, False)
    empty = ctx.backend.plan(_step(ctx, [0, 1], [3, 5], [[1], [2, 3]]))
    assert (empty.num_tokens, empty.is_decode) == (1, False)
    whole = ctx.backend.plan(_step(ctx, [3, 1], [3, 5], [[1], [2, 3]]))  # query_len == seq_len
    assert (whole.num_tokens, whole.max_query_len) == (4, 3)
    none = ctx.backend.plan(_step(ctx, [], [], []))  # a step without sequences
    assert (none.num_seqs, none.num_tokens, none.max_query_len) == (0, 0, 0)
    bad: list[tuple[str, type[Exception], dict[str, object]]] = [
        ("meta.query_lens_cpu: expected 2 entries", ShapeError, {"query_lens_cpu": [1]}),
        (
            r"meta.query_lens_cpu\[1\]: expected 0 <= q <= 5, got 6",
            ShapeError,
            {"query_lens_cpu": [1, 6]},
        ),  # fmt: skip
        (
            r"meta.query_lens_cpu\[0\]: expected 0 <= q <= 3, got -1",
            ShapeError,
            {"query_lens_cpu": [-1, 1]},
        ),  # fmt: skip
        ("meta.max_query_len: expected 1, got 2", ShapeError, {"max_query_len": 2}),
        ("meta.max_seq_len: expected 5, got 4", ShapeError, {"max_seq_len": 4}),
        (
            r"meta.slot_mapping: expected \[2\]",
            ShapeError,
            {"slot_mapping": meta.slot_mapping[:1]},
        ),  # fmt: skip
        (r"meta.seq_lens: expected \[2\]", ShapeError, {"seq_lens": meta.seq_lens[:1]}),
        (
            r"meta.query_start_loc: expected \[3\]",
            ShapeError,
            {"query_start_loc": meta.query_start_loc[:2]},
        ),  # fmt: skip
        (
            r"meta.block_tables: expected \[2, max_blocks\]",
            ShapeError,
            {"block_tables": meta.block_tables[:1]},
        ),  # fmt: skip
        (
            r"meta.block_tables: expected \[2, max_blocks\]",
            ShapeError,
            {"block_tables": meta.block_tables[0]},
        ),  # fmt: skip
        (
            "meta.block_tables: expected int32.int64, got torch.float32",
            DTypeError,
            {"block_tables": meta.block_tables.float()},
        ),  # fmt: skip
        (
            "meta.block_tables: expected int32|int64, got torch.int16",
            DTypeError,
            {"block_tables": meta.block_tables.to(torch.int16)},
        ),  # fmt: skip
        (
            "meta.slot_mapping: expected int32.int64, got torch.bool",
            DTypeError,
            {"slot_mapping": meta.slot_mapping.bool()},
        ),  # fmt: skip
        (
            "meta.seq_lens: expected int32.int64, got torch.int16",
            DTypeError,
            {"seq_lens": meta.seq_lens.to(torch.int16)},
        ),
        ("meta.block_tables.device", ShapeError, {"block_tables": meta.block_tables.to("meta")}),
    ]
    for match, err, change in bad:
        with pytest.raises(err, match=match):
            ctx.backend.plan(dataclasses.replace(meta, **change))


def test_forward_rejects_bad_arguments_and_writes_nothing(ctx) -> None:  # type: ignore[no-untyped-def]
    """Each per-layer check of forward raises its own named error, and a rejected
    call leaves ``out`` untouched; a valid call records the checked pool in the plan."""
    spec = _spec()
    ctx.supports(ctx.backend.unsupported_reasons(spec, ctx.device))
    dev = ctx.device
    cache = allocate_layer_cache(spec, 0, dev)
    a = spec.layers[0]
    plan = ctx.backend.plan(_step(ctx, [1, 1], [3, 5], [[1], [2, 3]]))
    q = torch.randn(2, 4, 8, device=dev)

    def rejects(match: str, err: type[Exception], query, cache=cache, plan=plan, spec=a, out=None):  # type: ignore[no-untyped-def]
        sentinel = None if out is None else out.clone()
        with pytest.raises(err, match=match):
            ctx.backend.forward(query, cache, plan, spec, out=out)
        if out is not None:
            assert torch.equal(out.view(torch.uint8), sentinel.view(torch.uint8)), "out was written"

    rejects(r"query: expected \[2, 4, 8\], got \[2, 4, 7\]", ShapeError, q[..., :7])
    rejects(
        r"query: expected \[2, 4, 8\], got \[3, 4, 8\]",
        ShapeError,
        torch.randn(3, 4, 8, device=dev),
    )
    rejects(r"query: expected \[2, 4, 8\], got \[2, 3, 8\]", ShapeError, q[:, :3])
    rejects(r"query: expected \[2, 4, 8\], got \[2, 32\]", ShapeError, q.view(2, 32))
    rejects("query: expected float32|float16|bfloat16, got torch.int32", DTypeError, q.to(torch.int32))  # fmt: skip
    rejects(r"out: expected \[2, 4, 8\], got \[2, 4, 9\]", ShapeError, q, out=torch.zeros(2, 4, 9, device=dev))  # fmt: skip
    rejects("out: expected torch.float32, got torch.float16", DTypeError, q, out=torch.zeros(2, 4, 8, dtype=torch.float16, device=dev))  # fmt: skip
    rejects("query.device", ShapeError, q.to("meta"))
    other = make_cache_spec(
        num_layers=1,
        block_size=4,
        num_blocks=6,
        layers=[dict(num_q_heads=4, num_kv_heads=1, head_dim=8)],
    ).layers[0]
    rejects("cache: expected num_kv_heads=1, head_dim=8, got 2, 8", ShapeError, q, spec=other)
    wide = make_cache_spec(
        num_layers=1,
        block_size=4,
        num_blocks=6,
        layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=16)],
    ).layers[0]
    rejects("cache: expected num_kv_heads=2, head_dim=16, got 2, 8", ShapeError, torch.randn(2, 4, 16, device=dev), spec=wide)  # fmt: skip
    rejects(r"cache.kv: expected \[2, num_blocks", ShapeError, q, cache=KVCache(kv=cache.kv[0]))
    narrow = ctx.backend.plan(
        AttentionMetadata.build([1, 1], [3, 5], [[1, 4], [2, 3, 5]], 2, device=dev)
    )  # tables for 2-token blocks: 3 columns; a cache of 1-token blocks needs 5
    small = allocate_layer_cache(_spec(block_size=1, num_blocks=8), 0, dev)
    rejects(r"meta.block_tables\[1\]: expected >= 5 blocks for 5 tokens, got 3", ShapeError, q, cache=small, plan=narrow)  # fmt: skip
    if torch.device(dev).type == "cpu":  # block ids: checked on the host only (no sync)
        for ids, seen in (([[6], [2, 3]], "[6]"), ([[1], [-1, 3]], "[-1, 3]")):
            p = ctx.backend.plan(_step(ctx, [1, 1], [3, 5], ids))
            rejects(rf"meta.block_tables\[\d\]: expected ids in \[0, 6\), got \{seen}", ShapeError, q, plan=p)  # fmt: skip
    out = torch.full((2, 4, 8), float("nan"), device=dev)
    assert ctx.backend.forward(q, cache, plan, a, out=out) is not None
    assert (4, 6) in plan.tables_checked
    last = ctx.backend.plan(_step(ctx, [1, 1], [3, 24], [[1], [0, 1, 2, 5, 4, 3]]))
    ctx.backend.forward(q, cache, last, a)  # 24 tokens need exactly 6 blocks: accepted


def test_forward_checks_sinks(ctx) -> None:  # type: ignore[no-untyped-def]
    """``sinks=`` agrees with ``spec.sinks`` (``checks.check_sinks``): missing for a
    sink layer, given for a layer without, misshaped, not float32 or misplaced — each a
    named error that writes nothing. Backends without sink support refuse the layer."""
    from kvpage.errors import BackendUnavailableError

    spec = make_cache_spec(
        num_layers=1,
        block_size=4,
        num_blocks=6,
        layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=8, sinks=True)],
    )
    plain = _spec()
    dev = ctx.device
    ctx.supports(ctx.backend.unsupported_reasons(plain, ctx.device))
    if not ctx.backend.capabilities.sinks:
        assert ctx.backend.unsupported_reasons(spec, ctx.device) or ctx.name.startswith("example-")
        pytest.skip(f"{ctx.name} does not declare attention sinks")
    assert not ctx.backend.unsupported_reasons(spec, ctx.device)
    cache = allocate_layer_cache(spec, 0, dev)
    plan = ctx.backend.plan(_step(ctx, [1, 1], [3, 5], [[1], [2, 3]]))
    q = torch.randn(2, 4, 8, device=dev)
    a, b = spec.layers[0], plain.layers[0]
    good = torch.zeros(4, device=dev)
    cases = [
        (r"sinks: expected \[4\] float32 \(spec.sinks is True\), got None", ShapeError, a, None),
        (r"sinks: expected None \(spec.sinks is False\), got \[4\]", ShapeError, b, good),
        (r"sinks: expected \[4\], got \[3\]", ShapeError, a, good[:3]),
        (r"sinks: expected \[4\], got \[1, 4\]", ShapeError, a, good.view(1, 4)),
        ("sinks: expected float32, got torch.float16", DTypeError, a, good.half()),
        ("sinks.device", ShapeError, a, good.to("meta")),
    ]
    for match, err, layer, sinks in cases:
        out = torch.full((2, 4, 8), float("nan"), device=dev)
        with pytest.raises((err, BackendUnavailableError), match=match):
            ctx.backend.forward(q, cache, plan, layer, out=out, sinks=sinks)
        assert bool(torch.isnan(out).all()), f"out was written ({match})"
    res = ctx.backend.forward(q, cache, plan, a, sinks=good)
    assert bool(torch.isfinite(res).all())


def test_cache_layout_checks(ctx) -> None:  # type: ignore[no-untyped-def]
    """A quantized cache missing its scales (or with misshaped ones) is refused by
    name by forward and write_kv."""
    dev = ctx.device
    q = torch.randn(2, 4, 8, device=dev)
    k = torch.randn(2, 2, 8, device=dev)
    for kv_dtype in ("int8", "fp8_e4m3"):
        spec = _spec(kv_dtype)
        if ctx.backend.unsupported_reasons(spec, dev):
            continue
        plan = ctx.backend.plan(_step(ctx, [1, 1], [3, 5], [[1], [2, 3]]))
        good = allocate_layer_cache(spec, 0, dev)
        if kv_dtype == "int8":
            broken = [
                ("cache.token_scales: expected", dataclasses.replace(good, token_scales=None)),
                (
                    "cache.token_scales: expected",
                    dataclasses.replace(good, token_scales=good.token_scales[:, :1]),
                ),  # fmt: skip
            ]
        else:
            broken = [
                ("cache.k_scale: expected", dataclasses.replace(good, k_scale=None)),
                (
                    "cache.v_scale: expected",
                    dataclasses.replace(good, v_scale=torch.ones(3, device=dev)),
                ),  # fmt: skip
                (
                    "cache.k_scale: expected",
                    dataclasses.replace(good, k_scale=torch.ones(2, 2, device=dev)),
                ),  # fmt: skip
            ]
        for match, cache in broken:
            with pytest.raises(ShapeError, match=match):
                ctx.backend.forward(q, cache, plan, spec.layers[0])
            with pytest.raises(ShapeError, match=match):
                ctx.backend.write_kv(k, k, cache, torch.tensor([0, 1], device=dev))
        per_head = dataclasses.replace(good, k_scale=torch.ones(2, device=dev), v_scale=torch.ones((), device=dev)) if kv_dtype != "int8" else good  # fmt: skip
        ctx.backend.forward(q, per_head, plan, spec.layers[0])  # [] and [num_kv_heads] scales


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_rejects_bad_input_and_changes_nothing(ctx, kv_dtype) -> None:  # type: ignore[no-untyped-def]
    spec = _spec(kv_dtype)
    ctx.supports(ctx.backend.unsupported_reasons(spec, ctx.device))
    cache = allocate_layer_cache(spec, 0, ctx.device)
    before = clone_cache(cache)
    dev = ctx.device
    k = torch.randn(3, 2, 8, device=dev)
    bad = [
        (torch.randn(3, 2, 7, device=dev), k, torch.tensor([1, 2, 3], device=dev)),  # head_dim
        (k, k, torch.tensor([1, 2], device=dev)),  # slot count
        (k, k[:1], torch.tensor([1, 2, 3], device=dev)),  # value count
        (k.to(torch.int32), k, torch.tensor([1, 2, 3], device=dev)),  # dtype
    ]
    if torch.device(dev).type == "cpu":  # slot ranges: checked on the host only (no sync)
        bad += [
            (k, k, torch.tensor([1, 2, 6 * 4], device=dev)),  # slot out of range
            (k, k, torch.tensor([1, -2, 3], device=dev)),  # negative other than -1
        ]
    matches = [
        r"key: expected \[num_tokens, 2, 8\], got \[3, 2, 7\]",
        r"slot_mapping: expected \[3\], got \[2\]",
        "value: expected 3 tokens like key, got 1",
        "key: expected float32|float16|bfloat16, got torch.int32",
        r"slot_mapping: expected values in \[-1, 23\], got \[1, 24\]",
        r"slot_mapping: expected values in \[-1, 23\], got \[-2, 3\]",
    ]
    for (key, value, slots), match in zip(bad, matches):
        with pytest.raises(KVPageError, match=match):
            ctx.backend.write_kv(key, value, cache, slots)
        assert_cache_bits_equal(cache, before, what="cache after a rejected write_kv")
    with pytest.raises(DTypeError, match="slot_mapping: expected int64, got torch.float32"):
        ctx.backend.write_kv(k, k, cache, torch.tensor([1.0, 2.0, 3.0], device=dev))
    with pytest.raises(ShapeError, match="value.device"):
        ctx.backend.write_kv(k, k.to("meta"), cache, torch.tensor([1, 2, 3], device=dev))
    edge = torch.tensor([-1, 0, 6 * 4 - 1], device=dev)  # the range's ends are accepted
    ctx.backend.write_kv(k.to(cache.kv.dtype) if kv_dtype == "auto" else k, k, cache, edge)


def test_write_kv_with_the_step_plan(ctx) -> None:  # type: ignore[no-untyped-def]
    """``write_kv(..., plan=plan)`` as the model's layers call it: bit-identical to the
    call without; the plan never waives the check of an unchecked plan, of another slot
    mapping or of bad input (a backend may skip only for ``plan.checked_slot_mapping``)."""
    from kvpage.attention.checks import check_step_layers

    spec = _spec()
    ctx.supports(ctx.backend.unsupported_reasons(spec, ctx.device))
    dev = ctx.device
    meta = _step(ctx, [3], [3], [[1, 2]])  # 3 new tokens at slots 4, 5, 6 (block size 4)
    plan = ctx.backend.plan(meta)
    plain, planned = (allocate_layer_cache(spec, 0, dev) for _ in range(2))
    k = torch.randn(3, 2, 8, device=dev).to(plain.kv.dtype)
    bad = torch.randn(3, 2, 7, device=dev).to(plain.kv.dtype)
    ctx.backend.write_kv(k, k, plain, meta.slot_mapping)
    ctx.backend.write_kv(k, k, planned, meta.slot_mapping, plan=plan)
    assert_cache_bits_equal(planned, plain, what="write_kv with plan=")
    with pytest.raises(ShapeError, match=r"key: expected \[num_tokens, 2, 8\]"):
        ctx.backend.write_kv(bad, k, planned, meta.slot_mapping, plan=plan)  # unchecked plan
    check_step_layers(plan, [(spec.block_size, spec.num_blocks)], torch.device(dev))
    assert plan.checked_slot_mapping is meta.slot_mapping
    with pytest.raises(ShapeError, match=r"key: expected \[num_tokens, 2, 8\]"):
        ctx.backend.write_kv(bad, k, planned, meta.slot_mapping.clone(), plan=plan)
    ctx.backend.write_kv(k, k, planned, meta.slot_mapping, plan=plan)  # the engine's path
    assert_cache_bits_equal(planned, plain, what="write_kv with a checked plan")


def test_copy_blocks_bit_exact(ctx) -> None:  # type: ignore[no-untyped-def]
    """copy_blocks copies whole blocks (scales too) bit-exactly in every layer and
    leaves other blocks bit-identical; a bad pair raises and copies nothing."""

    @ctx.settings()
    @given(case=ctx.cases(), data=st.data())
    def prop(case: AttentionCase, data: st.DataObject) -> None:
        caches = [materialize(case, ctx.device).cache for _ in range(2)]
        nb = case.num_blocks
        dst = data.draw(
            st.lists(st.integers(0, min(nb, 512) - 1), unique=True, min_size=0, max_size=4),
            label="dst",
        )
        src = [data.draw(st.integers(0, min(nb, 512) - 1), label="src") for _ in dst]
        pairs = [(s, d) for s, d in zip(src, dst) if s not in dst]
        expect = [clone_cache(c) for c in caches]
        for e in expect:
            for s, d in pairs:
                e.kv.view(torch.uint8)[:, d] = e.kv.view(torch.uint8)[:, s]
                if e.token_scales is not None:
                    e.token_scales[:, d] = e.token_scales[:, s]
        p = torch.tensor(pairs, dtype=torch.int64).view(-1, 2).to(ctx.device)
        ctx.backend.copy_blocks(caches, p)
        for c, e in zip(caches, expect):
            assert_cache_bits_equal(c, e, what="copy_blocks")
        before = [clone_cache(c) for c in caches]
        for bad in ([[0, nb]], [[-1, 0]], [[nb, 0]]):
            with pytest.raises(ShapeError, match=rf"pairs: expected block ids in \[0, {nb - 1}\]"):
                ctx.backend.copy_blocks(caches, torch.tensor(bad, device=ctx.device))
        with pytest.raises(ShapeError, match=r"pairs: expected \[n, 2\]"):
            ctx.backend.copy_blocks(caches, torch.tensor([0, 1], device=ctx.device))
        with pytest.raises(KVPageError, match=r"pairs"):  # ShapeError or DTypeError
            ctx.backend.copy_blocks(caches, torch.tensor([[0.0, 1.0]], device=ctx.device))
        for c, e in zip(caches, before):
            assert_cache_bits_equal(c, e, what="cache after a rejected copy_blocks")

    prop()
