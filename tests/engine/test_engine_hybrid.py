"""A hybrid model (qwen3_next: Gated DeltaNet + gated attention, tiny random weights
built offline) through the whole engine: greedy output equal to transformers with
chunked prefill, with prefix hits at recurrent-state snapshots and after preemption;
the 100-token system prompt hitting at its 96-token boundary; a conversation's second
turn starting from the first turn's end state; the metrics and ``cached_tokens`` that
report it; every block and state slot free at the end; what is refused by name."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpage.cache import hash_request_blocks
from kvpage.engine import LLM
from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.errors import SpecError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from hybrid_harness import hf_generate  # noqa: E402
from test_models_hybrid import make_hf  # noqa: E402

transformers = pytest.importorskip("transformers")

BS = 16
#: prompts avoid token 0: it is the pad token, which transformers' generate masks out
SYSTEM = [(7 * i + 3) % 250 + 3 for i in range(100)]  # a 100-token system prompt


@pytest.fixture(scope="module")
def q3n(tmp_path_factory: Any) -> tuple[Any, str]:
    hf = make_hf("qwen3_next", max_position_embeddings=512)
    folder = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(folder)
    return hf, str(folder)


def _llm(folder: str, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(model=folder, block_size=BS, max_model_len=512, seed=0)
    args.update(kw)
    return LLM(**args)


def _gen(llm: LLM, prompts: list[list[int]], n: int) -> list[RequestOutput]:
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _all_free(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_requests == 0 and kv.num_used_blocks == 0
    assert kv.state is not None and kv.state.num_live_used == 0
    assert not llm.llm_engine.scheduler.has_unfinished()


def test_system_prompt_hits_at_96_with_another_question(q3n: tuple[Any, str]) -> None:
    hf, folder = q3n
    llm = _llm(folder, max_num_batched_tokens=2048)
    a = SYSTEM + [11, 12, 13, 14, 15]  # 105 tokens: prompt boundary 96
    b = SYSTEM + [21, 22, 23, 24, 25, 26, 27]  # the same system prompt, another question
    (oa,) = _gen(llm, [a], 8)
    (ob,) = _gen(llm, [b], 8)
    assert oa.num_cached_tokens == 0 and ob.num_cached_tokens == 96  # block 6's boundary
    assert list(oa.outputs[0].token_ids) == hf_generate(hf, a, 8)
    assert list(ob.outputs[0].token_ids) == hf_generate(hf, b, 8)
    m = llm.llm_engine.get_metrics()
    assert m["kvpage:prefix_cache_hits_total"] == 96.0
    assert m["kvpage:state_snapshot_hits_total"] == 1.0
    assert m["kvpage:state_snapshots_taken_total"] >= 1.0
    assert m["kvpage:state_slots_total"] == llm.llm_engine.kv_cache_manager.state.num_slots  # type: ignore[union-attr]
    _all_free(llm)


def test_second_turn_reuses_first_turns_end_state(q3n: tuple[Any, str]) -> None:
    hf, folder = q3n
    llm = _llm(folder, max_num_batched_tokens=2048)
    turn1 = [1, *range(40, 80)]  # 41 tokens
    (o1,) = _gen(llm, [turn1], 30)  # computed 41 + 30 - 1 = 70: last boundary 64
    out1 = list(o1.outputs[0].token_ids)
    assert out1 == hf_generate(hf, turn1, 30)
    turn2 = turn1 + out1 + [5, 6, 7, 8, 9]
    (o2,) = _gen(llm, [turn2], 8)
    assert o2.num_cached_tokens == 64  # the first turn's rolling end-state snapshot
    assert list(o2.outputs[0].token_ids) == hf_generate(hf, turn2, 8)
    kinds = llm.llm_engine.kv_cache_manager.state.stats.snapshots_taken_by_kind  # type: ignore[union-attr]
    assert kinds.get("decode", 0) >= 2  # 48 and 64 during turn 1 (48 dropped)
    _all_free(llm)


def test_without_decode_snapshots_the_second_turn_hits_at_the_prompt(
    q3n: tuple[Any, str],
) -> None:
    """``state_decode_snapshots=False``: no rolling snapshots, so the second turn hits
    only at the first turn's prompt boundary (32, not 64), still greedy-equal."""
    hf, folder = q3n
    llm = _llm(folder, max_num_batched_tokens=2048, state_decode_snapshots=False)
    turn1 = [1, *range(40, 80)]
    (o1,) = _gen(llm, [turn1], 30)
    turn2 = turn1 + list(o1.outputs[0].token_ids) + [5, 6, 7, 8, 9]
    (o2,) = _gen(llm, [turn2], 8)
    assert o2.num_cached_tokens == 32
    assert list(o2.outputs[0].token_ids) == hf_generate(hf, turn2, 8)
    kinds = llm.llm_engine.kv_cache_manager.state.stats.snapshots_taken_by_kind  # type: ignore[union-attr]
    assert kinds.get("decode", 0) == 0 and kinds.get("prompt", 0) == 2
    _all_free(llm)


