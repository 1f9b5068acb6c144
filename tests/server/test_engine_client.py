"""Every engine front-end the server can hold satisfies :class:`EngineClient`: the
thread loop, the engine process's loop (in ``test_engine_process``) and the ingress's
replica-group loop; an object lacking part of the contract does not. The assignments to
``EngineClient`` variables are also checked by mypy (``mypy tests/server/test_engine_client.py``)."""

from __future__ import annotations

import asyncio

from kvpage.cluster.remote import GroupSelector, RemoteEngineLoop
from kvpage.server.engine_client import EngineClient
from kvpage.server.engine_loop import AsyncEngine
from kvpage.server.engine_process import ProcessAsyncEngine


class _Engine:
    failed_request_ids: tuple[str, ...] = ()

    def get_metrics(self) -> dict[str, float]:
        return {"num_requests_running": 0.0}


class _NoAbort:
    """An engine loop missing ``abort_nowait`` (the handlers' cancel path)."""

    metrics_snapshot: dict[str, float] = {}
    running = True

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def stop(self, timeout_s: float = 10.0) -> None: ...
    async def add(self, *a: object, **kw: object) -> None: ...
    async def abort(self, request_id: str) -> None: ...
    async def call(self, fn: object) -> None: ...


def _process_loop_is_a_client(loop: ProcessAsyncEngine) -> EngineClient:
    return loop  # checked by mypy; built and checked at run time in test_engine_process


def test_the_thread_loop_and_the_ingress_loop_are_engine_clients() -> None:
    thread: EngineClient = AsyncEngine(_Engine())
    ingress: EngineClient = RemoteEngineLoop({}, GroupSelector(frozenset({"default"})), None)
    assert isinstance(thread, EngineClient) and isinstance(ingress, EngineClient)
    assert thread.metrics_snapshot == {"num_requests_running": 0.0} and not thread.running
    assert not isinstance(_NoAbort(), EngineClient)
