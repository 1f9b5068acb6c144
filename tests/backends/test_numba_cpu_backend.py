"""The numba-cpu backend beyond the conformance suite (which proves its attention
against the float64 reference: ``pytest conformance --backend numba-cpu``): selection,
thread handling, the work split, and results that do not depend on the batch or the
thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from paged_steps import paged_step

from kvpage.attention.metadata import AttentionMetadata
from kvpage.backends import select_backend
from kvpage.specs import make_attention_spec, make_cache_spec

numba = pytest.importorskip("numba")
from kvpage_numba_cpu import NumbaCpuBackend, kernels  # noqa: E402

from kvpage.attention.cpu_plan import ROWS_PER_UNIT, _split  # noqa: E402


def _spec(dtype: str = "float32"):  # type: ignore[no-untyped-def]
    return make_cache_spec(
        num_layers=1,
        block_size=16,
        num_blocks=32,
        dtype=dtype,
        kv_dtype="auto",
        layers=[dict(num_q_heads=8, num_kv_heads=4, head_dim=32)],
    )


def test_chosen_by_name_after_torch_in_auto_and_refuses_float16_by_name() -> None:
    assert select_backend(_spec(), "cpu").name != "numba-cpu"  # ranked after torch
    assert select_backend(_spec(), "cpu", prefer="numba-cpu").name == "numba-cpu"
    assert select_backend(_spec("bfloat16"), "cpu", prefer="numba-cpu").name == "numba-cpu"
    b = NumbaCpuBackend()
    assert b.unsupported_reasons(_spec("float16"), torch.device("cpu")) == [
        "dtype: expected float32|bfloat16, got float16"
    ]
    assert select_backend(_spec("float16"), "cpu").name == "torch"
    assert b.unsupported_reasons(_spec(), torch.device("cuda")) == [
        "device: expected cpu, got cuda"
    ]


def test_kernel_is_a_cpu_njit_even_under_the_cuda_simulator() -> None:
    """NUMBA_ENABLE_CUDASIM (set by the test runner) changes numba.cuda only: the
    kernel is an ordinary CPU dispatcher compiled for this machine."""
    from numba.core.registry import CPUDispatcher

    assert isinstance(kernels.paged_attention, CPUDispatcher)
    assert kernels.paged_attention.targetoptions.get("parallel")


def test_thread_count_follows_torch_and_results_are_bit_identical() -> None:
    b = NumbaCpuBackend()
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=4, head_dim=32)
    cache, meta, q, _ = paged_step([70, 5, 130, 33], [70, 1, 20, 1])
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            plan = b.plan(meta)
            assert plan.threads == n
            if n > 1:
                assert numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
            outs.append(b.forward(q, cache, plan, spec))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch() -> None:
    b = NumbaCpuBackend()
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=4, head_dim=32, sliding_window=40)
    cache, meta, q, tables = paged_step([90, 17, 200], [90, 1, 3])
    full = b.forward(q, cache, b.plan(meta), spec)
    alone_meta = AttentionMetadata.build(
        query_lens=[3], seq_lens=[200], block_tables=[tables[2]], block_size=16
    )
    alone = b.forward(q[91:94].clone(), cache, b.plan(alone_meta), spec)
    assert torch.equal(full[91:94], alone)


@given(
    qlens=st.lists(st.integers(0, 3 * ROWS_PER_UNIT), min_size=1, max_size=12),
    ctx=st.integers(0, 50),
    heads=st.sampled_from([1, 2, 4, 8]),
    threads=st.integers(1, 4),
)
def test_units_cover_every_row_and_head_once(
    qlens: list[int], ctx: int, heads: int, threads: int
) -> None:
    qs = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=qs[1:])
    seq_lens = np.asarray(qlens, dtype=np.int64) + ctx
    units, bounds = _split(qs, seq_lens, heads, 2, threads)
    seen = np.zeros((int(qs[-1]), heads), dtype=np.int64)
    for seq, r0, r1, h0, h1 in units.tolist():
        assert 0 <= r0 < r1 <= qlens[seq] and r1 - r0 <= ROWS_PER_UNIT and 0 <= h0 < h1 <= heads
        seen[qs[seq] + r0 : qs[seq] + r1, h0:h1] += 1
    assert (seen == 1).all()
    assert bounds.shape == (threads + 1,) and bounds[0] == 0 and bounds[-1] == len(units)
    assert (np.diff(bounds) >= 0).all()