def test_chunked_prefill_and_predicted_boundary(q3n: tuple[Any, str]) -> None:
    """Budget 24 tokens per step: chunks also end at each snapshot boundary; the third
    request hits at the system prompt's boundary the second one predicted shared."""
    hf, folder = q3n
    llm = _llm(folder, max_num_batched_tokens=24, state_share_threshold=2)
    qs = [[30 + i, 31 + i] + [60 + i] * 20 for i in range(3)]  # 122 tokens: boundary 112
    outs = [_gen(llm, [SYSTEM + q], 6)[0] for q in qs]
    for q, o in zip(qs, outs):
        assert list(o.outputs[0].token_ids) == hf_generate(hf, SYSTEM + q, 6)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 96]
    kinds = llm.llm_engine.kv_cache_manager.state.stats.snapshots_taken_by_kind  # type: ignore[union-attr]
    assert kinds["predicted"] == 1 and kinds["prompt"] == 3
    _all_free(llm)


def test_batch_with_preemption_equal_to_transformers(q3n: tuple[Any, str]) -> None:
    hf, folder = q3n
    llm = _llm(folder, num_blocks=14, max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [SYSTEM[:50] + [i + 3] * 10 for i in range(3)] + [list(range(100, 140))]
    outs = _gen(llm, prompts, 40)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # readmissions after preemption restart from their own snapshots
    assert llm.llm_engine.kv_cache_manager.state.stats.snapshot_hits >= 2  # type: ignore[union-attr]
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_generate(hf, p, 40)
    _all_free(llm)


def test_n2_forks_the_state(q3n: tuple[Any, str]) -> None:
    hf, folder = q3n
    llm = _llm(folder)
    p = list(range(10, 45))
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    (o,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
    want = hf_generate(hf, p, 6)
    assert [list(c.token_ids) for c in o.outputs] == [want, want]
    _all_free(llm)


def test_no_state_snapshot_is_explained(q3n: tuple[Any, str]) -> None:
    _, folder = q3n
    llm = _llm(folder, state_share_threshold=9, state_predicted_share=0.0)
    a = list(range(3, 75))  # 72 tokens: prompt snapshot at 64 only
    _gen(llm, [a], 1)
    b = a[:40] + [200] * 30  # KV shares blocks 0, 1 (32 tokens): no snapshot at 32
    (ob,) = _gen(llm, [b], 1)
    why = ob.cache_miss
    assert ob.num_cached_tokens == 0 and why is not None
    assert why.reason == "no_state_snapshot"
    assert why.message == "no state snapshot at position 32 (nearest none)"
    _gen(llm, [a[:20]], 1)  # a snapshot at 16 (its prompt boundary)
    c = a[:40] + [201] * 30
    (oc,) = _gen(llm, [c], 1)
    assert oc.num_cached_tokens == 16 and oc.cache_miss is not None
    assert oc.cache_miss.message == "no state snapshot at position 32 (nearest 16)"
    m = llm.llm_engine.get_metrics()
    assert (
        m['kvpage:cache_miss_reasons_total{reason="no_state_snapshot"}'] == 3.0
    )  # a[:20] too (KV at 16)
    _all_free(llm)


def test_refused_by_name(q3n: tuple[Any, str]) -> None:
    _, folder = q3n
    with pytest.raises(SpecError, match="speculative_config"):
        _llm(
            folder,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(SpecError, match="kv_cache_memory_bytes"):
        _llm(folder, kv_cache_memory_bytes=1000)


def test_mamba2_recurrent_only_through_the_engine(tmp_path: Any) -> None:
    """No attention layer: no KV blocks; the hit is the deepest snapshot along the prompt,
    and a second turn starts from the first turn's end state."""
    hf = make_hf("mamba2")
    hf.save_pretrained(tmp_path)
    llm = _llm(str(tmp_path), max_num_batched_tokens=24)
    assert llm.llm_engine.cache_spec.layers == () and llm.llm_engine.runner.kv_caches == []
    a = SYSTEM[:40] + [5, 6, 7]  # prompt boundary 32
    b = SYSTEM[:40] + [8, 9, 10, 11]
    oa, ob = (_gen(llm, [p], 20)[0] for p in (a, b))
    turn2 = a + list(oa.outputs[0].token_ids) + [12, 13]  # a computed 43 + 19 = 62: end 48
    (o2,) = _gen(llm, [turn2], 6)
    assert [oa.num_cached_tokens, ob.num_cached_tokens, o2.num_cached_tokens] == [0, 32, 48]
    for p, o, n in ((a, oa, 20), (b, ob, 20), (turn2, o2, 6)):
        assert list(o.outputs[0].token_ids) == hf_generate(hf, p, n)
    m = llm.llm_engine.get_metrics()
    assert m["kvpage:prefix_cache_hits_total"] == 80.0
    assert m["kvpage:kv_cache_usage_perc"] == 0.0
    _all_free(llm)


@pytest.mark.parametrize("model_type", ["nemotron_h", "granitemoehybrid"])
def test_mamba2_hybrids_hit_at_the_prompt_boundary(model_type: str, tmp_path: Any) -> None:
    hf = make_hf(model_type)
    hf.save_pretrained(tmp_path)
    llm = _llm(str(tmp_path), max_num_batched_tokens=24)
    a = SYSTEM[:40] + [5, 6, 7]  # 43 tokens: prompt boundary 32
    b = SYSTEM[:40] + [8, 9, 10, 11]
    outs = [_gen(llm, [p], 6)[0] for p in (a, b)]
    assert [o.num_cached_tokens for o in outs] == [0, 32]
    for p, o in zip((a, b), outs):
        assert list(o.outputs[0].token_ids) == hf_generate(hf, p, 6)
    _all_free(llm)


def test_snapshot_copies_run_on_an_empty_step(q3n: tuple[Any, str]) -> None:
    _, folder = q3n
    llm = _llm(folder)
    _gen(llm, [list(range(3, 40))], 28)  # computed 37 + 27 = 64: the last step's snapshot
    eng = llm.llm_engine
    pool = eng.kv_cache_manager.state
    assert pool is not None and pool.num_pending_copies == 1
    (src, dst) = pool.pending_copies()[0]
    assert eng.runner.state_caches is not None
    live = eng.runner.state_caches[0].ssm[src].clone()
    assert eng.step() == [] and pool.num_pending_copies == 0
    assert eng.runner.state_caches[0].ssm[dst].equal(live)


@pytest.mark.parametrize(
    ("qlen", "share", "cached", "ratio"),
    [(10, 0.25, [0] + [96] * 7, 672 / 880), (30, 0.0, [0] * 8, 0.0), (30, 0.25, [0, 0] + [96] * 6, 576 / 1040)],
)  # fmt: skip
def test_policy_hit_numbers_of_the_docs(
    q3n: tuple[Any, str], qlen: int, share: float, cached: list[int], ratio: float
) -> None:
    """The measurement quoted in docs/architecture.md ('Recurrent state'): 8 requests,
    one 100-token system prompt, each its own question."""
    _, folder = q3n
    llm = _llm(folder, state_predicted_share=share)
    got = []
    for r in range(8):
        p = SYSTEM + [(r * 13 + j) % 200 + 30 for j in range(qlen)]
        got.append(_gen(llm, [p], 4)[0].num_cached_tokens)
    m = llm.llm_engine.get_metrics()
    assert got == cached
    hits, queried = m["kvpage:prefix_cache_hits_total"], m["kvpage:prefix_cache_queries_total"]
    assert hits / queried == pytest.approx(ratio)


@pytest.mark.parametrize("num_blocks", [None, 10])
def test_evicted_snapshot_hits_from_the_host_tier(
    q3n: tuple[Any, str], num_blocks: int | None
) -> None:
    """One snapshot slot and a host KV tier: A's prompt snapshot is evicted by C's (to a
    host row); A again hits its 96-token boundary from the host snapshot (promoted,
    then restored), greedy-equal to transformers; without host snapshots it misses.
    With 10 blocks C also evicts A's KV blocks to the host tier (a tier hit of KV)."""
    hf, folder = q3n
    a = SYSTEM + [11, 12, 13, 14, 15]  # prompt boundary 96
    c = [(5 * i + 1) % 250 + 3 for i in range(100)] + [9, 9, 9]  # another prompt
    hits = {}
    for host in (0, 1 << 24):
        llm = _llm(
            folder,
            max_num_batched_tokens=2048,
            state_snapshot_slots=1,
            kv_host_tier_bytes=host,
            num_blocks=num_blocks,
        )
        pool = llm.llm_engine.kv_cache_manager.state
        assert pool is not None and (pool.num_host_snapshots > 0) == bool(host)
        (oa,) = _gen(llm, [a], 4)
        (oc,) = _gen(llm, [c], 4)
        (oa2,) = _gen(llm, [a], 4)
        assert oc.num_cached_tokens == 0
        want = hf_generate(hf, a, 4)
        assert list(oa.outputs[0].token_ids) == want
        assert list(oa2.outputs[0].token_ids) == want
        assert list(oc.outputs[0].token_ids) == hf_generate(hf, c, 4)
        hits[host] = oa2.num_cached_tokens
        if host and num_blocks:
            assert oa2.num_cached_tokens_by_tier.get("host", 0) > 0
        m = llm.llm_engine.get_metrics()
        assert m["kvpage:state_host_snapshot_hits_total"] == (1.0 if host else 0.0)
        pool.check_integrity()
        _all_free(llm)
    assert hits == {0: 0, 1 << 24: 96}


def test_evicted_snapshot_hits_from_disk_after_a_restart(
    q3n: tuple[Any, str], tmp_path: Path
) -> None:
    """A disk tier on the hybrid: A's prompt snapshot goes slot -> host row (C's
    snapshot takes the slot) -> disk file (D's takes the slot, C's the host row); A's
    KV blocks go to disk too. A new engine on the same directory (a restart) serves A
    at its 96-token boundary from disk, KV and state (cached_tokens 96, by tier "disk"),
    greedy-equal to transformers; a truncated snapshot file is a miss that names the
    refusal; without the disk tier A misses."""
    hf, folder = q3n
    a = SYSTEM + [11, 12, 13, 14, 15]
    c = [(5 * i + 1) % 250 + 3 for i in range(100)] + [9, 9, 9]
    d = [(11 * i + 5) % 250 + 3 for i in range(100)] + [8, 8]
    # share 0.5 of a 3-block host tier (12288 bytes): one host snapshot row
    kw: dict[str, Any] = dict(
        max_num_batched_tokens=2048,
        state_snapshot_slots=1,
        num_blocks=10,
        kv_host_tier_bytes=12288,
        state_snapshot_share=0.5,
        kv_disk_tier_bytes=1 << 22,
        kv_disk_tier_path=str(tmp_path / "disk"),
    )
    llm = _llm(folder, **kw)
    pool = llm.llm_engine.kv_cache_manager.state
    assert pool is not None and pool.num_host_snapshots == 1 and pool.disk is not None
    assert pool.disk.state_capacity_bytes == (1 << 22) // 2
    (oa,) = _gen(llm, [a], 4)
    (oc,) = _gen(llm, [c], 4)
    assert pool.num_host_used == 1 and pool.num_disk_used == 0
    (od,) = _gen(llm, [d], 4)
    assert pool.num_disk_used == 1 and pool.stats.disk_snapshots_stored == 1
    m = llm.llm_engine.get_metrics()
    assert m["kvpage:state_disk_snapshots"] == 1.0
    _all_free(llm)
    want = hf_generate(hf, a, 4)
    assert list(oa.outputs[0].token_ids) == want
    del llm, pool

    llm = _llm(folder, **kw)  # a restart on the same directory
    kvm = llm.llm_engine.kv_cache_manager
    pool = kvm.state
    assert pool is not None and pool.num_disk_used == 1 and pool.num_snapshots == 0
    (oa2,) = _gen(llm, [a], 4)
    assert oa2.num_cached_tokens == 96
    assert oa2.num_cached_tokens_by_tier.get("disk", 0) > 0
    assert list(oa2.outputs[0].token_ids) == want
    m = llm.llm_engine.get_metrics()
    assert m["kvpage:state_disk_snapshot_hits_total"] == 1.0
    assert m["kvpage:state_snapshot_hits_total"] == 1.0
    pool.check_integrity()
    _all_free(llm)

    del llm, pool

    # the same directory with A's snapshot file damaged (one payload bit: refused on
    # read; truncated: removed at start): KV from disk, no state at 96 (the refusal
    # named in the miss), computed again, greedy-equal
    for damage in ("flip", "truncate"):
        bad = tmp_path / damage
        shutil.copytree(tmp_path / "disk", bad)
        (f,) = list(bad.rglob("7374*.kvb"))  # b"st": the state key prefix, in hex
        raw = f.read_bytes()
        f.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]) if damage == "flip" else raw[:-7])
        llm = _llm(folder, **{**kw, "kv_disk_tier_path": str(bad)})
        pool = llm.llm_engine.kv_cache_manager.state
        assert pool is not None and pool.num_disk_used == (1 if damage == "flip" else 0)
        (oa3,) = _gen(llm, [a], 4)
        why = oa3.cache_miss
        assert oa3.num_cached_tokens == 0 and why is not None
        assert why.message == (
            "no state snapshot at position 96 (nearest none; disk snapshot corrupt)"
        )
        assert list(oa3.outputs[0].token_ids) == want
        m = llm.llm_engine.get_metrics()
        assert m["kvpage:state_disk_snapshot_refusals_total"] == 1.0 and not f.exists()
        _all_free(llm)
        del llm, pool

    # without the disk tier the restart keeps nothing: A misses
    kw0 = {k: v for k, v in kw.items() if not k.startswith("kv_disk")}
    llm = _llm(folder, **kw0)
    (oa4,) = _gen(llm, [a], 4)
    assert oa4.num_cached_tokens == 0
    _all_free(llm)


