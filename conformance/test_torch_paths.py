"""The torch backend's two code paths (streamed single sequences and padded batches)
each pass the reference checks; the default thresholds mix them depending on size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from kvpage.backends.torch_backend import TorchBackend, compute, plan
from kvpage.specs import make_attention_spec
from kvpage.testing import (
    AttentionCase,
    TestBudget,
    attention_cases,
    check_attention_case,
    check_chunking_invariance,
)

PATHS = {
    "streamed": 0,
    "streamed-1-block-chunks": 0,
    "padded": 2**62,
    "padded-1-seq-buckets": 2**62,
}


def _configure(path: str, monkeypatch: pytest.MonkeyPatch) -> TorchBackend:
    """The backend for ``path``; small chunk/bucket limits force the multi-chunk and
    multi-bucket code (one sequence per padded bucket) on the suite's small shapes."""
    if path.endswith("chunks"):  # streamed decode: one block per gathered chunk
        monkeypatch.setattr(compute, "DECODE_CHUNK_BYTES", 1)
    if path.endswith("buckets"):  # padded batches split into one-sequence buckets
        monkeypatch.setattr(plan, "BUCKET_BYTES", 1)
    return TorchBackend(stream_min_bytes=PATHS[path])


BUDGET = TestBudget(max_seq_len=48, max_seqs=3)


@pytest.mark.parametrize("path", list(PATHS))
def test_torch_path_matches_reference(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _configure(path, monkeypatch)

    @settings(max_examples=max(1, settings().max_examples // 2))
    @given(case=attention_cases(BUDGET, backend.capabilities))
    def prop(case: AttentionCase) -> None:
        check_attention_case(backend, case)

    prop()


@pytest.mark.parametrize("path", list(PATHS))
def test_torch_path_chunking(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _configure(path, monkeypatch)

    @settings(max_examples=max(1, settings().max_examples // 3))
    @given(case=attention_cases(TestBudget(max_seq_len=16, max_seqs=2), mode="prefill"))
    def prop(case: AttentionCase) -> None:
        check_chunking_invariance(backend, case, [[q] for q in case.query_lens])

    prop()


@pytest.mark.parametrize("path", ["streamed", "padded"])
def test_torch_accepts_non_contiguous_inputs(path: str) -> None:
    """query/key/value may be strided views (e.g. slices of a fused QKV projection):
    the same result as with contiguous copies (writes: the same bits)."""
    import torch

    from kvpage.testing import materialize, poisoned_cache

    backend = TorchBackend(stream_min_bytes=PATHS[path])
    case = AttentionCase(
        spec=make_attention_spec(num_q_heads=4, num_kv_heads=2, head_dim=16, sliding_window=5),
        dtype="float32",
        kv_dtype="auto",
        block_size=4,
        num_blocks=12,
        seq_lens=(9, 13),
        query_lens=(3, 1),
        block_tables=((3, 7, 1), (2, 9, 11, 5)),
    )
    m = materialize(case)
    wide_q = torch.randn(m.query.shape[0], 4, 40)
    wide_q[..., 3:19] = m.query
    q = wide_q[..., 3:19]
    assert not q.is_contiguous()
    a = backend.forward(q, m.cache, backend.plan(m.meta), case.spec)
    b = backend.forward(m.query.contiguous(), m.cache, backend.plan(m.meta), case.spec)
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    fused = torch.cat([m.new_keys, m.new_values], dim=-1)  # [tokens, Hkv, 2 * D]
    k, v = fused[..., :16], fused[..., 16:]
    assert not k.is_contiguous()
    c1, c2 = poisoned_cache(case, "cpu"), poisoned_cache(case, "cpu")
    backend.write_kv(k, v, c1, m.slot_mapping)
    backend.write_kv(k.contiguous(), v.contiguous(), c2, m.slot_mapping)
    assert torch.equal(c1.kv.nan_to_num(7.0), c2.kv.nan_to_num(7.0))


@pytest.mark.parametrize("path", ["streamed", "padded"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_one_plan_serves_every_layer(path: str, kv_dtype: str) -> None:
    """The plan's per-layer-shape memo (groups, compute path, the padded decode's
    block-diagonal query buffer) is built by the first layer and reused by the others:
    layers with different caches and queries, run in any order on one plan, give what
    each gives on a fresh plan, and the memo holds one entry per layer shape."""
    import torch

    from kvpage.testing import materialize

    backend = TorchBackend(stream_min_bytes=PATHS[path])
    shapes = [(4, 2, 16), (4, 2, 16), (6, 3, 8)]  # (Hq, Hkv, D): layers 0 and 1 share one
    layers = []
    for i, (hq, hkv, d) in enumerate(shapes):
        case = AttentionCase(
            spec=make_attention_spec(num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
            dtype="float32",
            kv_dtype=kv_dtype,
            block_size=4,
            num_blocks=12,
            seq_lens=(9, 13, 2),
            query_lens=(1, 1, 1),
            block_tables=((3, 7, 1), (2, 9, 11, 5), (4,)),
            seed=i,
        )
        layers.append((case, materialize(case)))
    shared = backend.plan(layers[0][1].meta)
    for i in [0, 1, 2, 1, 0]:
        case, m = layers[i]
        got = backend.forward(m.query, m.cache, shared, case.spec)
        want = backend.forward(m.query, m.cache, backend.plan(m.meta), case.spec)
        assert torch.equal(got, want), f"layer {i}"
    assert len(shared.runs) == 2
    runs_0 = shared.runs[next(iter(shared.runs))]
    assert all(g.streamed == (path == "streamed") for _, g in runs_0)
