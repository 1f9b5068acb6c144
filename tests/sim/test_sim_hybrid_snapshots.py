"""Issue 26's simulator accounting: a Qwen3-Next-80B-A3B-like hybrid
(benches/bench_hybrid_snapshots.py's config) on one 80 GB device: state bytes, the
memory split between KV blocks, live states and snapshots, vLLM's raised block size,
and that a hit on a hybrid needs a snapshot at its end (the attention-only bound with
free state never hits less). Counts, not speed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kvpage.errors import SpecError
from kvpage.sim.instance import snapshot_slots
from kvpage.sim.simulator import build_setup, simulate
from kvpage.workload.trace_types import TraceRequest

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_hybrid", ROOT / "benches/bench_hybrid_snapshots.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, str]:
    b = _bench()
    return b, b.write_preset(tmp_path_factory.mktemp("preset"))


def test_state_bytes_split_and_vllm_block_size(bench: tuple[ModuleType, str]) -> None:
    b, model = bench
    cfg = b.config(model, 16, "snapshots", state_snapshot_share=0.1)
    spec, cost, _, _ = build_setup(cfg)
    # Gated DeltaNet: conv (16*128*2 + 32*128 = 8192 channels) x (kernel 4 - 1) + the
    # 32 x 128 x 128 state, bf16, in 36 of the 48 layers
    per_layer = (8192 * 3 + 32 * 128 * 128) * 2
    assert len(spec.state_layers) == 36 and spec.num_layers == 12
    assert spec.state_bytes_per_sequence == 36 * per_layer == 39_518_208
    assert spec.bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert cost.state_bytes_per_sequence == spec.state_bytes_per_sequence
    # budget = 80e9 x 0.9 - 40e9 weights; live states first, then 10 % to snapshots
    budget = int(80e9 * 0.9) - b.WEIGHT_BYTES
    live = 64 * spec.state_bytes_per_sequence
    kv = (spec.num_blocks - 1) * spec.bytes_per_block
    n_snap = snapshot_slots(cfg, spec)
    snap = n_snap * spec.state_bytes_per_sequence
    assert kv + spec.bytes_per_block + live + snap <= budget
    assert abs(snap - 0.1 * (budget - live)) <= spec.state_bytes_per_sequence + spec.bytes_per_block
    # vLLM: one 2,048-byte-per-token attention layer page must hold 1,097,728 bytes
    assert b.vllm_block_size(spec) == 544 == 34 * 16
    assert 528 * 2048 < per_layer <= 544 * 2048  # 536 tokens: 528 too few, 544 enough
    # the bound keeps the same KV blocks, without state
    free, _, _, _ = build_setup(b.config(model, 16, "free", state_snapshot_share=0.1))
    assert free.num_blocks == spec.num_blocks and free.state_layers == ()


def test_refusals(bench: tuple[ModuleType, str]) -> None:
    b, model = bench
    for kw, match in (
        (dict(recurrent_state="maybe"), "recurrent_state"),
        (dict(state_snapshot_share=1.0), "state_snapshot_share"),
    ):
        with pytest.raises(SpecError, match=match):
            build_setup(b.config(model, 16, kw.pop("recurrent_state", "snapshots"), **kw))


def test_hits_need_a_snapshot_and_the_bound_hits_at_least_as_much(
    bench: tuple[ModuleType, str],
) -> None:
    """Four requests share a 1,024-token prefix (two 512-token hash blocks), one after
    the other: a hybrid hit needs a snapshot at its end (kvpage: block-16 positions,
    vLLM-aligned: 544-token ones); the attention-only bound serves every KV hit."""
    b, model = bench
    reqs = [TraceRequest(i, 10.0 * i, 1024 + 300, 4, (0, 1, 100 + i)) for i in range(4)]
    res = {}
    for name, bs, mode in (("kvpage", 16, "snapshots"), ("vllm", 544, "snapshots"), ("bound", 16, "free")):  # fmt: skip
        res[name] = simulate(reqs, b.config(model, bs, mode))
    for r in res.values():
        assert r.finished == 4
    st = res["kvpage"].extra["state"]
    assert st["snapshots_taken"] >= 1 and "state" not in res["bound"].extra
    assert res["bound"].prefix_hit_pct >= res["kvpage"].prefix_hit_pct
    assert res["bound"].prefix_hit_pct >= res["vllm"].prefix_hit_pct
    # the bound: every later request hits the 1,024 shared tokens
    assert res["bound"].prefix_hit_pct == pytest.approx(100 * 3 * 1024 / (4 * 1324))
    # kvpage: request 0 snapshots its prompt boundary 1,312; request 1 finds the KV of
    # the shared 1,024 tokens but no state there, so it hits nothing and takes the
    # predicted-shared snapshot at 1,024 (2 requests passed it); requests 2 and 3 hit it
    assert st["snapshots_taken_by_kind"]["predicted"] >= 1
    assert st["snapshot_hits"] == 2
    assert res["kvpage"].prefix_hit_pct == pytest.approx(100 * 2 * 1024 / (4 * 1324))
    # vLLM-aligned (544): the deepest aligned boundary inside the shared prefix is 544
    assert res["vllm"].prefix_hit_pct == pytest.approx(100 * 2 * 544 / (4 * 1324))


def test_cluster_oracle_sees_snapshots_only(bench: tuple[ModuleType, str]) -> None:
    """On a hybrid, the oracle router's lookup counts cached KV blocks only up to the
    deepest state snapshot among them (a hit needs one at its end); a whole cluster
    run on the hybrid finishes and hits as one instance does."""
    from kvpage.routing.base import route_request
    from kvpage.sim.cluster import _Cluster, simulate_cluster
    from kvpage.workload.traces import TokenMapper

    b, model = bench
    cfg = b.config(model, 16, "snapshots")
    first = TraceRequest(0, 0.0, 1024 + 300, 4, (0, 1, 100))
    cl = _Cluster([first], cfg, TokenMapper(seed=0, hash_block_tokens=512), 2, "oracle", 0, None, 0.0)  # fmt: skip
    inst = cl.insts[0]
    prompt = inst.mapper.prompt(first)
    inst.submit(first, 0.0, prompt)
    while inst.has_unfinished():
        inst.step()
    hashes = route_request(prompt, block_size=16, hash_seed=0).block_hashes[:82]  # full
    assert len(hashes) == 82 and inst.kv.prefix_pools[0].is_cached(hashes[81])
    # KV of all 82 full blocks is cached, the one snapshot is the prompt boundary's
    assert cl.exact_lookup(hashes) == {"i0": 82, "i1": 0}
    assert cl.exact_lookup(hashes[:81]) == {"i0": 0, "i1": 0}  # KV there, no state

    reqs = [TraceRequest(i, 10.0 * i, 1024 + 300, 4, (0, 1, 100 + i)) for i in range(4)]
    r = simulate_cluster(reqs, cfg, instances=2, router="oracle")
    assert r.finished == 4
    # hit blocks / full prompt blocks: 2 requests x 64 of 4 x 82
    assert r.prefix_hit_pct == pytest.approx(100 * 2 * 64 / (4 * 82))


def test_cluster_kv_precise_sees_snapshots_as_the_oracle(
    bench: tuple[ModuleType, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_precise's PrefixIndex on hybrid instances (state snapshots arrive as events of
    medium "state") counts, at every routing decision, what the oracle's exact lookup
    counts; its KV-only run alone would have over-counted some of them."""
    import kvpage.sim.cluster as cluster

    b, model = bench
    cfg = b.config(model, 16, "snapshots")
    seen: list[tuple[dict[str, int], dict[str, int], dict[str, int]]] = []
    last: dict[str, object] = {}
    route, loads = cluster.route_request, cluster._Cluster.loads

    def spy_route(*a: object, **kw: object) -> object:
        last["req"] = r = route(*a, **kw)  # type: ignore[arg-type]
        return r

    def spy_loads(self: cluster._Cluster) -> object:  # called right before choose
        h = last["req"].block_hashes  # type: ignore[attr-defined]
        seen.append((self.index.matched_blocks(h), self.exact_lookup(h), self.index._matched_kv(h)))
        return loads(self)

    monkeypatch.setattr(cluster, "route_request", spy_route)
    monkeypatch.setattr(cluster._Cluster, "loads", spy_loads)
    # shared 1024-token prefix (2 hash ids), then 300 tokens of each request's own;
    # request 4 repeats request 0's prompt
    reqs = [TraceRequest(i, 10.0 * i, 1024 + 300, 4, (0, 1, 100 + i % 4)) for i in range(5)]
    r = cluster.simulate_cluster(reqs, cfg, instances=2, router="kv_precise")
    assert r.finished == 5 and len(seen) == 5
    for index_view, exact, _ in seen:
        assert index_view == exact
    # without the state cut the index would count cached KV past the snapshots
    assert any(kv[i] > exact[i] for _, exact, kv in seen for i in exact)
    assert any(v for _, exact, _ in seen for v in exact.values())  # and some hits