def test_mamba2_recurrent_only_snapshots_on_disk_survive_a_restart(tmp_path: Any) -> None:
    """A model of recurrent layers only has no KV block to tier: its disk tier holds
    snapshot files alone (the share of kv_disk_tier_bytes). A's prompt snapshot evicted
    by C's (one slot, no host rows) is a file; a new engine on the directory hits A at
    32 from it, greedy-equal to transformers."""
    hf = make_hf("mamba2")
    hf.save_pretrained(tmp_path / "m")
    kw: dict[str, Any] = dict(
        max_num_batched_tokens=24,
        state_snapshot_slots=1,
        kv_disk_tier_bytes=1 << 20,
        kv_disk_tier_path=str(tmp_path / "disk"),
    )
    a = SYSTEM[:40] + [5, 6, 7]  # prompt boundary 32
    c = SYSTEM[50:90] + [8, 9]
    llm = _llm(str(tmp_path / "m"), **kw)
    assert llm.llm_engine.kv_cache_manager.tiers is None
    (oa,) = _gen(llm, [a], 6)
    _gen(llm, [c], 6)
    pool = llm.llm_engine.kv_cache_manager.state
    # a's prompt (32) and rolling decode (48) snapshots went to disk, c's (32) is held
    ha = hash_request_blocks(a + list(oa.outputs[0].token_ids), BS)
    assert pool is not None and set(pool.disk_snapshot_hashes()) == {ha[1], ha[2]}
    _all_free(llm)
    del llm, pool
    llm = _llm(str(tmp_path / "m"), **kw)
    (oa2,) = _gen(llm, [a], 6)
    assert oa.num_cached_tokens == 0 and oa2.num_cached_tokens == 32
    assert list(oa2.outputs[0].token_ids) == list(oa.outputs[0].token_ids) == hf_generate(hf, a, 6)
    assert llm.llm_engine.get_metrics()["kvpage:state_disk_snapshot_hits_total"] == 1.0
    _all_free(llm)
    # tiers that could hold nothing here are refused by name
    for bad, what in (
        (dict(kv_disk_tier_bytes=4000), "room for one state snapshot"),
        (dict(kv_host_tier_bytes=4000), "room for one state snapshot"),
        (dict(state_snapshot_slots=0), "state_snapshot_slots=0"),
    ):
        with pytest.raises(SpecError, match=what):
            _llm(str(tmp_path / "m"), **{**kw, **bad})


