"""Admission and degradation logic without a server (clock driven by the test)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvpage.server.admission import KVBudget, TenantLimiter, TokenBucket
from kvpage.server.config import AdmissionConfig, DegradationConfig, TenantLimit
from kvpage.server.degradation import DegradationController, p99
from kvpage.server.generation import _find_stop, _safe_end


def test_token_bucket_take_refill_retry_after():
    b = TokenBucket(rate=10, burst=100, now=0.0)
    assert b.try_take(60, 0.0).ok
    d = b.try_take(60, 0.0)  # 40 left, needs 20 more = 2 s at 10 tokens/s
    assert not d.ok and d.reason == "tenant_rate_limit" and d.retry_after_s == 2
    assert b.tokens == 40  # a refusal takes nothing
    assert not b.try_take(60, 1.9).ok
    assert b.try_take(60, 2.0).ok
    assert b.tokens == pytest.approx(0.0)
    assert b.try_take(10, 1000.0).ok and b.tokens == 90  # refill capped at burst
    d = b.try_take(101, 1000.0)
    assert not d.ok and d.reason == "cost_exceeds_burst" and d.retry_after_s is None
    b.refund(500, 1000.0)
    assert b.tokens == 100


def test_tenant_limiter_is_per_tenant():
    cfg = AdmissionConfig(
        default_limit=TenantLimit(rate=1, burst=50), tenants={"vip": TenantLimit(rate=1, burst=500)}
    )
    lim = TenantLimiter(cfg)
    assert lim.try_take("a", 50, 0.0).ok
    assert not lim.try_take("a", 1, 0.0).ok
    assert lim.try_take("b", 50, 0.0).ok  # another tenant has its own bucket
    assert lim.try_take("vip", 400, 0.0).ok
    assert TenantLimiter(AdmissionConfig()).try_take("x", 10**9, 0.0).ok  # unlimited


def _budget(**kw):
    cfg = AdmissionConfig(kv_high_water=0.5, long_prompt_tokens=64, **kw)
    return KVBudget(num_blocks=20, block_size=16, config=cfg)


def test_kv_budget_long_requests_refused_short_ones_flow():
    async def run():
        kv = _budget(kv_pressure_action="reject")
        assert kv.blocks_for(100, 60, 1) == 10 and kv.blocks_for(100, 60, 2) == 20
        assert (await kv.acquire(100, 12)).ok  # an empty server admits anything
        d = await kv.acquire(64, 5)  # long: 17/20 > 0.5
        assert not d.ok and d.reason == "kv_pressure" and d.retry_after_s == 1
        assert (await kv.acquire(10, 5)).ok  # short requests still flow
        assert kv.reserved_blocks == 17
        kv.release(12)
        kv.release(5)
        assert (await kv.acquire(64, 5)).ok  # 5/20 <= 0.5
        kv.release(5)
        assert kv.reserved_blocks == 0

    asyncio.run(run())


def test_kv_budget_queue_admits_after_release_and_times_out():
    async def run():
        kv = _budget(kv_pressure_action="queue", queue_timeout_s=5.0)
        assert (await kv.acquire(100, 8)).ok
        waiter = asyncio.ensure_future(kv.acquire(80, 6))  # 14/20 > 0.5: waits
        await asyncio.sleep(0.01)
        assert not waiter.done() and kv.num_queued == 1
        kv.release(8)
        assert (await asyncio.wait_for(waiter, 1.0)).ok
        assert kv.reserved_blocks == 6 and kv.num_queued == 0
        kv2 = _budget(kv_pressure_action="queue", queue_timeout_s=0.05)
        assert (await kv2.acquire(100, 8)).ok
        d = await kv2.acquire(80, 6)
        assert not d.ok and d.reason == "kv_pressure" and kv2.reserved_blocks == 8
        # a cancelled waiter reserves nothing and leaves the queue
        kv3 = _budget(kv_pressure_action="queue", queue_timeout_s=5.0)
        assert (await kv3.acquire(100, 8)).ok
        w = asyncio.ensure_future(kv3.acquire(80, 6))
        await asyncio.sleep(0.01)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert kv3.num_queued == 0 and kv3.reserved_blocks == 8
        kv4 = _budget(kv_pressure_action="queue", max_queued=0)
        assert (await kv4.acquire(100, 8)).ok
        assert (await kv4.acquire(80, 6)).reason == "queue_full"

    asyncio.run(run())


def test_p99_nearest_rank():
    assert p99([]) == 0.0
    assert p99([3.0]) == 3.0
    # linear interpolation (kvpage.stats.summarize): rank 0.99 * (n - 1)
    assert p99([float(i) for i in range(1, 101)]) == pytest.approx(99.01)
    assert p99([float(i) for i in range(1, 201)]) == pytest.approx(198.01)


def _ctl(**kw):
    cfg = DegradationConfig(
        window_s=10,
        enter_alloc_failures_per_s=0.5,  # 5 in the 10 s window
        exit_alloc_failures_per_s=0.0,
        enter_p99_ttft_s=2.0,
        exit_p99_ttft_s=0.5,
        min_dwell_s=3.0,
        max_tokens_cap=32,
        **kw,
    )
    changes = []
    return DegradationController(cfg, 0.0, on_change=lambda d, r: changes.append((d, r))), changes


def test_degradation_enters_on_allocation_failures_with_hysteresis(caplog):
    ctl, changes = _ctl()
    with caplog.at_level(logging.WARNING, logger="kvpage.server.degradation"):
        ctl.record_alloc_failures_total(0, 0.0)
        ctl.record_alloc_failures_total(4, 1.0)
        assert not ctl.evaluate(1.0) and not ctl.degraded  # 4 < 5
        ctl.record_alloc_failures_total(6, 2.0)
        assert ctl.evaluate(2.0) and ctl.degraded
        assert ctl.cap_max_tokens(100) == 32 and ctl.cap_max_tokens(10) == 10
        # failures stop but the window still holds them: stays degraded
        ctl.record_alloc_failures_total(6, 4.0)
        assert not ctl.evaluate(4.0) and ctl.degraded
        # window has slid past the failures (baseline 6 at t=4, now 6): calm and dwell passed
        ctl.record_alloc_failures_total(6, 14.5)
        assert ctl.evaluate(14.5) and not ctl.degraded
    assert [d for d, _ in changes] == [True, False] and ctl.transitions == 2
    msgs = [r.getMessage() for r in caplog.records]
    assert any("entering degraded mode" in m and "allocation failures" in m for m in msgs)
    assert any("back to normal" in m for m in msgs)
    assert ctl.cap_max_tokens(100) == 100


def test_degradation_ttft_thresholds_do_not_flap():
    ctl, changes = _ctl()
    ctl.record_ttft(2.5, 0.0)
    assert ctl.evaluate(0.0) and ctl.degraded
    # p99 between exit (0.5) and enter (2.0): no change in either direction
    for t in range(1, 12):
        ctl.record_ttft(1.0, float(t))
        ctl.evaluate(float(t))
    assert ctl.degraded and len(changes) == 1
    # calm TTFTs, but only once the 2.5 s and 1.0 s samples left the window
    for t in range(12, 30):
        ctl.record_ttft(0.1, float(t))
        ctl.evaluate(float(t))
    assert not ctl.degraded and len(changes) == 2
    assert ctl.last_signals.p99_ttft_s == pytest.approx(0.1)


def test_degradation_min_dwell_and_disabled():
    ctl, changes = _ctl()
    ctl.record_ttft(5.0, 0.0)
    ctl.evaluate(0.0)
    ctl2, _ = _ctl(enabled=False)
    ctl2.record_ttft(50.0, 0.0)
    assert not ctl2.evaluate(0.0) and not ctl2.degraded
    # a fresh controller with a short window: calm at once, but the dwell time holds it
    cfg = ctl.config.model_copy(update={"window_s": 0.5})
    c3 = DegradationController(cfg, 0.0)
    c3.record_ttft(5.0, 0.0)
    c3.evaluate(0.0)
    assert c3.degraded
    assert not c3.evaluate(1.0) and c3.degraded  # calm since 0.5 s, dwell 3 s not reached
    assert c3.evaluate(3.0) and not c3.degraded


def test_stop_string_helpers():
    assert _find_stop("hello world", ["wor", "lo"], "") == (3, "lo")
    assert _find_stop("hello world", ["xyz"], "") is None
    assert _find_stop("abcdef", ["cd"], "abc") == (2, "cd")  # match straddling old/new text
    assert _find_stop("abcdef", ["b"], "", floor=3) is None  # min_tokens: ends too early
    assert _find_stop("abcdef", ["cd"], "", floor=3) == (2, "cd")  # ends after the floor
    assert _safe_end("hello", 2) == 3
    assert _safe_end("ab\ufffd", 0) == 2
    assert _safe_end("a", 5) == 0


def test_degradation_config_enforces_hysteresis():
    with pytest.raises(ValueError, match="exit_p99_ttft_s"):
        DegradationConfig(enter_p99_ttft_s=1.0, exit_p99_ttft_s=2.0)
    with pytest.raises(ValueError, match="exit_alloc_failures_per_s"):
        DegradationConfig(enter_alloc_failures_per_s=3, exit_alloc_failures_per_s=3)
    with pytest.raises(ValueError, match=r"enter_alloc_failures_per_s \(a rate"):
        DegradationConfig.model_validate({"enter_alloc_failures": 16})  # the old count
    cfg = DegradationConfig()
    with pytest.raises(ValueError):
        cfg.enter_p99_ttft_s = 0.1  # below the exit threshold: refused, config unchanged
    assert cfg.enter_p99_ttft_s == 5.0