def test_swap_preemption_moves_the_state_too(bench: tuple[ModuleType, str]) -> None:
    """Swap on a simulated hybrid: every swapped victim moves its blocks and one
    recurrent state (39.5 MB here) out and back; the same tokens finish as with
    recompute."""
    from kvpage.sim.simulator import build_setup as setup

    b, model = bench
    reqs = [TraceRequest(i, 0.0, 1500, 200, (10 * i, 10 * i + 1, 10 * i + 2)) for i in range(8)]
    kw = dict(num_blocks=400, swap_space_bytes=64 << 30)  # 399 x 16 tokens: preempts
    rec = simulate(reqs, b.config(model, 16, "snapshots", **kw))
    swp = simulate(reqs, b.config(model, 16, "snapshots", preemption_mode="swap", **kw))
    spec = setup(b.config(model, 16, "snapshots", **kw))[0]
    assert rec.preemptions > 0 and swp.finished == rec.finished == 8
    sw = swp.extra["swap"]
    assert sw["swap_outs"] > 0 and sw["swap_ins"] == sw["swap_outs"]
    state_b = spec.state_bytes_per_sequence
    moved = sw["bytes_out"] + sw["bytes_in"] - 2 * sw["swap_outs"] * state_b
    assert moved > 0 and moved % spec.bytes_per_block == 0