def test_disk_snapshots_stay_within_their_share_of_the_disk_budget(
    q3n: tuple[Any, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kv_disk_tier_bytes=60000 at the default share 0.1: snapshot files may take 6000
    bytes, one snapshot (5376 bytes here); A's file goes when C's is written, the
    directory never holds more than 60000 bytes; a restart with a share too small for
    one snapshot removes the file it finds (KV files stay) and says so."""
    _, folder = q3n
    a = SYSTEM + [11, 12, 13, 14, 15]
    c = [(5 * i + 1) % 250 + 3 for i in range(100)] + [9, 9, 9]
    d = [(11 * i + 5) % 250 + 3 for i in range(100)] + [8, 8]
    kw: dict[str, Any] = dict(
        max_num_batched_tokens=2048,
        state_snapshot_slots=1,
        num_blocks=10,
        kv_disk_tier_bytes=60000,
        kv_disk_tier_path=str(tmp_path),
    )
    llm = _llm(folder, **kw)
    pool = llm.llm_engine.kv_cache_manager.state
    assert pool is not None and pool.disk is not None
    disk = pool.disk
    assert disk.state_capacity_bytes == 6000
    outs = [_gen(llm, [p], 4)[0] for p in (a, c, d)]
    hc = hash_request_blocks(c, BS)[5]
    assert pool.disk_snapshot_hashes() == [hc] and pool.stats.disk_snapshots_stored == 2
    assert disk.state_used_bytes == 5376 and disk.used_bytes <= 60000
    assert sum(f.stat().st_size for f in disk.dir.iterdir()) < 60000 + 200 * len(disk)
    assert all(o.num_cached_tokens == 0 for o in outs)
    _all_free(llm)
    n_kv = len(disk) - 1
    del llm, pool, disk
    with caplog.at_level("WARNING", logger="kvpage.cache"):
        llm = _llm(folder, **{**kw, "state_snapshot_share": 0.05})  # 3000 bytes: none
    assert "kv_disk_tier_bytes=60000: its state_snapshot_share=0.05 holds no" in caplog.text
    pool = llm.llm_engine.kv_cache_manager.state
    tiers = llm.llm_engine.kv_cache_manager.tiers
    assert pool is not None and pool.disk is None and tiers is not None and tiers.disk
    assert tiers.disk.num_state_entries == 0 and len(tiers.disk) == n_kv
    _all_free(llm)
