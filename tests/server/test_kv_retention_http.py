"""The ``kv_retention`` request field and the ``kvpage_cache`` response extension over
HTTP (real uvicorn, the official ``openai`` client and httpx): validation with the
server's limits, the per-request explanation a tenant sees (never another tenant's
key), the operator's aggregate counter and the retained-blocks gauge."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from srv_helpers import metrics_dict

pytestmark = pytest.mark.xdist_group("server_kv_retention")

MODEL = "stories260K"
KEYS = {"a": "sk-tenant-a-" + "3" * 24, "b": "sk-tenant-b-" + "4" * 24}
PROMPT = [(t * 11) % 500 + 5 for t in range(80)]  # 80 tokens: 4 cacheable blocks of 16
PIN = {"ranges": [{"start": 0, "end": 64, "priority": 2, "ttl_s": 600}]}


@pytest.fixture(scope="module")
def server(serve):
    return serve(
        security={"api_keys": list(KEYS.values())},
        admission={"kv_retention_max_priority": 2, "kv_retention_max_ttl_s": 900},
    )


def _post(server, tenant, body, path="/v1/completions"):
    return httpx.post(
        server.base_url + path,
        json={"model": MODEL, "max_tokens": 2, "temperature": 0, **body},
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        timeout=60,
    )


def _metrics(server):
    r = httpx.get(
        server.base_url + "/metrics", headers={"Authorization": f"Bearer {KEYS['a']}"}, timeout=30
    )
    return metrics_dict(r.text)


def test_explanations_per_tenant_and_operator_counter(server):
    r = _post(server, "a", {"prompt": PROMPT, "kv_retention": PIN})
    assert r.status_code == 200, r.text
    kc = r.json()["kvpage_cache"]
    assert kc["cached_tokens_by_tier"] == {"device": 0}
    assert kc["prompts"][0]["miss"]["reason"] == "never_seen"
    # the official client sees the extension field as well
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS["a"], max_retries=0)
    got = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert got.usage is not None and got.usage.prompt_tokens_details.cached_tokens == 64
    ext = got.model_extra["kvpage_cache"]
    assert ext["cached_tokens_by_tier"] == {"device": 64}
    assert ext["prompts"][0]["miss"] == {
        "reason": "full_hit",
        "num_missed_tokens": 16,
        "first_miss_block": None,
    }
    # tenant b: the same tokens are held under a's key; b is told only "never_seen"
    r = _post(server, "b", {"prompt": PROMPT})
    kc = r.json()["kvpage_cache"]
    assert kc["cached_tokens_by_tier"] == {"device": 0}
    assert kc["prompts"][0]["miss"]["reason"] == "never_seen"
    assert "different_cache_key" not in r.text
    m = _metrics(server)
    # the operator's aggregate says what happened
    assert m['kvpage:cache_miss_reasons_total{reason="different_cache_key"}'] >= 1
    assert m['kvpage:cache_miss_reasons_total{reason="full_hit"}'] >= 1
    assert m["kvpage:kv_retained_blocks"] >= 4


def test_streamed_usage_chunk_carries_the_extension(server):
    r = _post(
        server,
        "a",
        {"prompt": PROMPT[:40], "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    last = chunks[-1]
    assert last["choices"] == [] and "usage" in last
    assert last["kvpage_cache"]["prompts"][0]["miss"]["reason"] in ("never_seen", "full_hit")


@pytest.mark.parametrize(
    ("field", "match"),
    [
        (
            {"ranges": [{"start": 0, "priority": 3, "ttl_s": 10}]},
            "ranges[0].priority: expected <= 2",
        ),
        ({"ranges": [{"start": 0, "priority": 2}]}, "ranges[0].ttl_s: expected a number <= 900"),
        ({"decode_priority": 2, "decode_ttl_s": 5000}, "decode_ttl_s: expected a number <= 900"),
        ({"ranges": [{"start": 5, "end": 2}]}, "ranges[0].end: expected None or an int > start"),
        ({"ranges": [{"begin": 0}]}, "ranges[0]: expected keys among"),
        ({"pin": True}, "kv_retention: expected keys among"),
        ([1, 2], "kv_retention"),
    ],
)
def test_bad_kv_retention_is_refused_by_name(server, field, match):
    before = _metrics(server)["kvpage:prefix_cache_queries_total"]
    r = _post(server, "a", {"prompt": PROMPT, "kv_retention": field})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_retention" and match in err["message"]
    assert _metrics(server)["kvpage:prefix_cache_queries_total"] == before  # nothing ran


def test_chat_accepts_kv_retention(server):
    r = _post(
        server,
        "a",
        {"messages": [{"role": "system", "content": "You tell stories."}], "kv_retention": PIN},
        path="/v1/chat/completions",
    )
    assert r.status_code == 200, r.text
    assert r.json()["kvpage_cache"]["prompts"][0]["miss"]["reason"] in ("never_seen", "full_hit")


def test_retention_flags_reach_the_config(capsys):
    from kvpage.cli import main

    argv = ["serve", "--kv-retention-max-share", "0.3", "--kv-retention-max-priority", "1"]
    assert (
        main([*argv, "--kv-retention-max-ttl-s", "60", "--dump-config", "--dump-format", "json"])
        == 0
    )
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["engine"]["kv_retention_max_share"] == 0.3
    assert cfg["admission"]["kv_retention_max_priority"] == 1
    assert cfg["admission"]["kv_retention_max_ttl_s"] == 60.0
    assert main(["serve", "--kv-retention-max-share", "1.5", "--dump-config"]) != 0
    assert "kv_retention_max_share: expected a number in [0, 1], got 1.5" in capsys.readouterr().err
