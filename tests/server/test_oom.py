"""Out-of-memory during an engine step is a first-class failure (issue 12).

A real server, a real engine; the model runner is made to raise torch's
``OutOfMemoryError`` in one chosen step (fault injection: a CPU test box cannot be made
to run out of device memory on demand). Checks: only the requests of that step fail
(503 ``out_of_memory``), a request waiting outside the step completes, the failure is
counted in ``kvpage:oom_total``, degraded mode is entered, and the pool ends empty.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest
import torch
from srv_helpers import metrics_dict

from kvpage.server.auth import Authenticator
from kvpage.server.config import SecurityConfig
from kvpage.server.engine_loop import is_out_of_memory
from kvpage.server.http_limits import HTTPGuard

pytestmark = pytest.mark.xdist_group("server_oom")

MODEL = "stories260K"


@pytest.fixture(scope="module")
def server(serve):
    return serve(
        engine={"max_num_seqs": 1},  # one running sequence: the second request waits
        degradation={"eval_interval_s": 0.05, "min_dwell_s": 0.0},
    )


def test_is_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_oom_fails_only_its_step_and_degrades(server):
    state = server.app.state.serving
    runner = state.engine.runner
    real = runner.execute
    fired = []

    def execute(out):
        # fail the first step that runs while another request waits behind it
        if not fired and state.engine.scheduler.num_waiting >= 1:
            fired.append([s.request.parent_id for s in out.scheduled])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(out)

    runner.execute = execute
    url = server.base_url + "/v1/completions"
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, url, json={**body, "max_tokens": 400}, timeout=60)
            deadline = time.monotonic() + 30
            while state.engine.scheduler.num_running < 1 and time.monotonic() < deadline:
                time.sleep(0.005)  # the first is running (max_num_seqs = 1) ...
            second = pool.submit(httpx.post, url, json={**body, "max_tokens": 5}, timeout=60)
            r1, r2 = first.result(), second.result()  # ... when the second comes
    finally:
        runner.execute = real
    assert fired and len(fired[0]) == 1, fired  # one request in the failed step
    failed, survived = (r1, r2) if r1.status_code == 503 else (r2, r1)
    assert failed.status_code == 503, (r1.text, r2.text)
    err = failed.json()["error"]
    assert err["code"] == "out_of_memory" and err["type"] == "server_error"
    assert "Retry-After" in failed.headers
    # the request waiting outside the failed step completes in full
    assert survived.status_code == 200, survived.text
    want = 5 if survived is r2 else 400
    assert survived.json()["usage"]["completion_tokens"] == want
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = metrics_dict(httpx.get(server.base_url + "/metrics").text)
        if m["kvpage:degraded"] == 1.0:
            break
        time.sleep(0.05)
    assert m["kvpage:oom_total"] == 1.0 and m["kvpage:engine_step_errors_total"] == 1.0
    assert m["kvpage:degraded"] == 1.0
    assert m['kvpage:server_requests_rejected_total{reason="out_of_memory"}'] == 1.0
    # the server keeps serving
    ok = httpx.post(url, json={**body, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200


def test_send_timeout_cuts_a_client_that_does_not_read():
    """A response send that does not complete within send_timeout_s raises, so the
    response (and the stream's cleanup, which aborts its request) ends."""
    sec = SecurityConfig(send_timeout_s=0.2)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})

    async def stuck_send(msg):
        if msg["type"] == "http.response.body":
            await asyncio.sleep(3600)  # a client whose receive window stays full

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = HTTPGuard(app, sec, Authenticator(sec))
    scope = {"type": "http", "method": "GET", "path": "/health", "headers": []}

    async def run():
        t0 = time.monotonic()
        with pytest.raises(OSError, match="read within"):
            await guard(scope, receive, stuck_send)
        return time.monotonic() - t0

    assert asyncio.run(run()) < 30  # 0.2 s timeout, generous margin
