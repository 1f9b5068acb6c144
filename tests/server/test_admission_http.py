"""Admission over HTTP: tenant token buckets, KV-pressure 429/queue, degradation."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from srv_helpers import metrics_dict, wait_idle

pytestmark = pytest.mark.xdist_group("server_admission")

LONG = list(range(10, 110))  # a 100-token prompt (>= long_prompt_tokens)


@pytest.fixture(scope="module")
def server(serve):
    return serve(
        admission={
            "tenants": {
                "limited-key": {"rate": 1.0, "burst": 100.0},
                "bob": {"rate": 1.0, "burst": 30.0},
            },
            "kv_high_water": 0.5,
            "long_prompt_tokens": 64,
            "kv_pressure_action": "reject",
            "retry_after_s": 3,
        },
        degradation={"eval_interval_s": 0.05, "window_s": 30.0, "min_dwell_s": 0.0},
    )


def _post(server, body, key="k", timeout=60):
    return httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "stories260K", "temperature": 0, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def _metrics(server):
    return metrics_dict(httpx.get(server.base_url + "/metrics").text)


def test_tenant_token_bucket_429_with_retry_after(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="limited-key", max_retries=0)
    r = c.completions.create(model="stories260K", prompt="Once", max_tokens=60, temperature=0)
    assert r.usage.completion_tokens == 60  # cost 2 + 60 <= burst 100
    with pytest.raises(openai.RateLimitError) as ei:
        c.completions.create(model="stories260K", prompt="Once", max_tokens=60)
    resp = ei.value.response
    # 62 of the 100-token burst are spent, refilling at 1 token/s: a wait of seconds
    assert resp.status_code == 429 and 1 <= int(resp.headers["Retry-After"]) <= 62
    assert resp.json()["error"]["type"] == "rate_limit_exceeded"
    assert resp.json()["error"]["code"] == "tenant_rate_limit"
    # another tenant is not affected; the `user` field is the tenant when no key limit applies
    assert _post(server, {"prompt": "Once", "max_tokens": 4}, key="other-key").status_code == 200
    # a request costing more than the burst can never pass: 429 without Retry-After
    r2 = _post(server, {"prompt": "Once", "max_tokens": 200}, key="limited-key")
    assert r2.status_code == 429 and "Retry-After" not in r2.headers
    assert r2.json()["error"]["code"] == "cost_exceeds_burst"
    # without an API key the `user` field names the tenant
    anon = {"model": "stories260K", "prompt": "Once", "max_tokens": 20, "user": "bob"}
    url = server.base_url + "/v1/completions"
    assert httpx.post(url, json=anon, timeout=60).status_code == 200  # cost 22 <= 30
    r3 = httpx.post(url, json=anon, timeout=60)
    assert r3.status_code == 429 and r3.json()["error"]["code"] == "tenant_rate_limit"
    assert httpx.post(url, json={**anon, "user": "carol"}, timeout=60).status_code == 200
    m = _metrics(server)
    assert m['kvpage:server_requests_rejected_total{reason="tenant_rate_limit"}'] == 2
    assert m['kvpage:server_requests_rejected_total{reason="cost_exceeds_burst"}'] == 1


def _hold_long_stream(server, client):
    body = {
        "model": "stories260K",
        "prompt": LONG,
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    cm = client.stream("POST", server.base_url + "/v1/completions", json=body)
    r = cm.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()  # keep it referenced: closing it would close the stream
    next(line for line in lines if line.startswith("data: "))
    cm.lines = lines
    return cm


def test_kv_pressure_refuses_long_requests_short_ones_flow(server):
    wait_idle(server.base_url)
    with httpx.Client(timeout=60) as c:
        cm = _hold_long_stream(server, c)  # reserves ceil(400/16) = 25 of 64 blocks
        try:
            m = _metrics(server)
            assert m['kvpage:kv_memory_utilization{kind="projected"}'] == pytest.approx(25 / 64)
            r = _post(server, {"prompt": LONG[:80], "max_tokens": 100})  # +12 -> 0.58 > 0.5
            assert r.status_code == 429 and r.headers["Retry-After"] == "3"
            assert r.json()["error"]["code"] == "kv_pressure"
            short = _post(server, {"prompt": "Once upon", "max_tokens": 8})
            assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 8
        finally:
            cm.__exit__(None, None, None)  # disconnect: aborts and frees the reservation
    wait_idle(server.base_url)
    m = _metrics(server)
    assert m['kvpage:kv_memory_utilization{kind="projected"}'] == 0.0
    assert _post(server, {"prompt": LONG[:80], "max_tokens": 4}).status_code == 200


def test_kv_pressure_queue_admits_when_budget_frees(server):
    state = server.app.state.serving
    state.config.admission.kv_pressure_action = "queue"
    state.config.admission.queue_timeout_s = 30.0
    try:
        wait_idle(server.base_url)
        with httpx.Client(timeout=60) as c, concurrent.futures.ThreadPoolExecutor(1) as ex:
            cm = _hold_long_stream(server, c)
            try:
                fut = ex.submit(_post, server, {"prompt": LONG[:80], "max_tokens": 100})
                deadline = time.monotonic() + 10
                while _metrics(server)['kvpage:server_queue_length{queue="kv_pressure"}'] != 1:
                    assert time.monotonic() < deadline, "long request did not queue"
                    time.sleep(0.02)
                assert not fut.done()
            finally:
                cm.__exit__(None, None, None)
            r = fut.result(timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 100
    finally:
        state.config.admission.kv_pressure_action = "reject"
    wait_idle(server.base_url)


def test_degradation_caps_max_tokens_with_hysteresis(server):
    state = server.app.state.serving
    deg = state.config.degradation
    deg.exit_p99_ttft_s = 5e-7  # exit <= enter is enforced (hysteresis), so lower it first
    deg.enter_p99_ttft_s = 1e-6  # any request is "slow": enter degraded mode
    deg.max_tokens_cap = 8
    try:
        assert _post(server, {"prompt": "Once", "max_tokens": 4}).status_code == 200
        deadline = time.monotonic() + 10
        while _metrics(server)["kvpage:degraded"] != 1.0:
            assert time.monotonic() < deadline, "did not enter degraded mode"
            time.sleep(0.02)
        r = _post(server, {"prompt": "Once", "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        # the cut is visible in the response, not only in a metric
        assert r.headers["X-KVPage-Max-Tokens-Capped"] == "8"
        assert r.json()["kvpage_max_tokens_capped"] == {"requested": 50, "cap": 8}
        assert r.json()["choices"][0]["finish_reason"] == "length"
        # long-context requests pass one at a time through their own queue
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            futs = [
                ex.submit(_post, server, {"prompt": LONG[:70], "max_tokens": 4}) for _ in range(2)
            ]
            assert [f.result(timeout=60).status_code for f in futs] == [200, 200]
        m = _metrics(server)
        assert m['kvpage:degradation_transitions_total{to="degraded"}'] == 1
        assert m["kvpage:max_tokens_capped_total"] >= 1
        # raise the thresholds: both signals calm -> back to normal (dwell 0)
        deg.enter_p99_ttft_s = 100.0
        deg.exit_p99_ttft_s = 100.0
        deadline = time.monotonic() + 10
        while _metrics(server)["kvpage:degraded"] != 0.0:
            assert time.monotonic() < deadline, "did not leave degraded mode"
            time.sleep(0.02)
        r = _post(server, {"prompt": "Once", "max_tokens": 20, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 20
        assert "kvpage_max_tokens_capped" not in r.json()
        assert "X-KVPage-Max-Tokens-Capped" not in r.headers
        m = _metrics(server)
        assert m['kvpage:degradation_transitions_total{to="normal"}'] == 1
    finally:
        deg.exit_p99_ttft_s = 2.0
        deg.enter_p99_ttft_s = 5.0
    wait_idle(server.base_url)
