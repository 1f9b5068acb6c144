"""A request with several prompts is admitted (rate-limited, charged) as ONE unit.

Regression: the cost was checked prompt by prompt, so a 4-prompt request above the
burst got ``tenant_rate_limit`` with a useless Retry-After, kept the first prompts'
charge and (streaming) ran them on the engine, counted as client disconnects.
"""

from __future__ import annotations

import httpx
import pytest
from srv_helpers import metrics_dict, wait_idle

pytestmark = pytest.mark.xdist_group("server_multi_admission")

BURST = 400.0


@pytest.fixture(scope="module")
def server(serve):
    return serve(admission={"tenants": {"t4": {"rate": 1.0, "burst": BURST}}})


def _post(server, body):
    return httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "stories260K", "temperature": 0, "user": "t4", **body},
        timeout=60,
    )


def _tokens(server) -> float:
    limiter = server.app.state.serving.limiter
    limiter.try_take("t4", 0, server.app.state.serving.clock())  # refill up to now
    return limiter._buckets["t4"].tokens


@pytest.mark.parametrize("stream", [False, True])
def test_multi_prompt_above_burst_is_refused_whole(server, stream):
    before = wait_idle(server.base_url)
    assert _tokens(server) == BURST
    body = {"prompt": ["a", "b", "c", "d"], "max_tokens": 100, "stream": stream}
    r = _post(server, body)  # cost 4 * (2 + 100) = 408 > burst 400
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "cost_exceeds_burst", err
    assert "408" in err["message"]
    assert "Retry-After" not in r.headers
    assert _tokens(server) == BURST  # nothing charged
    after = wait_idle(server.base_url)
    for name in ("kvpage:prompt_tokens_total", "kvpage:generation_tokens_total"):
        assert after[name] == before[name], name  # nothing ran on the engine
    cancels = {k: v for k, v in after.items() if k.startswith("kvpage:request_cancellations")}
    assert not any(cancels.values()), cancels


def test_multi_prompt_charged_once_and_refused_as_one(server):
    wait_idle(server.base_url)
    r = _post(server, {"prompt": ["a", "b", "c"], "max_tokens": 30})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    left = _tokens(server)
    assert BURST - 3 * 32 <= left < BURST - 3 * 32 + 30  # charged 96, refilled 1/s
    # 3 * 102 = 306 > what is left (~304): refused with a Retry-After, nothing charged
    r2 = _post(server, {"prompt": ["a", "b", "c"], "max_tokens": 100, "stream": True})
    assert r2.status_code == 429, r2.text
    assert r2.json()["error"]["code"] == "tenant_rate_limit"
    assert "306" in r2.json()["error"]["message"]
    assert int(r2.headers["Retry-After"]) >= 1
    assert _tokens(server) >= left
    m = metrics_dict(httpx.get(server.base_url + "/metrics").text)
    assert m['kvpage:server_requests_rejected_total{reason="tenant_rate_limit"}'] == 1


MARK = 77  # the engine (patched) refuses any prompt starting with this token id


@pytest.fixture
def refusing_engine(server):
    from kvpage.errors import RequestRejected

    loop = server.app.state.serving.loop
    orig = loop.add

    async def add(request_id, prompt, params, **kw):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        if ids[0] == MARK:
            raise RequestRejected(
                "seed: expected a prompt the test engine takes, got the marked one",
                reason="invalid_sampling_params",
                request_id=request_id,
            )
        return await orig(request_id, prompt, params, **kw)

    loop.add = add
    yield
    loop.add = orig


@pytest.mark.parametrize("stream", [True, False])
def test_one_prompt_refused_by_the_engine_refunds_all_and_counts_siblings(
    server, refusing_engine, stream
):
    before = wait_idle(server.base_url)
    full = _tokens(server)
    body = {"prompt": [[5, 6, 7], [8, 9, 10], [MARK, 12, 13]], "max_tokens": 60}
    r = _post(server, {**body, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "engine_rejected"
    assert _tokens(server) >= full  # the whole charge refunded
    after = wait_idle(server.base_url)
    key = 'kvpage:request_cancellations_total{cause="%s"}'
    gone = after.get(key % "client_disconnect", 0) - before.get(key % "client_disconnect", 0)
    assert gone == 0  # the client never left
    sib = after.get(key % "sibling_failed", 0) - before.get(key % "sibling_failed", 0)
    if stream:  # prompts 1 and 2 were started (first output) before 3 was refused
        assert sib == 2
    else:  # concurrent: each sibling is aborted unless it already finished
        assert 0 <= sib <= 2
