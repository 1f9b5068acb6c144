"""A KV pool smaller than one max_model_len sequence: the server serves the pool's limit.

A new user found that with ``--num-blocks 20`` (304 tokens of KV for one sequence, the
model's max_model_len 512) every chat request without ``max_tokens`` failed with
``engine_rejected``: the default max_tokens ("the room left in the context") ignored the
pool. Now the server validates against ``Scheduler.max_servable_len`` and says so.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("server_pool_limit")

M = "stories260K"


@pytest.fixture(scope="module")
def server(serve):
    return serve(engine={"num_blocks": 20, "block_size": 16})


def test_default_max_tokens_fits_the_pool(server):
    served = 19 * 16 + 1  # 19 usable blocks hold prompt + max_tokens - 1 tokens
    models = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == served
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={
            "model": M,
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    u = body["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == served


def test_too_long_for_the_pool_is_refused_up_front(server):
    before = httpx.get(server.base_url + "/metrics").text
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": M, "prompt": "Once upon a time", "max_tokens": 400},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "<= 305" in err["message"]
    after = httpx.get(server.base_url + "/metrics").text
    key = "kvpage:prompt_tokens_total"
    assert [x for x in before.splitlines() if x.startswith(key)] == [
        x for x in after.splitlines() if x.startswith(key)
    ]
