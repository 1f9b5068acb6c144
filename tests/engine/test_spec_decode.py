"""Speculative decoding (n-gram prompt lookup): greedy output token-identical to plain
decoding (chunked prefill, preemption, stops inside an accepted draft), KV rollback
(pool integrity, no rejected token hashed), refusals by name and the config rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpage.cache.hashing import hash_request_blocks
from kvpage.engine import LLM, SamplingParams
from kvpage.engine.spec_decode import NgramProposer, accept_greedy, accept_sampled
from kvpage.errors import RequestRejected, SpecError
from kvpage.specs.speculative import parse_speculative_config

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "draft_policy": "fixed",  # drafts every step: the counts below are deterministic
}
ADAPTIVE = {**SPEC, "draft_policy": "adaptive"}
PROMPTS = [
    # repeat their context, so drafts get accepted
    "Once upon a time there was a little girl named Lily. She liked to play outside. "
    "Once upon a time there was a little girl named",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    # plain text
    "Tom had a red ball. He",
    "One day, a big dog",
]


def _run(spec: dict[str, Any] | None, params: SamplingParams, **kw: Any) -> tuple[Any, list[Any]]:
    llm = LLM(model="stories260K", speculative_config=spec, **kw)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.llm_engine.kv_cache_manager.check_integrity()
    return llm.llm_engine, outs


def _same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        ox, oy = x.outputs[0], y.outputs[0]
        assert (ox.token_ids, ox.text, ox.finish_reason, ox.stop_reason) == (
            oy.token_ids,
            oy.text,
            oy.finish_reason,
            oy.stop_reason,
        )


def _hashed_are_accepted(engine: Any, outs: list[Any]) -> None:
    """Every hash registered in the pool is a block of some request's final tokens
    (prompt + output): a block holding a rejected draft would hash differently."""
    kvm = engine.kv_cache_manager
    bs = kvm.block_size
    valid = set()
    for o in outs:
        valid.update(
            hash_request_blocks(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), bs)
        )
    registered = [
        b.block_hash for p in kvm.block_pools for b in p.blocks if b.block_hash is not None
    ]
    assert registered
    assert set(registered) <= valid


def test_greedy_identical_chunked_prefill_and_rollback() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60)
    kw = dict(max_num_batched_tokens=16, block_size=4)  # chunked prefill, many blocks
    base, ref = _run(None, params, **kw)
    eng, got = _run(SPEC, params, **kw)
    _same(ref, got)
    m = eng.get_metrics()
    assert m["kvpage:spec_decode_num_draft_tokens_total"] > 0
    assert (
        0
        < m["kvpage:spec_decode_num_accepted_tokens_total"]
        <= m["kvpage:spec_decode_num_draft_tokens_total"]
    )
    assert (
        m["kvpage:generation_tokens_total"] == base.get_metrics()["kvpage:generation_tokens_total"]
    )
    # fewer steps than tokens: some step emitted several
    assert eng.step_stats.num_steps < base.step_stats.num_steps
    _hashed_are_accepted(eng, got)
    assert eng.kv_cache_manager.num_used_blocks == 0


def test_stops_inside_an_accepted_draft() -> None:
    """max_tokens, stop token ids and stop strings at every position of a repeating
    output end exactly where plain decoding ends (nothing past the stop)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    _, ref = _run(None, greedy)
    out0 = ref[1].outputs[0]  # the repeating prompt
    ids, text = out0.token_ids, out0.text
    cases = [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 2, 3, 5, 8, 13)]
    cases += [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[t]) for t in ids[3:9]]
    words = [w for w in text.split() if w][:6]
    cases += [SamplingParams(temperature=0.0, max_tokens=40, stop=[w]) for w in words]
    cases.append(
        SamplingParams(
            temperature=0.0, max_tokens=40, stop=[words[-1]], include_stop_str_in_output=True
        )
    )
    # one batch per engine: every case is a request of its own
    prompt = PROMPTS[1]
    a = LLM(model="stories260K").generate([prompt] * len(cases), cases, use_tqdm=False)
    spec_llm = LLM(model="stories260K", speculative_config=SPEC)
    b = spec_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    spec_llm.llm_engine.kv_cache_manager.check_integrity()
    assert spec_llm.llm_engine.get_metrics()["kvpage:spec_decode_num_accepted_tokens_total"] > 0
    _same(a, b)