def _evicting_trace() -> list[TraceRequest]:
    """Request 0, three other prompts that push its snapshot out of 3 snapshot slots,
    then request 0's prompt again (10 s apart: one at a time)."""
    reqs = [TraceRequest(0, 0.0, 1024 + 300, 4, (0, 1, 100))]
    reqs += [TraceRequest(i, 10.0 * i, 1024 + 300, 4, (10 * i, 10 * i + 1, 10 * i + 2)) for i in (1, 2, 3)]  # fmt: skip
    return reqs + [TraceRequest(4, 50.0, 1024 + 300, 4, (0, 1, 100))]


def test_host_snapshot_rows_serve_an_evicted_snapshot_and_cost_the_copies(
    bench: tuple[ModuleType, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a host KV tier the simulated pool has the engine's host snapshot rows
    (floor(host bytes x share) // state bytes, kvpage.capacity.host_snapshot_rows): the
    snapshot evicted from the 3 device slots is found on the host when its prompt comes
    back (hit 1,312 tokens vs 0 without), counted as a host hit; each copy costs its
    state bytes at the host link (host <-> device) or 2x at the device bandwidth, and
    that time is in the step times."""
    import kvpage.sim.simulator as simulator
    from kvpage.capacity import host_snapshot_rows
    from kvpage.sim.instance import SimInstance
    from kvpage.sim.tiers import TRANSFER_PRESETS, StateCopyMeter

    b, model = bench
    kw = dict(num_blocks=800, state_snapshot_share=0.3)
    off = simulate(_evicting_trace(), b.config(model, 16, "snapshots", **kw))
    host_b = 4 << 30
    cfg = b.config(model, 16, "snapshots", kv_host_tier_bytes=host_b, **kw)
    spec = build_setup(cfg)[0]
    S = spec.state_bytes_per_sequence
    assert snapshot_slots(cfg, spec) == 3
    rows = int(host_b * 0.3) // S
    assert rows == 32 == host_snapshot_rows(host_b, S, 0.3, num_snapshot_slots=3)
    seen: list[SimInstance] = []
    result = simulator.instance_result

    def keep(inst: SimInstance, *a: object) -> object:
        seen.append(inst)
        return result(inst, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(simulator, "instance_result", keep)
    on = simulate(_evicting_trace(), cfg)
    total = 5 * 1324
    assert off.prefix_hit_pct == 0.0
    assert on.prefix_hit_pct == pytest.approx(100 * 1312 / total)  # request 4's prompt boundary
    st_off, st = off.extra["state"], on.extra["state"]
    assert st_off["host_snapshot_rows"] == 0 and st_off["snapshot_hits_host"] == 0
    assert st["host_snapshot_rows"] == 32 and st["host_snapshot_bytes"] == 32 * S
    assert st["snapshot_hits_host"] == 1 and st["snapshot_hits_device"] == 0
    assert st["host_snapshots_stored"] == 2  # requests 0 and 1's snapshots went to the host
    cp = st["copies"]
    host_bw = TRANSFER_PRESETS[cfg.transfer_preset].host_bandwidth
    dev_bw = 3.35e12 * 0.8  # H100 datasheet x bandwidth_efficiency
    assert cp["counts"] == {"device": 5, "host_in": 1, "host_out": 2}
    # 4 prompt snapshots taken + 1 restore on the device; 1 promotion, 2 demotions
    assert cp["seconds"]["host_in"] == pytest.approx(S / host_bw)
    assert cp["seconds"]["host_out"] == pytest.approx(2 * S / host_bw)
    assert cp["seconds"]["device"] == pytest.approx(5 * 2 * S / dev_bw)
    assert cp["copy_time_share_pct"] == pytest.approx(100 * cp["total_s"] / seen[0].step_s)
    # the copies' seconds are in the step times: the same run without charging them
    monkeypatch.setattr(StateCopyMeter, "step_seconds", lambda self: 0.0)
    simulate(_evicting_trace(), cfg)
    charged, free = seen
    assert charged.steps == free.steps
    assert charged.step_s - free.step_s == pytest.approx(cp["total_s"], rel=1e-9)
    # the attention-only bound has no state pool, host tier or not
    bound = simulate(_evicting_trace(), b.config(model, 16, "free", kv_host_tier_bytes=host_b, **kw))  # fmt: skip
    assert "state" not in bound.extra and bound.prefix_hit_pct >= on.prefix_hit_pct


def test_state_copy_meter_kinds_and_swap_copies() -> None:
    """StateCopyMeter: a pair with a slot >= num_slots is a host row (direction by which
    side); seconds are taken once by step_seconds; the NullStateMover hands the copies
    swap preemption runs early to the meter."""
    from kvpage.sim.tiers import NullStateMover, StateCopyMeter

    m = StateCopyMeter(100, 4, device_bandwidth=1000.0, host_bandwidth=10.0)
    NullStateMover(100, m).copy_slots([(0, 3), (3, 4), (5, 1)])
    assert m.counts == {"device": 1, "host_in": 1, "host_out": 1}
    assert m.step_seconds() == pytest.approx(0.2 + 10.0 + 10.0)
    assert m.step_seconds() == 0.0 and m.total_s == pytest.approx(20.2)
    NullStateMover(100).copy_slots([(0, 1)])  # no meter: nothing counted
    assert m.counts["device"] == 1
