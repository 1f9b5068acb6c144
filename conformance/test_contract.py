"""The protocol's non-numeric contract: shapes, errors without side effects, copy_blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpage.attention.metadata import AttentionMetadata
from kvpage.attention.protocol import AttentionBackend, BackendCapabilities
from kvpage.errors import KVPageError
from kvpage.specs import make_cache_spec
from kvpage.testing import (
    AttentionCase,
    assert_cache_bits_equal,
    attention_cases,
    clone_cache,
    materialize,
)

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
    assert isinstance(ctx.backend.capabilities, BackendCapabilities)
    assert isinstance(ctx.backend.name, str) and ctx.backend.name
    why = ctx.backend.unsupported_reasons(_spec(), torch.device("meta"))
    assert isinstance(why, list) and why, "a meta device must be refused with a reason"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_allocate_matches_kv_cache_shape(ctx, kv_dtype) -> None:  # type: ignore[no-untyped-def]
    spec = _spec(kv_dtype)
    ctx.supports(ctx.backend.unsupported_reasons(spec, ctx.device))
    cache = ctx.backend.allocate_kv_cache(spec, 0, ctx.device)
    assert tuple(cache.kv.shape) == tuple(ctx.backend.kv_cache_shape(spec, 0))
    assert cache.kv_dtype == kv_dtype
    if kv_dtype == "int8":
        assert cache.token_scales is not None
        assert tuple(cache.token_scales.shape) == tuple(cache.kv.shape[:4])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_rejects_bad_input_and_changes_nothing(ctx, kv_dtype) -> None:  # type: ignore[no-untyped-def]
    spec = _spec(kv_dtype)
    ctx.supports(ctx.backend.unsupported_reasons(spec, ctx.device))
    cache = ctx.backend.allocate_kv_cache(spec, 0, ctx.device)
    before = clone_cache(cache)
    dev = ctx.device
    k = torch.randn(3, 2, 8, device=dev)
    bad = [
        (torch.randn(3, 2, 7, device=dev), k, torch.tensor([1, 2, 3], device=dev)),  # head_dim
        (k, k, torch.tensor([1, 2], device=dev)),  # slot count
        (k, k[:2], torch.tensor([1, 2, 3], device=dev)),  # value count
        (k.to(torch.int32), k, torch.tensor([1, 2, 3], device=dev)),  # dtype
    ]
    if torch.device(dev).type == "cpu":  # slot ranges: checked on the host only (no sync)
        bad += [
            (k, k, torch.tensor([1, 2, 6 * 4], device=dev)),  # slot out of range
            (k, k, torch.tensor([1, -2, 3], device=dev)),  # negative other than -1
        ]
    for key, value, slots in bad:
        with pytest.raises(KVPageError):
            ctx.backend.write_kv(key, value, cache, slots)
        assert_cache_bits_equal(cache, before, what="cache after a rejected write_kv")


def test_attention_rejects_bad_shapes(ctx) -> None:  # type: ignore[no-untyped-def]
    spec = _spec()
    ctx.supports(ctx.backend.unsupported_reasons(spec, ctx.device))
    cache = ctx.backend.allocate_kv_cache(spec, 0, ctx.device)
    meta = ctx.backend.plan(
        AttentionMetadata.build([1, 1], [3, 5], [[1], [2, 3]], 4, device=ctx.device)
    )
    a = spec.layers[0]
    with pytest.raises(KVPageError):
        ctx.backend.decode(torch.randn(2, 4, 7, device=ctx.device), cache, meta, a)
    with pytest.raises(KVPageError):
        ctx.backend.decode(torch.randn(3, 4, 8, device=ctx.device), cache, meta, a)
    with pytest.raises(KVPageError):
        out = torch.empty(2, 4, 8, dtype=torch.float16, device=ctx.device)
        ctx.backend.decode(torch.randn(2, 4, 8, device=ctx.device), cache, meta, a, out=out)
    pre = ctx.backend.plan(
        AttentionMetadata.build([2, 1], [3, 5], [[1], [2, 3]], 4, device=ctx.device)
    )
    with pytest.raises(KVPageError):  # decode needs one token per sequence
        ctx.backend.decode(torch.randn(3, 4, 8, device=ctx.device), cache, pre, a)


def test_copy_blocks_bit_exact(ctx) -> None:  # type: ignore[no-untyped-def]
    """copy_blocks copies whole blocks (scales too) bit-exactly in every layer and
    leaves other blocks bit-identical; a bad pair raises and copies nothing."""

    @ctx.settings()
    @given(
        case=attention_cases(ctx.budget, ctx.backend.capabilities),
        data=st.data(),
    )
    def prop(case: AttentionCase, data: st.DataObject) -> None:
        ctx.supports(ctx.backend.unsupported_reasons(case.cache_spec(), ctx.device))
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
        with pytest.raises(KVPageError):
            ctx.backend.copy_blocks(caches, torch.tensor([[0, nb]], device=ctx.device))
        for c, e in zip(caches, before):
            assert_cache_bits_equal(c, e, what="cache after a rejected copy_blocks")

    prop()
