"""Degraded mode acting on admitted work: a stream already running when the server
turns degraded is capped at ``max_tokens_cap`` and says so on its final chunk
(``kvpage_max_tokens_capped``, ``finish_reason: "length"``); a stream admitted while
degraded also gets the ``X-KVPage-Max-Tokens-Capped`` header (built after the cap).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("server_degradation_admitted")

CAP = 8
BODY = {"model": "stories260K", "prompt": "Once upon a time", "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server(serve: Any) -> Any:
    # min_dwell_s: once entered by the test, degraded mode stays for the test's length
    return serve(degradation={"eval_interval_s": 0.05, "min_dwell_s": 600.0, "max_tokens_cap": CAP})


def _events(lines: Any) -> list[Any]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_running_stream_is_capped_visibly_and_new_streams_carry_the_header(server: Any) -> None:
    state = server.app.state.serving
    url = server.base_url + "/v1/completions"
    with httpx.stream(
        "POST", url, json={**BODY, "max_tokens": 400, "ignore_eos": True}, timeout=60
    ) as r:
        assert r.status_code == 200 and "x-kvpage-max-tokens-capped" not in r.headers
        lines = r.iter_lines()
        head = [next(lines) for _ in range(2)]  # running, uncapped so far
        state.degradation._set(True, "test: entered by hand", state.clock())
        evs = _events(head + list(lines))
    tokens = [c for e in evs for c in e["choices"]]
    assert tokens[-1]["finish_reason"] == "length"
    assert len(tokens) < 400  # cut short of its max_tokens, and not silently:
    assert evs[-1]["kvpage_max_tokens_capped"]["requested"] == 400
    cap = evs[-1]["kvpage_max_tokens_capped"]["cap"]
    assert CAP <= cap < 400 and len(tokens) == cap
    # admitted while degraded: the header (computed after the cap) and the body field
    with httpx.stream("POST", url, json={**BODY, "max_tokens": 50, "ignore_eos": True}) as r:
        assert r.headers["x-kvpage-max-tokens-capped"] == str(CAP)
        evs = _events(list(r.iter_lines()))
    assert sum(len(e["choices"]) for e in evs) == CAP
    assert evs[-1]["kvpage_max_tokens_capped"] == {"requested": 50, "cap": CAP}
    deadline = time.monotonic() + 10
    while state.generation.capped_running:  # nothing left behind
        assert time.monotonic() < deadline
        time.sleep(0.05)
