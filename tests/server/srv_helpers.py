"""Helpers shared by the server tests (imported by conftest and the test modules)."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx

#: engine knobs every test server shares (small pool so pressure is cheap to create)
ENGINE = {"num_blocks": 65, "block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 512}


def metrics_dict(text: str) -> dict[str, float]:
    """Parse Prometheus text into ``{"name{labels}": value}`` (samples only).

    The ``model_name`` label (one served model per test server) is left out of the keys,
    so ``m["kvpage:kv_cache_usage_perc"]`` names the engine gauge;
    test_vllm_metrics.py checks the label itself.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{")
            out[name.replace("{}", "")] = float(value)
    return out


def wait_idle(base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until the engine holds no block and runs/waits nothing (bounded)."""
    deadline = time.monotonic() + timeout_s
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        m = metrics_dict(httpx.get(base_url + "/metrics", timeout=10).text)
        if (
            m["kvpage:kv_cache_usage_perc"] == 0.0
            and m["kvpage:num_requests_running"] == 0.0
            and m["kvpage:num_requests_waiting"] == 0.0
        ):
            return m
        time.sleep(0.05)
    raise AssertionError(f"server did not become idle within {timeout_s}s: {m}")


def wait_idle_state(state: Any, timeout_s: float = 30.0) -> None:
    """Like :func:`wait_idle`, reading the engine snapshot of a ServingState directly
    (for servers whose /metrics needs a key or lives on another listener)."""
    deadline = time.monotonic() + timeout_s
    snap: Any = {}
    while time.monotonic() < deadline:
        snap = state.loop.metrics_snapshot
        if (
            snap["kvpage:kv_cache_usage_perc"] == 0.0
            and snap["kvpage:num_requests_running"] == 0.0
            and snap["kvpage:num_requests_waiting"] == 0.0
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"server did not become idle within {timeout_s}s: {snap}")


def assert_engine_clean(engine: Any) -> None:
    """All blocks free (null block excluded), nothing running or waiting, integrity ok."""
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == engine.cache_spec.num_blocks - 1
    assert kv.usage == 0.0
    assert engine.scheduler.num_running == 0
    assert engine.scheduler.num_waiting == 0
    assert not engine.has_unfinished_requests()
    kv.check_integrity()
