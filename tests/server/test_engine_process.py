"""The engine in its own process (``engine_process``, the ``kvpage serve`` default):
the same HTTP behaviour as the engine thread, a clean end state reported by the child,
construction errors surfaced, and a dead child failing requests instead of hanging."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

from kvpage.errors import BackendUnavailableError, RequestRejected
from kvpage.server.app import create_app
from kvpage.server.config import ServerConfig
from kvpage.server.engine_process import EngineProcess, ProcessAsyncEngine
from kvpage.server.runner import BackgroundServer

pytestmark = pytest.mark.xdist_group("server_engine_process")

MODEL = "stories260K"
ENGINE = {"num_blocks": 65, "max_num_seqs": 8, "scheduling_policy": "priority"}


def _config(**kw):
    return ServerConfig.model_validate(
        {"engine": dict(ENGINE), "log_level": "warning", "engine_process": True, **kw}
    )


@pytest.fixture(scope="module")
def server():
    srv = BackgroundServer(create_app(_config())).start()
    yield srv
    srv.stop()


def _complete(srv, **body):
    return httpx.post(
        srv.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, **body},
        timeout=120,
    )


def test_the_engine_runs_in_a_child_process(server):
    state = server.app.state.serving
    assert isinstance(state.engine, EngineProcess) and isinstance(state.loop, ProcessAsyncEngine)
    assert state.engine.process.pid != os.getpid() and state.engine.process.is_alive()
    assert state.max_model_len == 512 and state.scheduling_policy == "priority"
    assert httpx.get(server.base_url + "/health", timeout=10).json()["status"] == "ok"


def test_structured_outputs_cross_the_process_boundary(server):
    pytest.importorskip("xgrammar")
    r = _complete(server, max_tokens=40, n=2, guided_regex="[a-c]{2}-[0-9]")
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert re.fullmatch("[a-c]{2}-[0-9]", c["text"]) and c["finish_reason"] == "stop"
    bad = _complete(server, guided_regex="(x")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"


def test_completions_stream_cancel_and_errors_match_the_thread_engine(server):
    a = _complete(server, temperature=0, seed=1)
    b = _complete(server, temperature=0, seed=1, priority=4)
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.json()["usage"]["completion_tokens"] == 6
    # a stream read to the end, then one dropped after its first chunk
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Once", "max_tokens": 5, "stream": True},
        timeout=120,
    ) as r:
        chunks = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    assert len(chunks) == 5 and json.loads(chunks[-1][6:])["choices"][0]["finish_reason"]
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Once", "max_tokens": 400, "stream": True},
        timeout=120,
    ) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                break
    deadline = time.monotonic() + 30
    state = server.app.state.serving
    while time.monotonic() < deadline:
        snap = state.loop.metrics_snapshot
        if snap["kvpage:num_requests_running"] == 0 and snap["kvpage:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"engine not idle after the cancelled stream: {snap}")


def _free_blocks(engine):
    return engine.kv_cache_manager.num_free_blocks


def _add_duplicate(engine):
    from kvpage.engine import SamplingParams

    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=400))
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=1))


def _abort_dup(engine):
    engine.abort_request("dup")


def test_call_runs_in_the_child_and_errors_cross_with_their_reason(server):
    state = server.app.state.serving

    def call(fn):
        return asyncio.run_coroutine_threadsafe(state.loop.call(fn), state.loop._loop).result(60)

    assert call(_free_blocks) <= 64
    with pytest.raises(RequestRejected) as ei:
        call(_add_duplicate)
    assert ei.value.reason == "duplicate_request_id" and ei.value.request_id == "dup"
    call(_abort_dup)
    assert call(_free_blocks) == 64


def test_construction_error_is_raised_in_the_server_process():
    # the child's error is re-raised here with its type (the CLI prints KVPageErrors
    # as one clean line)
    with pytest.raises(BackendUnavailableError, match="nope: not registered"):
        create_app(_config(engine={**ENGINE, "backend": "nope"}))


def test_a_dead_engine_process_fails_requests_and_health():
    srv = BackgroundServer(create_app(_config())).start()
    state = srv.app.state.serving
    try:
        os.kill(state.engine.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while state.loop.running and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(srv.base_url + "/health", timeout=10)
        assert r.status_code == 503
        r = _complete(srv)
        assert r.status_code >= 500  # refused at once, no hang
    finally:
        srv.stop()


def test_non_streamed_request_gets_only_the_outputs_it_keeps_across_the_pipe(server):
    """As in thread mode (test_request_size_limits): the child sends a non-streamed
    request its first token and its end, not one output per step."""
    from kvpage.engine import SamplingParams

    state = server.app.state.serving

    async def run(rid: str, replayable: bool) -> list:
        sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
        q = await state.loop.add(rid, [1, 2, 3], sp, replayable=replayable)
        got = []
        while not got or not got[-1].finished:
            got.append(await asyncio.wait_for(q.get(), 60))
        return got

    def go(rid: str, replayable: bool) -> list:
        return asyncio.run_coroutine_threadsafe(run(rid, replayable), state.loop._loop).result(90)

    every, kept = go("fo-every", False), go("fo-kept", True)
    assert len(every) == 12 and len(kept) == 2
    assert kept[-1].outputs[0].token_ids == every[-1].outputs[0].token_ids


def test_stop_reports_a_clean_engine(server):
    """(Runs last on the module's server.) Stopping it: the child reports its end state."""
    state = server.app.state.serving
    assert _complete(server).status_code == 200
    server.stop()
    rep = state.loop.final_report
    assert rep is not None and rep["integrity"] == "ok"
    assert rep["free_blocks"] == rep["usable_blocks"] == 64
    assert rep["running"] == rep["waiting"] == 0 and not rep["unfinished"]
    assert not state.loop.running and not state.engine.process.is_alive()


def test_the_process_loop_is_an_engine_client(server):
    from kvpage.server.engine_client import EngineClient

    assert isinstance(server.app.state.serving.loop, EngineClient)
