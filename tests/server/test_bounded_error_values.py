"""Error messages name the offending value in a bounded form (``kvpage.errors.
got_repr``): a huge ``model``, ``cache_salt`` or deeply nested ``stop`` is not echoed
back at full length."""

from __future__ import annotations

import httpx
import pytest

from kvpage.errors import got_repr

pytestmark = pytest.mark.xdist_group("server_bounded_errors")


def test_got_repr_bounds_and_says_how_long() -> None:
    assert got_repr("abc") == "'abc'"
    long = got_repr("x" * 3_000_000)
    assert len(long) < 300 and long.endswith("... (3000002 characters)")
    assert got_repr([[[]]]) == "[[[]]]"


@pytest.fixture(scope="module")
def server(serve):
    return serve()


def _post(server, body, path="/v1/completions"):
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_huge_values_are_not_echoed(server) -> None:
    base = {"model": "stories260K", "prompt": "Once", "max_tokens": 2}
    nested: list = ["x"]
    for _ in range(150):
        nested = [nested]
    for body, path, status in (
        ({**base, "model": "m" * 3_000_000}, "/v1/completions", 404),
        ({"model": "m" * 3_000_000, "prompt": "Once"}, "/tokenize", 404),
        ({**base, "cache_salt": "s" * 1025}, "/v1/completions", 400),
        ({**base, "stop": nested}, "/v1/completions", 400),
        ({**base, "stop": [""] + ["y" * 5000]}, "/v1/completions", 400),
    ):
        r = _post(server, body, path)
        assert r.status_code == status, (path, r.text[:300])
        assert len(r.content) < 1000, (path, len(r.content), r.text[:300])
    r = httpx.get(server.base_url + "/v1/models/" + "q" * 8_000, timeout=60)
    assert r.status_code == 404 and len(r.content) < 1000
    r = httpx.get(server.base_url + "/no-such-route-" + "q" * 8_000, timeout=60)
    assert r.status_code == 404 and len(r.content) < 1000
    assert r.json()["error"]["message"].endswith("... (8015 characters): Not Found")
