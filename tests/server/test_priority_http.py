"""Per-tenant scheduling priority over HTTP: the keys file's ``priority``, the request's
``priority`` field (may lower a tenant's priority, never raise it), and the service
order of two tenants on a real uvicorn server with ``--scheduling-policy priority``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time

import httpx
import pytest
import yaml

from kvpage.errors import SpecError
from kvpage.server.auth import Authenticator, Tenant, load_keys_file, request_priority
from kvpage.server.config import SecurityConfig

pytestmark = pytest.mark.xdist_group("server_priority")

MODEL = "stories260K"
KEY_GOLD = "sk-gold-" + "g" * 32
KEY_BRONZE = "sk-bronze-" + "b" * 32


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("keys") / "keys.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "gold": {"keys": [KEY_GOLD], "priority": 0},
                    "bronze": {"keys": [KEY_BRONZE], "priority": 10},
                }
            }
        )
    )
    os.chmod(p, 0o600)
    return str(p)


@pytest.fixture(scope="module")
def server(serve, keys_file):
    # one sequence at a time: the order the engine admits requests is the order they end
    return serve(
        engine={"scheduling_policy": "priority", "max_num_seqs": 1},
        security={"api_keys_file": keys_file},
    )


def _post(srv, key, body):
    return httpx.post(
        srv.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": [5, 6, 7], "temperature": 0, "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def test_request_priority_rule():
    gold, bronze = Tenant("gold", "g", priority=0), Tenant("bronze", "b", priority=10)
    assert request_priority(bronze, None, "priority") == 10  # unset: the tenant's
    assert request_priority(bronze, 25, "priority") == 25  # less urgent: allowed
    assert request_priority(gold, -0, "priority") == 0
    with pytest.raises(ValueError, match="priority: expected >= 10"):
        request_priority(bronze, 9, "priority")  # more urgent than granted
    assert request_priority(Tenant("anon", "a"), None, "fcfs") == 0
    assert request_priority(Tenant("anon", "a"), 0, "fcfs") == 0
    with pytest.raises(ValueError, match="scheduling-policy fcfs"):
        request_priority(Tenant("anon", "a"), 3, "fcfs")


def test_keys_file_priority_needs_priority_policy(keys_file, tmp_path):
    assert {t.name: t.priority for _, t in load_keys_file(keys_file)} == {
        "gold": 0,
        "bronze": 10,
    }
    auth = Authenticator(SecurityConfig(api_keys_file=keys_file))
    auth.check_policy("priority")
    with pytest.raises(SpecError, match=r"tenants.bronze.priority: expected 0 with") as ei:
        auth.check_policy("fcfs")
    assert KEY_BRONZE not in str(ei.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tenants": {"a": {"keys": ["k-1"], "priority": "high"}}}))
    os.chmod(bad, 0o600)
    with pytest.raises(SpecError, match="priority"):
        load_keys_file(bad)


def test_fcfs_server_refuses_priorities(serve, keys_file):
    from kvpage.server.app import create_app
    from kvpage.server.config import ServerConfig

    with pytest.raises(SpecError, match="--scheduling-policy priority"):
        create_app(
            ServerConfig.model_validate(
                {
                    "engine": {"num_blocks": 65},
                    "engine_process": False,
                    "security": {"api_keys_file": keys_file},
                }
            )
        )
    srv = serve()  # fcfs, no keys (loopback)
    r = _post(srv, "anyone", {"priority": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority" and "scheduling-policy fcfs" in err["message"]
    assert _post(srv, "anyone", {"priority": 0}).status_code == 200


def test_tenant_may_lower_but_not_raise_its_priority(server):
    r = _post(server, KEY_BRONZE, {"priority": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority" and "expected >= 10" in err["message"]
    assert _post(server, KEY_BRONZE, {"priority": 50}).status_code == 200
    assert _post(server, KEY_GOLD, {"priority": -1}).status_code == 400
    assert _post(server, KEY_GOLD, {}).status_code == 200


def test_higher_priority_tenant_is_served_first(server):
    """The engine thread is held (a ``call`` that waits) while four bronze requests and
    then one gold request are queued, in that order; released, the engine adds them all
    before its next step and serves gold first, then bronze in arrival order."""
    state = server.app.state.serving
    release = threading.Event()
    held = threading.Event()

    def hold(engine):
        held.set()
        release.wait(60)

    blocker = asyncio.run_coroutine_threadsafe(state.loop.call(hold), state.loop._loop)
    assert held.wait(30)
    ids: dict[str, str] = {}
    # the order the ENGINE finished them (the engine thread appends): the order in which
    # the HTTP answers reach this test's client threads can differ on a loaded machine
    finished: list[str] = []
    engine = state.engine
    real_step = engine.step

    def step():
        outs = real_step()
        finished.extend(o.request_id for o in outs if o.finished)
        return outs

    engine.step = step

    def send(name: str, key: str) -> None:
        r = _post(server, key, {"max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        ids[name] = r.json()["id"]

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futs = []
            order = [(f"bronze-{i}", KEY_BRONZE) for i in range(4)] + [("gold", KEY_GOLD)]
            for i, (name, key) in enumerate(order, start=1):
                futs.append(pool.submit(send, name, key))
                deadline = time.monotonic() + 30  # its add is queued before the next is sent
                while state.loop._commands.qsize() < i and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert state.loop._commands.qsize() == i
            release.set()
            blocker.result(30)
            for f in futs:
                f.result(timeout=120)
    finally:
        release.set()
        engine.step = real_step
    names = {i: n for n, i in ids.items()}
    order = [next(n for i, n in names.items() if rid.startswith(i)) for rid in finished]
    assert order == ["gold", "bronze-0", "bronze-1", "bronze-2", "bronze-3"]


def test_kv_pressure_queue_serves_the_higher_priority_tenant_first(serve, keys_file):
    """27 blocks of the KV budget are reserved (standing in for a long request in
    flight); a bronze long request, then a gold one, wait in the KV-pressure queue (each
    would push the projection over the high-water mark, and only one fits once the
    reservation is returned). Returned: gold is admitted first although bronze queued
    first, and bronze only after gold finished. The order is recorded on the server (the
    budget's successful reservations), not from the answers' arrival at the client
    threads. (Before priorities applied to this queue, bronze went first.)"""
    srv = serve(
        engine={"scheduling_policy": "priority", "max_num_seqs": 4},
        security={"api_keys_file": keys_file},
        admission={"kv_high_water": 0.5, "long_prompt_tokens": 16, "queue_timeout_s": 60.0},
    )
    state = srv.app.state.serving
    kv, loop = state.kv_budget, state.loop._loop
    assert kv.num_blocks == 64  # high water 0.5 = 32 blocks of 16 tokens
    assert asyncio.run_coroutine_threadsafe(kv.acquire(100, 27), loop).result(30).ok
    admitted: list[int] = []  # priorities, in the order the budget admitted them
    acquire = kv.acquire

    async def recording_acquire(prompt_tokens, blocks, priority=0):
        d = await acquire(prompt_tokens, blocks, priority)
        if d.ok:
            admitted.append(priority)
        return d

    kv.acquire = recording_acquire
    prompt = list(range(3, 23))  # 20 tokens: long

    def send(key: str) -> None:
        # 20 + 300 tokens = 20 blocks: 27 + 20 > 32 waits, and 20 + 20 > 32: one at a time
        r = _post(srv, key, {"prompt": prompt, "max_tokens": 300, "ignore_eos": True})
        assert r.status_code == 200, r.text

    def wait_queued(n: int) -> None:
        deadline = time.monotonic() + 30
        while kv.num_queued < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert kv.num_queued == n

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(send, KEY_BRONZE)]
            wait_queued(1)
            futs.append(pool.submit(send, KEY_GOLD))
            wait_queued(2)
            assert admitted == []
            loop.call_soon_threadsafe(kv.release, 27)
            for f in futs:
                f.result(timeout=120)
    finally:
        del kv.acquire
    assert admitted == [0, 10]  # gold (priority 0), then bronze (10)
