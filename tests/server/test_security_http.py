"""Multi-tenant safety over HTTP (issue 12): API keys, tenant-bound rate limits, bounded
tenant state, /metrics protection, and the limits of the HTTP guard.

Every server is a real uvicorn on a loopback port, driven by the official ``openai``
client and ``httpx``; the ``serve`` fixture checks at teardown that every KV block is
free.
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from srv_helpers import wait_idle_state

from kvpage.errors import SpecError
from kvpage.server.admission import TenantLimiter
from kvpage.server.auth import Authenticator, key_tenant_name, load_keys_file
from kvpage.server.config import AdmissionConfig, SecurityConfig, ServerConfig, TenantLimit
from kvpage.server.security import check_bind

pytestmark = pytest.mark.xdist_group("server_security")

MODEL = "stories260K"
KEY_A1, KEY_A2 = "sk-team-a-2026-11-" + "x" * 24, "sk-team-a-2026-12-" + "y" * 24
KEY_OPS = "sk-ops-" + "z" * 32
KEY_SOLO = "sk-solo-" + "w" * 32


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("keys") / "keys.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "team-a": {"keys": [KEY_A1, KEY_A2], "rate": 1.0, "burst": 60.0},
                    "ops": {"keys": [KEY_OPS], "operator": True},
                }
            }
        )
    )
    os.chmod(p, 0o600)
    return str(p)


@pytest.fixture(scope="module")
def server(serve, keys_file):
    return serve(
        security={"api_keys": [KEY_SOLO], "api_keys_file": keys_file},
        admission={"default_limit": {"rate": 1.0, "burst": 60.0}},
    )


def _post(server, key, body, path="/v1/completions", headers=None, **kw):
    headers = dict(headers or {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(
        server.base_url + path,
        json={"model": MODEL, "temperature": 0, **body},
        headers=headers,
        timeout=60,
        **kw,
    )


def test_missing_wrong_and_rotated_keys(server):
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model=MODEL, prompt="Once", max_tokens=2)
    err = ei.value.response.json()["error"]
    assert ei.value.response.status_code == 401
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert "sk-wrong" not in err["message"]  # a refused key is never echoed
    r = _post(server, None, {"prompt": "Once", "max_tokens": 2})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "got no Authorization header" in r.json()["error"]["message"]
    for hdr, said in (
        ({"Authorization": f"Basic {KEY_SOLO}"}, "got the 'Basic' scheme"),
        ({"Authorization": "Bearer"}, "got no token"),
    ):
        r = httpx.get(server.base_url + "/v1/models", headers=hdr)
        assert r.status_code == 401 and said in r.json()["error"]["message"]
        assert KEY_SOLO not in r.text
    # a key with one character changed, a prefix, and the key plus a suffix all fail
    for k in (KEY_SOLO[:-1] + "v", KEY_SOLO[:-1], KEY_SOLO + "w"):
        assert _post(server, k, {"prompt": "Once", "max_tokens": 2}).status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200  # no key needed
    # both keys of a rotated pair work, as the same tenant
    for k in (KEY_A1, KEY_A2, KEY_SOLO):
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=k, max_retries=0)
        r = c.completions.create(model=MODEL, prompt="Once", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    assert c.models.list().data[0].id == MODEL


def test_rate_limit_cannot_be_escaped(server):
    """team-a has a 60-token burst refilling at 1 token/s: rotating between its two keys,
    changing `user`, or inventing keys does not get more."""
    state = server.app.state.serving
    time.sleep(0.1)
    body = {"prompt": "Once", "max_tokens": 50}  # cost 2 + 50
    # the previous test spent some of team-a's bucket: drain it to a known state
    codes = [_post(server, KEY_A1, body).status_code for _ in range(2)]
    assert codes.count(429) >= 1
    for i, k in enumerate([KEY_A2, KEY_A1, KEY_A2]):
        r = _post(server, k, {**body, "user": f"someone-else-{i}"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_rate_limit"
    for i in range(5):  # unknown keys are refused before admission, not a fresh bucket
        assert _post(server, f"sk-rotating-{i}", body).status_code == 401
    assert set(state.limiter._buckets) <= {"team-a", key_tenant_name(KEY_SOLO), "ops"}


def test_tenant_state_bounded_under_10000_distinct_keys(server):
    state = server.app.state.serving
    before = (state.limiter.num_tenants, len(state.auth.tenants))
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        for i in range(10_000):
            r = c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                headers={"Authorization": f"Bearer sk-guess-{i:05d}"},
            )
            assert r.status_code == 401
    assert (state.limiter.num_tenants, len(state.auth.tenants)) == before
    # /metrics label sets did not grow with the keys either
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY_OPS}"})
    assert "sk-guess" not in text.text and text.text.count("\n") < 2000


def test_metrics_needs_operator_key_and_leaks_no_request_data(server):
    url = server.base_url + "/metrics"
    assert httpx.get(url).status_code == 401
    # a valid tenant key is not an operator's: 403 saying so (not "an unknown key")
    r = httpx.get(url, headers={"Authorization": f"Bearer {KEY_SOLO}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "operator_key_required"
    assert "got a tenant's key" in r.json()["error"]["message"]
    r = httpx.get(url, headers={"Authorization": f"Bearer {KEY_OPS}"})
    assert r.status_code == 200
    secret = "the purple elephant whispered"
    assert _post(server, KEY_SOLO, {"prompt": secret, "max_tokens": 2}).status_code in (200, 429)
    text = httpx.get(url, headers={"Authorization": f"Bearer {KEY_OPS}"}).text
    allowed_labels = {"queue", "kind", "cause", "reason", "endpoint", "status", "to", "le"}
    # the served model's id (set by the operator) and the finish reason: fixed sets
    allowed_labels |= {"model_name", "finished_reason"}
    info_labels = {"block_size", "num_blocks", "kv_dtype", "backend", "model"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert set(s.labels) <= allowed_labels | info_labels, (s.name, s.labels)
            for v in s.labels.values():
                assert "purple" not in v and "sk-" not in v and "team-a" not in v
    assert 'kvpage:server_requests_rejected_total{reason="unauthenticated"}' in text


def test_unauthenticated_loopback_only_unless_allowed():
    check_bind(ServerConfig(), auth_enabled=False)  # 127.0.0.1: allowed
    check_bind(ServerConfig(host="::1"), auth_enabled=False)
    with pytest.raises(SpecError, match="loopback"):
        check_bind(ServerConfig(host="0.0.0.0"), auth_enabled=False)
    check_bind(
        ServerConfig(host="0.0.0.0", security={"allow_unauthenticated": True}), auth_enabled=False
    )
    check_bind(ServerConfig(host="0.0.0.0"), auth_enabled=True)


def test_separate_metrics_listener_on_a_public_address_is_refused():
    """The separate /metrics listener takes no key: binding it beyond loopback needs the
    same explicit --allow-unauthenticated as an unauthenticated API (fresh-user finding)."""
    public = {"metrics_port": 9100, "metrics_host": "0.0.0.0"}
    with pytest.raises(SpecError, match="metrics_host: expected a loopback address"):
        check_bind(ServerConfig(security=public), auth_enabled=True)
    check_bind(ServerConfig(security={"metrics_port": 9100}), auth_enabled=True)  # 127.0.0.1
    check_bind(ServerConfig(security={**public, "allow_unauthenticated": True}), auth_enabled=True)


def test_tokenize_and_detokenize_need_a_key_and_bounded_text(server):
    """/tokenize and /detokenize cost tokenizer time: with keys configured they need one
    (a keyless 4 MB /tokenize used to stall keyed requests), and text that provably
    cannot fit the context is refused before it is encoded."""
    body = {"model": MODEL, "prompt": "Once upon a time"}
    for path, payload in (("/tokenize", body), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(server.base_url + path, json=payload, timeout=30)
        assert r.status_code == 401, (path, r.text)
        r = httpx.post(
            server.base_url + path,
            json=payload,
            headers={"Authorization": f"Bearer {KEY_SOLO}"},
            timeout=30,
        )
        assert r.status_code == 200, (path, r.text)
    huge = {"model": MODEL, "prompt": "x" * 200_000}
    r = httpx.post(
        server.base_url + "/tokenize",
        json=huge,
        headers={"Authorization": f"Bearer {KEY_SOLO}"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"


def test_keys_never_in_dumped_config_and_file_checks(tmp_path, keys_file):
    cfg = ServerConfig(security={"api_keys": [KEY_SOLO], "api_keys_file": keys_file})
    assert KEY_SOLO not in cfg.model_dump_json() and KEY_SOLO not in repr(cfg)
    pairs = load_keys_file(keys_file)
    assert {t.name for _, t in pairs} == {"team-a", "ops"}
    p = tmp_path / "k.yaml"
    p.write_text(yaml.safe_dump({"tenants": {"a": {"keys": ["secret-1"], "weight": 3}}}))
    os.chmod(p, 0o600)
    with pytest.raises(SpecError, match="weight") as ei:  # unknown fields are refused
        load_keys_file(p)
    assert "secret-1" not in str(ei.value)
    os.chmod(p, 0o644)  # readable by other users: refused
    with pytest.raises(SpecError, match="chmod 600"):
        load_keys_file(p)
    with pytest.raises(SpecError, match="each key once"):
        Authenticator(SecurityConfig(api_keys=[KEY_SOLO, KEY_SOLO]))


def test_unauthenticated_tenant_state_is_an_lru():
    """Without keys the tenant is client-chosen: its buckets are capped (LRU)."""
    cfg = AdmissionConfig(default_limit=TenantLimit(rate=1, burst=10))
    lim = TenantLimiter(cfg, max_tenants=100)
    for i in range(10_000):
        lim.try_take(f"tenant-{i}", 1, 0.0)
        assert lim.num_tenants <= 100
    assert lim.num_tenants == 100 and "tenant-9999" in lim._buckets


@pytest.fixture(scope="module")
def unauth_server(serve):
    return serve(
        admission={"default_limit": {"rate": 1.0, "burst": 4.0}},
        security={"max_unauthenticated_tenants": 32},
    )


def test_unauthenticated_server_bounds_tenants_over_http(unauth_server):
    state = unauth_server.app.state.serving
    with httpx.Client(base_url=unauth_server.base_url, timeout=30) as c:
        for i in range(300):  # each creates a bucket, then is refused (cost > burst)
            r = c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Once upon", "max_tokens": 8},
                headers={"Authorization": f"Bearer anon-{i}"},
            )
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "cost_exceeds_burst"
    assert state.limiter.num_tenants == 32


# ------------------------------------------------------------------ HTTP limits


@pytest.fixture(scope="module")
def small_server(serve):
    return serve(security={"max_body_bytes": 4096, "body_timeout_s": 0.5, "max_header_bytes": 4096})


def test_body_limit_413_declared_and_chunked(small_server):
    url = small_server.base_url + "/v1/completions"
    big = {"model": MODEL, "prompt": "a" * 10_000, "max_tokens": 1}
    r = httpx.post(url, json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(10):
            yield b" " * 1024

    r = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    ok = httpx.post(url, json={"model": MODEL, "prompt": "Once", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200


def test_content_type_415_and_no_cors_by_default(small_server):
    url = small_server.base_url + "/v1/completions"
    body = '{"model": "stories260K", "prompt": "Once", "max_tokens": 1}'
    for ct in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Origin": "https://evil.example"}
        if ct:
            headers["Content-Type"] = ct
        r = httpx.post(url, content=body, headers=headers, timeout=30)
        assert r.status_code == 415, ct
        assert r.json()["error"]["code"] == "unsupported_media_type"
        assert "access-control-allow-origin" not in r.headers
    r = httpx.options(url, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(url, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_json_nesting_and_header_limits(small_server):
    url = small_server.base_url + "/v1/completions"
    deep = '{"model": "stories260K", "prompt": "a", "x": ' + "[" * 1000 + "]" * 1000 + "}"
    r = httpx.post(url, content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested at most 200" in r.json()["error"]["message"]
    r = httpx.get(small_server.base_url + "/health", headers={"X-Big": "a" * 8000})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    assert httpx.get(small_server.base_url + "/health").status_code == 200


def test_slow_body_gets_408(small_server):
    with socket.create_connection((small_server.host, small_server.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        t0 = time.monotonic()
        data = s.recv(4096)
        assert b" 408 " in data.split(b"\r\n", 1)[0]
        assert time.monotonic() - t0 < 5  # body_timeout_s = 0.5, generous margin
    assert httpx.get(small_server.base_url + "/health").status_code == 200


@pytest.fixture(scope="module")
def cors_metrics_server(serve):
    srv = serve(
        security={
            "api_keys": [KEY_SOLO],
            "allowed_origins": ["https://app.example"],
            "metrics_port": 0,
        }
    )
    from kvpage.server.runner import BackgroundServer

    side = BackgroundServer(srv.app.state.metrics_app, lifespan="off").start()
    yield srv, side
    side.stop()
    wait_idle_state(srv.app.state.serving)


def test_cors_only_for_allowed_origins_and_separate_metrics(cors_metrics_server):
    srv, side = cors_metrics_server
    url = srv.base_url + "/v1/completions"
    pre = httpx.options(
        url,
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    pre = httpx.options(
        url, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert pre.headers.get("access-control-allow-origin") != "https://evil.example"
    r = _post(srv, KEY_SOLO, {"prompt": "Once", "max_tokens": 1}, headers={"Origin": "x"})
    assert r.status_code == 200
    # /metrics is not on the API listener at all; the metrics listener serves it
    auth = {"Authorization": f"Bearer {KEY_SOLO}"}
    assert httpx.get(srv.base_url + "/metrics", headers=auth).status_code == 404
    m = httpx.get(side.base_url + "/metrics")
    assert m.status_code == 200 and "kvpage:server_requests_total" in m.text


def _cli_args(argv):
    import argparse

    from kvpage.server.cli import add_serve_parser

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_cli_keys_env_and_unauthenticated_refusal(monkeypatch, capsys):
    from kvpage.server.cli import config_from_args, serve_main

    monkeypatch.setenv("KVPAGE_API_KEY", "sk-from-env-" + "e" * 20)
    args = _cli_args(["--api-key", KEY_SOLO, "--prefix-cache-scope", "global", "--dump-config"])
    cfg = config_from_args(args)
    assert cfg.security.api_keys == [KEY_SOLO, "sk-from-env-" + "e" * 20]
    assert cfg.security.prefix_cache_scope == "global"
    assert serve_main(args) == 0
    out = capsys.readouterr().out
    assert "prefix_cache_scope: global" in out and "sk-" not in out  # keys never dumped
    monkeypatch.delenv("KVPAGE_API_KEY")
    # no key and a public address: refused at once (before the engine is built)
    t0 = time.monotonic()
    assert serve_main(_cli_args(["--host", "0.0.0.0"])) == 2
    assert "loopback" in capsys.readouterr().err and time.monotonic() - t0 < 5
    args = _cli_args(["--prefix-cache-scope", "everyone"])
    with pytest.raises(SpecError, match="prefix_cache_scope"):
        config_from_args(args)


def test_keyless_loopback_server_refuses_foreign_host_headers(serve):
    """DNS rebinding: a page whose own name resolves to 127.0.0.1 sends that name as Host;
    a server without keys on loopback answers only loopback names (fresh-user finding).
    With keys configured, a foreign Host is fine (the key is the guard)."""
    srv = serve()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    port = srv.base_url.rsplit(":", 1)[1]
    for host in (f"attacker.example:{port}", "attacker.example", f"10.1.2.3:{port}"):
        r = httpx.post(srv.base_url + "/v1/completions", json=body, headers={"Host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
        assert httpx.get(srv.base_url + "/metrics", headers={"Host": host}).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        r = httpx.post(srv.base_url + "/v1/completions", json=body, headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    assert (
        httpx.get(srv.base_url + "/health", headers={"Host": "attacker.example"}).status_code == 200
    )
