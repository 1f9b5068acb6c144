"""Router policies: each one's documented rule, the kv_precise cost, make_policy errors."""

from __future__ import annotations

import pytest

from kvpage.cache import hash_request_blocks
from kvpage.routing import (
    CostWeights,
    KVSnapshot,
    PrefixIndex,
    ReplicaLoad,
    RoutingError,
    make_policy,
    route_request,
)
from kvpage.routing.policies import KVPrecisePolicy

BS = 4


def L(rid: str, run: int = 0, wait: int = 0, kv: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(rid, run, wait, kv)


def _req(tokens: list[int]):
    return route_request(tokens, block_size=BS)


def test_route_request_uses_the_engine_hash() -> None:
    toks = list(range(10))
    r = route_request(toks, block_size=BS, cache_salt="t1", hash_seed=3)
    assert r.block_hashes == hash_request_blocks(toks, BS, cache_salt="t1", hash_seed=3)
    assert route_request(toks, block_size=BS).block_hashes != r.block_hashes


def test_round_robin_cycles() -> None:
    p = make_policy("round_robin")
    loads = [L("a"), L("b"), L("c")]
    assert [p.choose(_req([1]), loads) for _ in range(4)] == ["a", "b", "c", "a"]


def test_power_of_two_prefers_the_less_queued_of_two() -> None:
    p = make_policy("power_of_two", seed=1)
    loads = [L("a", 5, 5), L("b", 0, 0)]
    assert all(p.choose(_req([1]), loads) == "b" for _ in range(5))
    many = [L("x", 9, 0), L("y", 9, 0), L("z", 0, 0)]
    picks = {p.choose(_req([1]), many) for _ in range(50)}
    assert "z" in picks and picks <= {"x", "y", "z"}


def test_prefix_approx_follows_past_decisions_without_eviction_feedback() -> None:
    p = make_policy("prefix_approx", seed=0)
    loads = [L("a"), L("b"), L("c")]
    toks = list(range(40))
    r = _req(toks)
    first = p.choose(r, loads)
    p.on_routed(r, first)
    follow = _req(toks + [7, 7, 7, 7])
    assert p.choose(follow, loads) == first  # it remembers where the prefix went
    # a fresh prompt goes to a replica with the smallest tree share
    fresh = _req(list(range(500, 540)))
    assert p.choose(fresh, loads) != first
    # imbalance above the threshold (10): falls back to power of two, least queued of two
    busy = [L(first, 20, 0)] + [L(x) for x in "abc" if x != first]
    assert p.choose(follow, busy) != first
    p.forget(first)
    assert all(first not in s for s in p._tree.values()) and first not in p._tenant_size


def test_kv_precise_cost_formula_and_tie_break() -> None:
    idx = PrefixIndex()
    toks = list(range(40))  # 10 blocks
    h = hash_request_blocks(toks, BS)
    idx.resync(KVSnapshot("a", 0, frozenset(h[:6])))
    idx.resync(KVSnapshot("b", 0, frozenset()))
    p = make_policy(
        "kv_precise", index=idx, cost=CostWeights(waiting=1.0, running=0.5, kv_usage=1.0)
    )
    assert isinstance(p, KVPrecisePolicy)
    r = _req(toks)
    # B = 1 before anything was routed: cost = misses + 1 * (waiting + 0.5 running + kv)
    sc = p.scores(r, [L("a", 2, 1, 0.5), L("b")])
    assert sc == {"a": 4 + (1 + 1.0 + 0.5), "b": 10.0}
    assert p.choose(r, [L("a", 2, 1, 0.5), L("b")]) == "a"
    p.on_routed(r, "a")  # B = its 4 uncached blocks at "a": one waiting request costs 4
    assert p.mean_blocks == 4.0
    assert p.scores(r, [L("a", 0, 1), L("b")]) == {"a": 4 + 4.0, "b": 10.0}
    assert p.choose(r, [L("a", 0, 1), L("b")]) == "a"
    assert p.choose(r, [L("a", 0, 2), L("b")]) == "b"
    # routed without a scores() call first (or to another replica): B from the index
    p.on_routed(_req(toks), "b")  # 10 uncached blocks at "b"
    assert p.mean_blocks == (4 + 10) / 2


def test_oracle_longest_prefix_then_least_queued() -> None:
    held = {"a": 1, "b": 3, "c": 3}
    p = make_policy("oracle", lookup=lambda hs: dict(held))
    assert p.choose(_req(list(range(16))), [L("a"), L("b", 4), L("c", 1)]) == "c"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="fastest"), "router: expected one of"),
        (dict(name="kv_precise"), "index"),
        (dict(name="oracle"), "index"),
        (dict(name="round_robin", cost=CostWeights()), "cost"),
        (dict(name="kv_precise", lookup=lambda h: {}), "lookup"),
    ],
)
def test_make_policy_refuses_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        make_policy(**kwargs)


def test_bad_inputs_refused() -> None:
    with pytest.raises(RoutingError, match="loads"):
        make_policy("power_of_two").choose(_req([1]), [])
    with pytest.raises(RoutingError, match="cost.waiting"):
        CostWeights(waiting=-1.0)