def test_preemption_identical() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60)
    kw = dict(block_size=4, num_blocks=40, max_num_batched_tokens=32)
    base, ref = _run(None, params, **kw)
    eng, got = _run(SPEC, params, **kw)
    assert eng.scheduler.num_preemptions > 0
    _same(ref, got)


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        (dict(temperature=0.0, repetition_penalty=1.2), "repetition_penalty"),
        (dict(temperature=0.8, presence_penalty=0.5), "presence_penalty"),
        (dict(temperature=0.8, min_p=0.1), "min_p"),
        (dict(temperature=0.0, min_tokens=3), "min_tokens"),
    ],
)
def test_refused_by_name(kw: dict[str, Any], name: str) -> None:
    llm = LLM(model="stories260K", speculative_config=SPEC)
    with pytest.raises(RequestRejected, match=rf"^{name}: expected .* speculative decoding") as e:
        llm.llm_engine.add_request("r", "Once", SamplingParams(**kw))
    assert e.value.reason == "invalid_sampling_params"


@pytest.mark.parametrize(
    ("value", "msg"),
    [
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            r"speculative_config.method: expected 'ngram'",
        ),
        ({"method": "ngram"}, r"num_speculative_tokens: expected an int >= 1, got none"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens: expected an int >= 1, got 0"),
        ({"num_speculative_tokens": 2, "model": "x"}, r"speculative_config.model: expected one of"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
            r"prompt_lookup_min: expected <= prompt_lookup_max=2, got 3",
        ),
        ("[1]", r"speculative_config: expected None or a dict"),
    ],
)
def test_config_rules(value: Any, msg: str) -> None:
    with pytest.raises(SpecError, match=msg):
        parse_speculative_config(value)
    with pytest.raises(SpecError, match=msg):
        LLM(model="stories260K", speculative_config=value)


def test_config_defaults_and_json() -> None:
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)


def test_ngram_proposer_and_accept_rule() -> None:
    p = NgramProposer(3, 1, 3)
    # "5 6 7" occurred before, followed by 8 9 1
    assert p.propose_one([5, 6, 7, 8, 9, 1, 2, 5, 6, 7], 10) == [8, 9, 1]
    assert p.propose_one([5, 6, 7, 8, 9, 1, 2, 5, 6, 7], 2) == [8, 9]
    assert p.propose_one([1, 2, 3, 4], 5) == []
    # the latest earlier occurrence of the longest matching suffix wins
    assert p.propose_one([1, 2, 9, 1, 2, 8, 1, 2], 1) == [8]
    assert accept_greedy([4, 5, 6], [4, 5, 6], 7) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 9, 6], 7) == [4, 9]
    assert accept_greedy([4], [3], 7) == [3]


