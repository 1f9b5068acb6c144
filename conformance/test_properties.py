"""Hypothesis properties every backend must satisfy against the float64 reference."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import assume, given
from hypothesis import strategies as st

from kvpage.testing import (
    AttentionCase,
    attention_cases,
    check_attention_case,
    check_chunking_invariance,
    check_layout_invariance,
    check_write_kv_case,
    chunkings,
    layouts,
)


def _runs(c, case: AttentionCase) -> None:  # type: ignore[no-untyped-def]
    assume(not c.backend.unsupported_reasons(case.cache_spec(), c.device))


def test_write_kv_bit_exact(ctx) -> None:  # type: ignore[no-untyped-def]
    """Mapped slots equal the reference writer's bits; every other slot (NaN poison)
    keeps its bits; -1 slots are skipped. All kv dtypes, any layout."""

    @ctx.settings()
    @given(
        case=attention_cases(ctx.budget, ctx.backend.capabilities),
        skip_every=st.sampled_from((0, 0, 2, 3)),
    )
    def prop(case: AttentionCase, skip_every: int) -> None:
        _runs(ctx, case)
        check_write_kv_case(ctx.backend, case, ctx.device, skip_every=skip_every)

    prop()


def test_decode_matches_reference(ctx) -> None:  # type: ignore[no-untyped-def]
    """Decode (and prefill of the same one-token step) within the dtype's tolerance of
    the reference on the (dequantized) cache; quantization error bounded separately."""

    @ctx.settings()
    @given(case=attention_cases(ctx.budget, ctx.backend.capabilities, mode="decode"))
    def prop(case: AttentionCase) -> None:
        _runs(ctx, case)
        check_attention_case(ctx.backend, case, ctx.device)

    prop()


def test_prefill_matches_reference(ctx) -> None:  # type: ignore[no-untyped-def]
    """Varlen prefill with cached context (prefix hits, chunked prefill) vs reference."""

    @ctx.settings()
    @given(case=attention_cases(ctx.budget, ctx.backend.capabilities, mode="prefill"))
    def prop(case: AttentionCase) -> None:
        _runs(ctx, case)
        check_attention_case(ctx.backend, case, ctx.device)

    prop()


def test_quantized_kv_matches_reference(ctx) -> None:  # type: ignore[no-untyped-def]
    """int8 / fp8 caches only: vs the reference on the dequantized cache, plus the
    separate bound on what quantization costs against the exact K/V."""
    quant = tuple(k for k in ctx.budget.kv_dtypes if k != "auto")
    quant = tuple(k for k in quant if k in ctx.backend.capabilities.kv_dtypes)
    if not quant:
        import pytest

        pytest.skip(f"{ctx.name} declares no quantized kv dtype")

    @ctx.settings()
    @given(case=attention_cases(ctx.budget, ctx.backend.capabilities, kv_dtypes=quant))
    def prop(case: AttentionCase) -> None:
        _runs(ctx, case)
        check_attention_case(ctx.backend, case, ctx.device)

    prop()


def test_chunked_prefill_equals_one_shot_and_decode(ctx) -> None:  # type: ignore[no-untyped-def]
    """Any chunking of the new tokens == one-shot prefill == token-by-token decode."""
    b = ctx.budget  # token-by-token decode runs one step per token: keep it short
    small = replace(b, max_seq_len=min(b.max_seq_len, 32), max_seqs=min(b.max_seqs, 3))

    @ctx.settings()
    @given(data=st.data(), case=attention_cases(small, ctx.backend.capabilities, mode="prefill"))
    def prop(data: st.DataObject, case: AttentionCase) -> None:
        _runs(ctx, case)
        chunks = [
            data.draw(chunkings(q), label=f"chunks[{i}]") for i, q in enumerate(case.query_lens)
        ]
        check_chunking_invariance(ctx.backend, case, chunks, ctx.device)

    prop()


def test_block_size_and_permutation_invariance(ctx) -> None:  # type: ignore[no-untyped-def]
    """The same logical K/V under another block size and physical permutation."""

    @ctx.settings()
    @given(data=st.data(), case=attention_cases(ctx.budget, ctx.backend.capabilities))
    def prop(data: st.DataObject, case: AttentionCase) -> None:
        _runs(ctx, case)
        bs, tables, nb = data.draw(layouts(case.seq_lens, ctx.budget), label="layout")
        other = case.with_layout(bs, tables, nb)
        assume(not ctx.backend.unsupported_reasons(other.cache_spec(), ctx.device))
        check_layout_invariance(ctx.backend, case, bs, tables, nb, ctx.device)

    prop()


def test_block_ids_above_16_bits(ctx) -> None:  # type: ignore[no-untyped-def]
    """Pinned: a pool of 70,000 blocks with block ids around 2**16 and at the very top
    (a kernel storing ids or slots in 16 bits reads the wrong block)."""
    from kvpage.specs import make_attention_spec

    if not ctx.budget.huge_pools:
        import pytest

        pytest.skip(f"{ctx.name}: huge pools outside the backend's test budget")
    tables = ((65_535, 69_999, 65_536), (65_537, 1, 69_998, 40_000, 69_997))
    for dtype, kv in (("float32", "auto"), ("float16", "int8"), ("bfloat16", "fp8_e4m3")):
        case = AttentionCase(
            spec=make_attention_spec(num_q_heads=4, num_kv_heads=1, head_dim=8),
            dtype=dtype,
            kv_dtype=kv,
            block_size=2,
            num_blocks=70_000,
            seq_lens=(6, 9),
            query_lens=(6, 1),
            block_tables=tables,
        )
        if ctx.backend.unsupported_reasons(case.cache_spec(), ctx.device):
            continue
        check_write_kv_case(ctx.backend, case, ctx.device)
        check_attention_case(ctx.backend, case, ctx.device)


def test_attention_sinks_match_reference(ctx) -> None:  # type: ignore[no-untyped-def]
    """Attention sinks (gpt-oss: one logit per query head in the softmax denominator)
    in decode, prefill with cached context and chunked prefill, with windows, soft caps
    and every kv dtype, for backends that declare ``capabilities.sinks``; the others
    must refuse a sink layer by name (``unsupported_reasons`` and ``backend_reasons``)."""
    import pytest

    from kvpage.backends import backend_reasons
    from kvpage.testing import make_case

    probe = make_case((5,), sinks=(0.5, -1.0, 2.0, 30.0)).cache_spec()
    if not ctx.backend.capabilities.sinks:
        why = ctx.backend.unsupported_reasons(probe, ctx.device)
        if ctx.name in ("triton", "cupy", "numba"):  # the shipped plugins refuse by name
            assert any("sinks" in w for w in why), why
        pytest.skip(f"{ctx.name} does not declare attention sinks")
    assert not any("sinks" in w for w in ctx.backend.unsupported_reasons(probe, ctx.device))
    if not ctx.name.startswith("example-"):
        assert not any("sinks" in w for w in backend_reasons(ctx.name, probe, ctx.device))
    small = replace(ctx.budget, max_seq_len=min(ctx.budget.max_seq_len, 32))

    @ctx.settings()
    @given(data=st.data(), case=attention_cases(small, ctx.backend.capabilities, sinks=True))
    def prop(data: st.DataObject, case: AttentionCase) -> None:
        _runs(ctx, case)
        check_attention_case(ctx.backend, case, ctx.device)
        if not case.is_decode:
            chunks = [
                data.draw(chunkings(q), label=f"chunks[{i}]") for i, q in enumerate(case.query_lens)
            ]
            check_chunking_invariance(ctx.backend, case, chunks, ctx.device)

    prop()
