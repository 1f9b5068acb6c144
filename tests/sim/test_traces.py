"""Trace loaders and the hash-id -> token-id mapping, checked against the statistics
in /work/shared/traces/README.md (computed independently over the full files)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpage.workload.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TokenMapper,
    TraceError,
    TraceRequest,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
    sim_blocks_per_hash_block,
)


@pytest.mark.parametrize(
    "name, rows, span, p_in, p_out",
    [
        ("azure-conv", 19366, 3501.7, (1020, 4083, 4142), (129, 451, 601)),
        ("azure-code", 8819, 3435.9, (1469, 7303.3, 7436), (13, 90, 251.5)),
        ("mooncake-conv", 12031, 3537.0, (6909, 39550.5, 85400.4), (350, 698, 1118.5)),
    ],
)
def test_bundled_traces_match_published_statistics(name, rows, span, p_in, p_out):
    t = load_trace(name)
    assert len(t) == rows
    assert t.duration_s == pytest.approx(span, abs=0.06)
    np.testing.assert_allclose(np.percentile(t.prompt_lens(), [50, 95, 99]), p_in, atol=0.06)
    np.testing.assert_allclose(np.percentile(t.output_lens(), [50, 95, 99]), p_out, atol=0.06)
    arr = t.arrivals()
    assert arr[0] == 0.0 and np.all(np.diff(arr) >= 0)


def test_mooncake_hash_ids_cover_prompt_and_limit():
    t = load_trace("mooncake-conv", limit=50)
    assert len(t) == 50 and t.has_hash_ids
    for r in t:
        assert r.hash_ids is not None
        assert len(r.hash_ids) == -(-r.prompt_tokens // MOONCAKE_BLOCK_TOKENS)
    # limit is None (all) or >= 1; 0 would be an empty trace, which is refused
    with pytest.raises(TraceError, match="limit: expected None"):
        load_trace("azure-conv", limit=0)


def test_azure_time_parsing(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.5000000,10,2\n2023-11-17 00:00:01.2500000,3,4"
    )
    t = load_azure_csv(p)
    assert [r.arrival_s for r in t] == [0.0, 1.75]
    assert [(r.prompt_tokens, r.output_tokens) for r in t] == [(10, 2), (3, 4)]
    assert t.requests[1].request_id == "r1" and t.requests[1].total_tokens == 7


@pytest.mark.parametrize(
    "text",
    [
        "A,B,C\n2023-11-16 00:00:00.0,1,1",
        "TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-date,1,1",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,-1,1",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,x,1",
    ],
)
def test_azure_bad_input(tmp_path, text):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(TraceError):
        load_azure_csv(p)


def test_mooncake_bad_input(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="line 1: hash_ids: expected 2 ids for 600 tokens"):
        load_mooncake_jsonl(p)
    p.write_text("{not json}\n")
    with pytest.raises(TraceError):
        load_mooncake_jsonl(p)
    with pytest.raises(TraceError):
        load_trace("no-such-trace")
    with pytest.raises(TraceError):
        load_trace(tmp_path / "x.txt")
    with pytest.raises(TraceError):
        load_trace("azure-conv", limit=-1)


def test_token_mapping_shares_exact_prefixes():
    m = TokenMapper(seed=3, vocab_size=1000)
    a = TraceRequest(0, 0.0, 1100, 5, (7, 8, 9))
    b = TraceRequest(1, 0.0, 700, 5, (7, 8))  # partial second block, same id 8
    c = TraceRequest(2, 0.0, 1024, 5, (7, 11))
    ta, tb, tc = m.prompt(a), m.prompt(b), m.prompt(c)
    assert (len(ta), len(tb), len(tc)) == (1100, 700, 1024)
    assert tb == ta[:700]  # shared ids -> identical tokens, partial tail is a prefix
    assert tc[:512] == ta[:512] and tc[512:] != ta[512:1024]
    assert all(0 <= x < 1000 for x in ta)
    # deterministic across instances, different across seeds
    assert TokenMapper(seed=3, vocab_size=1000).prompt(a) == ta
    assert TokenMapper(seed=4, vocab_size=1000).prompt(a) != ta
    # requests without hash ids are unique; outputs are unique per request
    u0 = m.prompt(TraceRequest(0, 0.0, 64, 3))
    u1 = m.prompt(TraceRequest(1, 0.0, 64, 3))
    assert len(u0) == 64 and u0 != u1
    assert m.output(a) != m.output(b) and len(m.output(a)) == 5


def test_token_mapping_rejects_short_hash_ids():
    with pytest.raises(TraceError):
        TokenMapper().prompt(TraceRequest(0, 0.0, 1025, 1, (1, 2)))
    with pytest.raises(TraceError):
        TokenMapper(vocab_size=1)
    assert sim_blocks_per_hash_block(16) == 32 and sim_blocks_per_hash_block(512) == 1


def test_out_of_order_timestamps_are_sorted_stably(tmp_path):
    # finding: out-of-order rows were kept unsorted (negative span / "-1.7 s of arrivals")
    p = tmp_path / "ooo.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 00:00:02.0,1,1\n"
        "2023-11-16 00:00:00.5,2,1\n"
        "2023-11-16 00:00:02.0,3,1\n"
        "2023-11-16 00:00:01.0,4,1\n"
    )
    t = load_azure_csv(p)
    assert [r.index for r in t] == [1, 3, 0, 2]  # equal timestamps keep file order
    assert [r.arrival_s for r in t] == [0.0, 0.5, 1.5, 1.5]
    assert [r.prompt_tokens for r in t] == [2, 4, 1, 3]
    assert t.duration_s == 1.5
    # limit = the first rows of the file, then sorted
    assert [r.index for r in load_azure_csv(p, limit=2)] == [1, 0]
    q = tmp_path / "ooo.jsonl"
    q.write_text(
        '{"timestamp": 3000, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1000, "input_length": 1, "output_length": 1, "hash_ids": [2]}\n'
    )
    m = load_mooncake_jsonl(q)
    assert [r.index for r in m] == [1, 0] and [r.arrival_s for r in m] == [1.0, 3.0]
    assert m.duration_s == 2.0


def test_header_only_and_empty_traces_are_refused(tmp_path):
    p = tmp_path / "empty.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(p)
    q = tmp_path / "empty.jsonl"
    q.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(q)


def test_mooncake_missing_key_message(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="got a record without timestamp"):
        load_mooncake_jsonl(p)
    p.write_text("[1, 2]\n")
    with pytest.raises(TraceError, match="got a JSON list"):
        load_mooncake_jsonl(p)


def test_trace_spanning_centuries_is_refused(tmp_path):
    # a timestamp typo (1e300 ms) would make a replay wait forever: refused by name
    row = '{{"timestamp": {t}, "input_length": 10, "output_length": 1, "hash_ids": [0]}}\n'
    p = tmp_path / "far.jsonl"
    p.write_text(row.format(t=0) + row.format(t=1e300))
    with pytest.raises(TraceError, match=r"far.jsonl: request 1: arrival: expected at most"):
        load_mooncake_jsonl(p)
    p.write_text(row.format(t=0) + row.format(t=7 * 86400 * 1000))  # one week: fine
    assert load_mooncake_jsonl(p).duration_s == pytest.approx(7 * 86400)