def test_rollback_after_every_step() -> None:
    """After each step a running sequence holds KV positions (and blocks) for exactly
    its computed tokens: the rejected drafts' slots were given back."""
    llm = LLM(model="stories260K", speculative_config=SPEC, block_size=4)
    eng = llm.llm_engine
    kvm = eng.kv_cache_manager
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=40))
    rejected = 0
    while eng.has_unfinished_requests():
        before = eng.spec_stats.num_draft_tokens - eng.spec_stats.num_accepted_tokens
        eng.step()
        rejected += eng.spec_stats.num_draft_tokens - eng.spec_stats.num_accepted_tokens - before
        for r in eng.scheduler.running:
            n = r.num_computed_tokens
            assert kvm.num_allocated_tokens(r.request_id) == n
            assert len(kvm.block_table(r.request_id)) == -(-n // 4)
        kvm.check_integrity()
    assert rejected > 0
    assert kvm.num_used_blocks == 0


def _chi2_homogeneity(a: list[Any], b: list[Any]) -> tuple[float, int, float]:
    """Pearson's chi-square test that samples ``a`` and ``b`` share one distribution:
    ``(statistic, degrees of freedom, p-value)``; categories expected < 5 times in
    either sample are pooled into one (p-value: the regularised upper incomplete gamma
    function, ``torch.special.gammaincc(df / 2, stat / 2)``)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells: list[tuple[int, int]] = []
    other = [0, 0]
    for k in set(ca) | set(cb):
        tot = ca[k] + cb[k]
        if min(tot * na, tot * nb) / (na + nb) < 5:
            other[0] += ca[k]
            other[1] += cb[k]
        else:
            cells.append((ca[k], cb[k]))
    if sum(other):
        cells.append((other[0], other[1]))
    stat = 0.0
    for oa, ob in cells:
        tot = oa + ob
        for o, n in ((oa, na), (ob, nb)):
            e = tot * n / (na + nb)
            stat += (o - e) ** 2 / e
    df = len(cells) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
    return stat, df, p


def test_sampled_distribution_matches_plain() -> None:
    """Rejection sampling keeps the output distribution: the joint distribution of
    output tokens 2-4 (those the drafts cover) of 1,200 seeded requests with and
    without speculation; chi-square homogeneity test, fixed seeds, threshold p > 0.001
    (deterministic: the seeds fix every draw)."""
    n = 1200
    prompt = PROMPTS[1]

    def run(spec: dict[str, Any] | None, base_seed: int) -> tuple[list[Any], Any]:
        llm = LLM(model="stories260K", speculative_config=spec)
        params = [
            SamplingParams(
                temperature=0.8, top_k=4, max_tokens=6, ignore_eos=True, seed=base_seed + i
            )
            for i in range(n)
        ]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        llm.llm_engine.kv_cache_manager.check_integrity()
        return [tuple(o.outputs[0].token_ids[1:4]) for o in outs], llm.llm_engine

    plain, _ = run(None, 0)
    spec, eng = run(SPEC, 10**6)
    st = eng.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both branches ran
    stat, df, p = _chi2_homogeneity(plain, spec)
    assert df >= 5
    assert p > 1e-3, (stat, df, p)


def test_accept_sampled_rule() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept_sampled([1, 2], probs, 0, g) == [1, 2, 0]  # certain drafts: all kept
    probs = torch.tensor([[0.5, 0.0, 0.5]])
    got = accept_sampled([1], probs, 0, g)  # impossible draft: replaced from the residual
    assert len(got) == 1 and got[0] in (0, 2)


def test_tiers_and_events_see_only_accepted_blocks() -> None:
    """With a host tier and a KV-event publisher, a speculating engine's router view
    equals its pool, its tier holds only blocks of accepted tokens, and its outputs
    equal a plain engine's."""
    from kvpage.routing import KVEventPublisher, PrefixIndex

    kw: dict[str, Any] = dict(block_size=4, num_blocks=48, kv_host_tier_bytes=64 * 4 * 1280)
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model="stories260K", **kw)
    llm = LLM(model="stories260K", speculative_config=SPEC, **kw)
    kvm = llm.llm_engine.kv_cache_manager
    tiers = kvm.tiers
    assert tiers is not None and tiers.host is not None
    pub = KVEventPublisher("r0")
    pub.attach(kvm)
    idx = PrefixIndex()
    idx.resync(pub.snapshot())
    valid: set[bytes] = set()
    for prompt in PROMPTS + PROMPTS[:2]:
        (a,) = plain.generate([prompt], p, use_tqdm=False)
        (o,) = llm.generate([prompt], p, use_tqdm=False)
        _same([a], [o])
        valid.update(
            hash_request_blocks(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), 4)
        )
        batch = pub.drain(heartbeat=True)
        assert batch is not None and idx.apply(batch)
        assert idx.view("r0") == kvm.prefix_pools[0].cached_hashes()
        assert idx.view("r0", "host") == frozenset(tiers.host.hashes())
        assert kvm.prefix_pools[0].cached_hashes() <= valid
        assert frozenset(tiers.host.hashes()) <= valid
        kvm.check_integrity()
    assert tiers.host.stats.demotions > 0
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_config_batch_limit_and_policy_keys() -> None:
    c = parse_speculative_config({"num_speculative_tokens": 2})
    assert c is not None and (c.disable_by_batch_size, c.draft_policy) == (None, "adaptive")
    c = parse_speculative_config(
        {"num_speculative_tokens": 2, "disable_by_batch_size": 4, "draft_policy": "fixed"}
    )
    assert c is not None and (c.disable_by_batch_size, c.draft_policy) == (4, "fixed")
    for bad, msg in (
        ({"disable_by_batch_size": 0}, r"disable_by_batch_size: expected an int >= 1, got 0"),
        ({"draft_policy": "greedy"}, r"draft_policy: expected one of adaptive, fixed, got"),
    ):
        with pytest.raises(SpecError, match=msg):
            parse_speculative_config({"num_speculative_tokens": 2, **bad})


