"""Trailing-slash paths are unknown routes (404, OpenAI error body), never an empty
307 redirect whose Location comes from the client's Host header (Starlette's
``redirect_slashes``, off in the server, the ingress and the metrics listener)."""

from __future__ import annotations

import httpx
import pytest
from srv_helpers import wait_idle_state

pytestmark = pytest.mark.xdist_group("server_no_slash_redirects")

KEY = "sk-slash-" + "s" * 24


@pytest.fixture(scope="module")
def servers(serve):
    from kvpage.server.runner import BackgroundServer

    srv = serve(security={"api_keys": [KEY], "metrics_port": 0})
    side = BackgroundServer(srv.app.state.metrics_app, lifespan="off").start()
    yield srv, side
    side.stop()
    wait_idle_state(srv.app.state.serving)


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("path", ["/tokenize/", "/metrics/", "/health/", "/ping/"])
def test_trailing_slash_is_a_404_not_a_redirect(servers, method, path):
    srv, _ = servers
    for headers in ({"Host": "evil.example"}, {"Authorization": f"Bearer {KEY}"}):
        r = httpx.request(
            method, srv.base_url + path, headers=headers, json={}, follow_redirects=False
        )
        assert r.status_code in (401, 404), (path, r.status_code, r.headers)
        assert "location" not in r.headers
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        if r.status_code == 404:
            assert err["code"] == "not_found"


def test_v1_trailing_slash_still_needs_a_key_first(servers):
    srv, _ = servers
    r = httpx.post(srv.base_url + "/v1/completions/", json={}, follow_redirects=False)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(
        srv.base_url + "/v1/completions/",
        json={},
        headers={"Authorization": f"Bearer {KEY}"},
        follow_redirects=False,
    )
    assert r.status_code == 404 and "location" not in r.headers


def test_metrics_listener_has_no_slash_redirect(servers):
    _, side = servers
    r = httpx.get(side.base_url + "/metrics/", follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers


def test_models_trailing_slash_is_an_unknown_route(servers):
    srv, _ = servers
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(srv.base_url + "/v1/models/", headers=auth, follow_redirects=False)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(srv.base_url + "/v1/models/other", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
