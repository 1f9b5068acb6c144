"""Cost model, contiguous allocators, eviction study and the trace-driven simulator."""

from __future__ import annotations

import pytest

from kvpage.errors import AllocationError, SpecError
from kvpage.sim.contiguous import ContiguousAllocator
from kvpage.sim.costmodel import GPU_PRESETS, StepCostModel, get_gpu
from kvpage.sim.eviction import EVICTION_POLICIES, simulate_eviction
from kvpage.sim.profile import prefix_stats
from kvpage.sim.simulator import POLICIES, SimConfig, simulate
from kvpage.workload.traces import Trace, TraceRequest, load_trace


# ---- cost model -------------------------------------------------------------------------
def _cost(**kw) -> StepCostModel:
    base = dict(
        num_parameters=8_000_000_000,
        weight_bytes=16_000_000_000,
        num_layers=32,
        num_q_heads=32,
        head_dim=128,
        kv_bytes_per_token=131072,
        gpu=get_gpu("H100-80GB"),
        step_overhead_s=0.0,
    )
    base.update(kw)
    return StepCostModel(**base)  # type: ignore[arg-type]


def test_cost_model_rooflines_by_hand():
    c = _cost()
    # one decode token at context 999: memory bound: (16e9 + 1000*131072) / (3.35e12 * 0.8)
    t = c.step_time([1], [999])
    assert t == pytest.approx((16e9 + 1000 * 131072) / (3.35e12 * 0.8))
    # a 4096-token prefill: compute bound
    f = 2 * 8e9 * 4096 + 4 * 32 * 32 * 128 * 4096 * (4097 / 2)
    assert c.flops([4096], [0]) == pytest.approx(f)
    assert c.step_time([4096], [0]) == pytest.approx(f / (989e12 * 0.6))
    assert c.step_time([], []) == 0.0
    assert _cost(step_overhead_s=0.002).step_time([1], [0]) == pytest.approx(
        c.step_time([1], [0]) + 0.002
    )
    # decode on a faster-memory GPU is faster; same FLOPs preset H100/H200
    assert _cost(gpu=get_gpu("h200")).step_time([1], [999]) < t
    with pytest.raises(SpecError):
        get_gpu("V100")
    with pytest.raises(SpecError):
        _cost(flops_efficiency=0.0)
    assert set(GPU_PRESETS) == {"A100-80GB", "H100-80GB", "H200", "L4"}


# ---- contiguous allocator ---------------------------------------------------------------
def test_contiguous_first_fit_and_merge():
    final = {"a": 30, "b": 50, "c": 30, "d": 60}
    al = ContiguousAllocator(100, "oracle", 64, final.__getitem__)
    assert al.allocate("a", [0] * 10, 10) is not None  # [0, 30)
    assert al.allocate("b", [0] * 10, 10) is not None  # [30, 80)
    assert al.allocate("c", [0] * 10, 10) is None  # 20 free: external fragmentation
    assert al.stats.allocation_failures == 1 and al.reserved_slots == 80
    assert al.allocate("a", [0] * 11, 20) is not None  # within the reservation
    assert al.allocate("a", [0] * 31, 1) is None  # beyond it
    al.free("a")
    al.check_integrity()
    assert al.allocate("c", [0] * 10, 10) is not None and al.block_table("c") == [0]
    al.free("b")
    al.free("c")
    al.check_integrity()
    assert al.allocate("d", [0], 1) is not None  # merged back to one extent
    assert al.live_tokens() == 1 and al.usage == pytest.approx(0.6)
    with pytest.raises(AllocationError):
        al.free("a")


def test_contiguous_reservations():
    final = {"x": 100}
    assert ContiguousAllocator(1000, "max", 512).reservation_for("x", 3) == 512
    assert ContiguousAllocator(1000, "pow2", 512, final.__getitem__).reservation_for("x", 3) == 128
    assert (
        ContiguousAllocator(1000, "oracle", 512, final.__getitem__).reservation_for("x", 3) == 100
    )
    with pytest.raises(SpecError):
        ContiguousAllocator(100, "max", 512)
    with pytest.raises(SpecError):
        ContiguousAllocator(100, "buddy", 50)


# ---- eviction study -----------------------------------------------------------------------
def test_unbounded_cache_reproduces_published_hit_ratio():
    tr = load_trace("mooncake-conv")
    r = simulate_eviction(tr, None, "lru")
    assert r.block_hit_pct == pytest.approx(36.64, abs=0.005)
    assert r.token_hit_pct == pytest.approx(37.36, abs=0.005)
    assert r.evictions == 0


