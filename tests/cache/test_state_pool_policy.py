"""The snapshot policy (kvpage.cache.snapshot_policy): prompt, predicted and decode
boundaries, pass counts and their bound, chunk ends, the predicted share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpage.cache.hashing import hash_request_blocks
from kvpage.cache.snapshot_policy import SnapshotPoint, SnapshotPolicy
from kvpage.errors import SpecError

BS = 16


def _hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return hash_request_blocks(tokens, BS, cache_salt=salt)


def test_prompt_boundary_is_last_full_block() -> None:
    pol = SnapshotPolicy(BS)
    prompt = list(range(110))
    hs = _hashes(prompt)
    pol.observe(hs)
    pts = pol.prompt_points(hs, 110, 0)
    assert pts == [SnapshotPoint(96, "prompt", hs[5])]
    # an aligned prompt: its end is the boundary
    hs2 = _hashes(list(range(96)))
    assert pol.prompt_points(hs2, 96, 0) == [SnapshotPoint(96, "prompt", hs2[5])]
    # a hit at or past it: nothing to take
    assert pol.prompt_points(hs, 110, 96) == []
    # shorter than a block: no boundary
    assert pol.prompt_points([], 15, 0) == []


def test_predicted_boundary_after_threshold_requests() -> None:
    pol = SnapshotPolicy(BS, share_threshold=3)
    system = list(range(100))
    reqs = [system + [1000 + 10 * r + i for i in range(30)] for r in range(4)]
    got = []
    for r in reqs:
        hs = _hashes(r)
        pol.observe(hs)
        got.append(pol.prompt_points(hs, len(r), 0))
    # 130 tokens: prompt boundary 128; the system prompt's blocks 0..5 (boundary 96)
    # are shared; block 6 holds tokens 96..111, different per request
    assert [p.position for p in got[0]] == [128]
    assert [p.position for p in got[1]] == [128]  # 2 passes < 3
    assert [(p.position, p.kind) for p in got[2]] == [(96, "predicted"), (128, "prompt")]
    assert pol.pass_count(_hashes(reqs[3])[5]) == 4
    assert pol.pass_count(_hashes(reqs[3])[6]) == 1
    # past the hit only
    hs = _hashes(reqs[3])
    assert [p.position for p in pol.prompt_points(hs, 130, 96)] == [128]
    assert [p.position for p in pol.prompt_points(hs, 130, 80)] == [96, 128]


def test_salts_count_separately_and_share_zero_predicts_nothing() -> None:
    pol = SnapshotPolicy(BS, share_threshold=2)
    toks = list(range(70))
    pol.observe(_hashes(toks, "a"))
    hb = _hashes(toks, "b")
    pol.observe(hb)
    assert [p.kind for p in pol.prompt_points(hb, 70, 0)] == ["prompt"]
    off = SnapshotPolicy(BS, share_threshold=2, predicted_share=0.0)
    ha = _hashes(toks, "a")
    off.observe(ha)
    off.observe(ha)
    assert [p.kind for p in off.prompt_points(ha, 70, 0)] == ["prompt"]
    assert off.predicted_cap(100) == 0


def test_one_request_counts_each_hash_once_and_memory_is_bounded() -> None:
    pol = SnapshotPolicy(BS, max_tracked=3)
    h = _hashes(list(range(80)))  # 5 blocks
    pol.observe([h[0], h[0], h[1]])
    assert pol.pass_count(h[0]) == 1
    pol.observe(h[2:5])
    assert pol.num_tracked == 3
    assert pol.pass_count(h[0]) == 0 and pol.pass_count(h[4]) == 1
    pol.observe([h[2]])  # refreshed: h[3] is now the oldest
    pol.observe([h[0]])
    assert pol.pass_count(h[3]) == 0 and pol.pass_count(h[2]) == 2


def test_chunk_end_cuts_at_first_inner_point() -> None:
    pol = SnapshotPolicy(BS)
    pts = [SnapshotPoint(96, "predicted", b"x"), SnapshotPoint(128, "prompt", b"y")]
    assert pol.chunk_end(0, 64, pts) == 64
    assert pol.chunk_end(0, 130, pts) == 96
    assert pol.chunk_end(96, 130, pts) == 128
    assert pol.chunk_end(96, 128, pts) == 128
    assert pol.chunk_end(128, 130, pts) == 130


@given(st.integers(0, 200), st.integers(0, 4))
def test_decode_point_only_on_exact_boundaries(before: int, n: int) -> None:
    pol = SnapshotPolicy(BS)
    after = before + n
    got = pol.decode_point(before, after)
    if n and after % BS == 0:
        assert got == after
    else:
        assert got is None


@given(st.integers(1, 300), st.integers(0, 300), st.integers(2, 4))
def test_prompt_points_oracle(prompt_len: int, hit: int, threshold: int) -> None:
    """Against a direct reading of the policy: sorted, inside (hit, P], at most one
    predicted (the deepest with enough passes, below the prompt boundary)."""
    pol = SnapshotPolicy(BS, share_threshold=threshold)
    toks = list(range(prompt_len))
    hs = _hashes(toks)
    for _ in range(threshold - 1):
        pol.observe(hs[: len(hs) // 2])
    pol.observe(hs)
    hit = min(hit, prompt_len) // BS * BS
    pts = pol.prompt_points(hs, prompt_len, hit)
    last = prompt_len // BS * BS
    want = []
    shared = [(i + 1) * BS for i in range(len(hs) // 2)]
    pred = [b for b in shared if hit < b < last]
    if pred:
        want.append((max(pred), "predicted"))
    if last > hit:
        want.append((last, "prompt"))
    assert [(p.position, p.kind) for p in pts] == want
    for p in pts:
        assert p.block_hash == hs[p.position // BS - 1]


def test_predicted_cap_and_bad_parameters() -> None:
    assert SnapshotPolicy(BS, predicted_share=0.25).predicted_cap(10) == 2
    assert SnapshotPolicy(BS, predicted_share=1.0).predicted_cap(10) == 10
    for kw in (
        {"share_threshold": 1},
        {"share_threshold": True},
        {"predicted_share": 1.5},
        {"predicted_share": -0.1},
        {"max_tracked": 0},
        {"decode_snapshots": 1},
    ):
        with pytest.raises(SpecError):
            SnapshotPolicy(BS, **kw)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="block_size"):
        SnapshotPolicy(0)
    with pytest.raises(SpecError, match="hashes"):
        SnapshotPolicy(BS).prompt_points([], 40, 0)
