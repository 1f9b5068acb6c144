"""The torch backend's two code paths (streamed single sequences and padded batches)
each pass the reference checks; the default thresholds mix them depending on size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from kvpage.backends.torch_backend import TorchBackend, compute
from kvpage.testing import (
    AttentionCase,
    TestBudget,
    attention_cases,
    check_attention_case,
    check_chunking_invariance,
)

PATHS = {"streamed": 0, "streamed-1-block-chunks": 0, "padded": 2**62}
BUDGET = TestBudget(max_seq_len=48, max_seqs=3)


@pytest.mark.parametrize("path", list(PATHS))
def test_torch_path_matches_reference(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = TorchBackend(stream_min_bytes=PATHS[path])
    if path.endswith("chunks"):  # streamed decode: one block per gathered chunk
        monkeypatch.setattr(compute, "DECODE_CHUNK_BYTES", 1)

    @settings(max_examples=max(1, settings().max_examples // 2))
    @given(case=attention_cases(BUDGET, backend.capabilities))
    def prop(case: AttentionCase) -> None:
        check_attention_case(backend, case)

    prop()


@pytest.mark.parametrize("path", list(PATHS))
def test_torch_path_chunking(path: str) -> None:
    backend = TorchBackend(stream_min_bytes=PATHS[path])

    @settings(max_examples=max(1, settings().max_examples // 3))
    @given(case=attention_cases(TestBudget(max_seq_len=16, max_seqs=2), mode="prefill"))
    def prop(case: AttentionCase) -> None:
        check_chunking_invariance(backend, case, [[q] for q in case.query_lens])

    prop()