def test_eviction_policies_on_a_sample():
    tr = load_trace("mooncake-conv", limit=1500)
    inf = simulate_eviction(tr, None, "lru").block_hit_pct
    res = {p: simulate_eviction(tr, 400, p).block_hit_pct for p in EVICTION_POLICIES}
    for p, v in res.items():
        assert 0 < v <= inf + 1e-9, p
    assert res["belady"] >= max(v for k, v in res.items() if k != "belady") - 1e-9
    big = simulate_eviction(tr, 10**6, "lru").block_hit_pct
    assert big == pytest.approx(inf)
    assert simulate_eviction(tr, 100, "lru").block_hit_pct < res["lru"]
    with pytest.raises(SpecError):
        simulate_eviction(load_trace("azure-code", limit=5), 10, "lru")


def test_reverse_lru_keeps_chain_heads():
    # cache of 3 blocks; request 1 = chain 1,2,3; request 2 inserts 9 (one eviction);
    # kvpage's order (tail first) evicts block 3, forward LRU evicts block 1 (chain head)
    reqs = [
        TraceRequest(0, 0.0, 1536, 1, (1, 2, 3)),
        TraceRequest(1, 1.0, 512, 1, (9,)),
        TraceRequest(2, 2.0, 1024, 1, (1, 2)),
    ]
    tr = Trace("t", "", "mooncake", reqs)
    assert simulate_eviction(tr, 3, "lru").block_hit_pct == pytest.approx(100 * 2 / 6)
    assert simulate_eviction(tr, 3, "lru-forward").block_hit_pct == 0.0


# ---- simulator -------------------------------------------------------------------------------
def _small(policy: str, **kw) -> SimConfig:
    base = dict(policy=policy, num_blocks=2049, max_model_len=8192, max_num_seqs=64)
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_policies_side_by_side_on_azure_sample():
    tr = load_trace("azure-conv", limit=120)
    res = {p: simulate(tr, _small(p, time_scale=0.05)) for p in POLICIES}
    for p, r in res.items():
        assert r.finished == 120 and not r.rejected, p
        assert 0 < r.effective_kv_util_pct <= 100.0
        assert r.peak_kv_usage_pct <= 100.0
        assert r.ttft_s["p50"] <= r.ttft_s["p99"]
    # the shape of the PagedAttention result
    assert res["contiguous-max"].effective_kv_util_pct < 40
    assert (
        res["contiguous-max"].effective_kv_util_pct
        < res["contiguous-pow2"].effective_kv_util_pct
        < res["contiguous-oracle"].effective_kv_util_pct
        < res["paged"].effective_kv_util_pct
    )
    assert res["paged"].effective_kv_util_pct > 96.3
    # reserving max_model_len caps the batch at slots / max_model_len
    assert res["contiguous-max"].peak_batch <= 2048 * 16 // 8192
    assert res["paged"].peak_batch > res["contiguous-max"].peak_batch
    assert res["paged"].throughput_tok_s > res["contiguous-max"].throughput_tok_s


def test_prefix_caching_on_mooncake_sample():
    tr = load_trace("mooncake-conv", limit=30)
    cfg = dict(num_blocks=8000, max_model_len=131072, max_num_batched_tokens=16384)
    on = simulate(tr, _small("paged-prefix", **cfg))
    off = simulate(tr, _small("paged", **cfg))
    assert on.finished == off.finished == 30
    assert off.prefix_hit_pct == 0.0
    # first-admission hits: the shared block 0 at least, at most the unbounded causal ratio
    causal = prefix_stats(tr)["causal_token_hit_pct"]
    assert 2.0 < on.prefix_hit_pct <= causal + 0.5
    assert on.extra["prefix_hit_pct_incl_readmissions"] >= on.prefix_hit_pct
    assert on.ttft_s["mean"] < off.ttft_s["mean"]


def test_pressure_preempts_and_still_finishes():
    tr = load_trace("azure-conv", limit=60)
    r = simulate(tr, _small("paged", num_blocks=400, time_scale=0.001))
    assert r.finished + sum(r.rejected.values()) == 60
    assert r.preemptions > 0 and r.allocation_failures > 0
    assert r.peak_kv_usage_pct <= 100.0


def test_block_size_changes_utilization():
    tr = load_trace("azure-code", limit=80)
    u = [
        simulate(
            tr, _small("paged", block_size=bs, num_blocks=32768 // bs + 1)
        ).effective_kv_util_pct
        for bs in (1, 16, 256)
    ]
    assert u[0] == pytest.approx(100.0) and u[0] > u[1] > u[2]


def test_bad_config():
    with pytest.raises(SpecError):
        simulate([], SimConfig(policy="magic"))
    with pytest.raises(SpecError):
        simulate([], SimConfig(gpu="V100"))