def test_disable_by_batch_size() -> None:
    """No step drafts while more than ``disable_by_batch_size`` sequences run; the
    batch drafts again once it shrinks to the limit; outputs equal plain decoding."""
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (60, 8, 8, 8)]
    plain = LLM(model="stories260K").generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model="stories260K", speculative_config={**SPEC, "disable_by_batch_size": 1})
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        eng.add_request(str(i), p, sp)
    outs: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        batch = len(eng.scheduler.running)
        before = eng.spec_stats.num_draft_tokens
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        if batch > 1:
            assert eng.spec_stats.num_draft_tokens == before
    assert eng.spec_stats.num_accepted_tokens > 0  # the long one drafted once alone
    _same(plain, [outs[str(i)] for i in range(len(PROMPTS))])
    eng.kv_cache_manager.check_integrity()


def test_adaptive_policy_greedy_identical() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60)
    kw = dict(max_num_batched_tokens=16, block_size=4)
    _, ref = _run(None, params, **kw)
    eng, got = _run(ADAPTIVE, params, **kw)
    _same(ref, got)
    assert eng.spec_stats.num_draft_tokens > 0  # the warm-up drafts
    assert eng.kv_cache_manager.num_used_blocks == 0


def test_draft_policy_rules() -> None:
    from kvpage.engine.spec_decode import DraftPolicy

    p = DraftPolicy(4, None, adaptive=True)
    # rule 4: full acceptance grows by 2 (cap k), any rejection shrinks by 1 (floor 1)
    p.mode = "short"
    assert p.limit("a") == 4
    for acc, want in ((1, 3), (0, 2), (0, 1), (0, 1), (1, 3), (3, 4)):
        p.observe_verified("a", p.limit("a"), acc)
        assert p.limit("a") == want
    p.prune(["b"])
    assert p.limit("a") == 4
    # rule 3: each mode warms up in MODES order, then the cheapest per token wins and
    # every PROBE_EVERY-th decision takes one of the others, alternately
    cost = {"full": 5e-4, "short": 4.5e-4, "off": 4e-4}  # seconds per emitted token
    modes = []
    for _ in range(9 + 64):
        on = p.drafting(8)
        assert on == (p.mode != "off")
        modes.append(p.mode)
        p.observe_step(cost[p.mode] * 5, 5, pure_decode=True)
    assert modes[:9] == ["full"] * 3 + ["short"] * 3 + ["off"] * 3
    probes = [m for m in modes[9:] if m != "off"]
    assert probes == ["full", "short"] * (64 // DraftPolicy.PROBE_EVERY // 2)
    # in mode "short" a sequence gets its own draft length, in "full" k
    p.observe_verified("c", 4, 0)
    p.mode = "short"
    assert p.limit("c") == 3
    p.mode = "full"
    assert p.limit("c") == 4
    # another bucket is measured on its own; batch 1 where drafting pays
    for _ in range(9 + 32):  # the next decision (the 33rd) is no probe
        p.drafting(1)
        p.observe_step(1e-3, {"full": 3, "short": 2, "off": 1}[p.mode], pure_decode=True)
    arms = p.buckets[1].arms
    assert arms["full"].cost < arms["short"].cost < arms["off"].cost
    assert p.drafting(1) and p.mode == "full"
    # a step with a prefill chunk is not recorded
    n = sum(a.steps for a in p.buckets[4].arms.values())
    p.drafting(8)
    p.observe_step(1.0, 1, pure_decode=False)
    assert sum(a.steps for a in p.buckets[4].arms.values()) == n
    # rule 1 before everything; "fixed" always drafts k
    q = DraftPolicy(4, 2, adaptive=False)
    assert not q.drafting(3) and q.drafting(2) and q.limit("x") == 4


def _same_logprobs(a: Any, b: Any, tol: float = 1e-4) -> None:
    """Per position: the same chosen and top token ids, ranks and logprobs within
    ``tol`` (the verification forward computes the positions as a chunk, plain decoding
    one by one)."""
    assert a is not None and b is not None and len(a) == len(b)
    for pa, pb in zip(a, b):
        assert list(pa) == list(pb)
        for t in pa:
            assert pa[t].rank == pb[t].rank
            assert abs(pa[t].logprob - pb[t].logprob) <= tol


def test_n_and_logprobs_greedy_identical() -> None:
    """n > 1 (every sample speculates after the fork) and logprobs (emitted tokens
    scored on their verification rows, the bonus on its sampled row) equal plain
    decoding: same tokens, same top-3 ids and ranks, logprobs within 1e-4."""
    params = SamplingParams(temperature=0.0, max_tokens=40, n=2, logprobs=3, prompt_logprobs=2)
    _, ref = _run(None, params, block_size=4)
    eng, got = _run(SPEC, params, block_size=4)
    assert eng.spec_stats.num_accepted_tokens > 0
    for x, y in zip(ref, got, strict=True):
        assert len(x.outputs) == len(y.outputs) == 2
        for ox, oy in zip(x.outputs, y.outputs, strict=True):
            assert ox.token_ids == oy.token_ids and ox.finish_reason == oy.finish_reason
            assert len(oy.logprobs) == len(oy.token_ids)
            _same_logprobs(ox.logprobs, oy.logprobs)
            assert abs(ox.cumulative_logprob - oy.cumulative_logprob) <= 1e-3
        _same_logprobs(x.prompt_logprobs[1:], y.prompt_logprobs[1:])
    assert eng.kv_cache_manager.num_used_blocks == 0


def test_logprobs_with_stops_inside_a_draft() -> None:
    """A stop inside an accepted draft keeps exactly the appended tokens' logprobs."""
    _, ref = _run(None, SamplingParams(temperature=0.0, max_tokens=40))
    ids = ref[1].outputs[0].token_ids
    cases = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=1) for m in (3, 7, 12)]
    cases += [
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[t], logprobs=0)
        for t in ids[4:8]
    ]
    prompt = PROMPTS[1]
    a = LLM(model="stories260K").generate([prompt] * len(cases), cases, use_tqdm=False)
    llm = LLM(model="stories260K", speculative_config=SPEC)
    b = llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    _same(a, b)
    for x, y in zip(a, b):
        _same_logprobs(x.outputs[0].logprobs, y.outputs[0].logprobs)


def test_sampled_n_children_speculate() -> None:
    """Sampled n = 3 with logprobs: every sample gets its own tokens (seeded), its
    logprobs are one per token and equal the model's raw log-softmax of the plain
    path's scoring (each sample re-scored by a plain engine with prompt_logprobs)."""
    llm = LLM(model="stories260K", speculative_config=SPEC, block_size=4)
    params = SamplingParams(temperature=0.8, top_k=4, n=3, max_tokens=24, seed=5, logprobs=0)
    (o,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    eng = llm.llm_engine
    assert eng.spec_stats.num_drafts > 0
    eng.kv_cache_manager.check_integrity()
    assert eng.kv_cache_manager.num_used_blocks == 0
    plain = LLM(model="stories260K")
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for c in o.outputs:
        assert len(c.token_ids) == 24 and len(c.logprobs) == 24
        (sc,) = plain.generate(
            [{"prompt_token_ids": list(o.prompt_token_ids) + list(c.token_ids)}],
            score,
            use_tqdm=False,
        )
        want = sc.prompt_logprobs[len(o.prompt_token_ids) :]
        for t, lp, w in zip(c.token_ids, c.logprobs, want, strict=True):
            assert abs(lp[t].logprob - w[t].logprob) <= 1e-4


def test_draft_policy_cost_is_winsorised() -> None:
    """One step stalled 100x by another process moves a mode's cost estimate by at most
    EMA_WEIGHT * 0.5 of itself (the 1.5x cap)."""
    from kvpage.engine.spec_decode import DraftPolicy

    p = DraftPolicy(4, None, adaptive=True)
    for _ in range(3):
        p.drafting(1)
        p.observe_step(1e-3, 1, pure_decode=True)
    arm = p.buckets[1].arms["full"]
    assert arm.cost == pytest.approx(1e-3)
    for _ in range(3):  # the "short" and "off" warm-ups
        p.drafting(1)
        p.observe_step(1e-3, 1, pure_decode=True)
    while not (p.drafting(1) and p.mode == "full"):
        p.observe_step(1e-3, 1, pure_decode=True)
    p.observe_step(0.1, 1, pure_decode=True)
    assert arm.cost == pytest.approx(1e-3 * (1 + DraftPolicy.EMA_WEIGHT * 0.5))
