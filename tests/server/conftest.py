"""Fixtures of the server tests: real uvicorn servers on free loopback ports.

Each server runs the real engine (stories260K, CPU) in its background loop; the
``serve`` factory checks at teardown that the server left nothing behind: every block
free, running = waiting = 0 (seen through /metrics while it still runs, and on the
engine itself after it stopped), and the cache manager's integrity check passes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

#: the ``server`` extra plus the test client; without them these tests are not collected
_NEEDED = ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai")
_MISSING = [m for m in _NEEDED if importlib.util.find_spec(m) is None]
if _MISSING:
    collect_ignore_glob = ["test_*.py"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=8,
        help="schemathesis examples per operation and generation mode (test_fuzz_api)",
    )


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Any]]:
    """Factory: ``serve(**config_overrides)`` starts a server; all are checked and stopped
    when the module ends."""
    from srv_helpers import ENGINE, assert_engine_clean, wait_idle, wait_idle_state

    from kvpage.server.app import create_app
    from kvpage.server.config import ServerConfig
    from kvpage.server.runner import BackgroundServer

    servers: list[BackgroundServer] = []

    def start(**overrides: Any) -> BackgroundServer:
        # the engine thread in this process: teardown inspects the engine directly
        data: dict[str, Any] = {
            "engine": dict(ENGINE),
            "log_level": "warning",
            "engine_process": False,
        }
        for k, v in overrides.items():
            if isinstance(v, dict) and isinstance(data.get(k), dict):
                data[k].update(v)
            else:
                data[k] = v
        cfg = ServerConfig.model_validate(data)
        srv = BackgroundServer(create_app(cfg)).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        try:
            st = srv.app.state
            if st.serving.auth.enabled or st.metrics_app is not None:
                wait_idle_state(st.serving)  # /metrics needs a key or is elsewhere
            else:
                wait_idle(srv.base_url)
        finally:
            srv.stop()
        state = srv.app.state.serving
        assert not state.loop.running
        assert_engine_clean(state.engine)
        assert state.kv_budget.reserved_blocks == 0
        assert state.num_active == 0
        assert not state.tenant_sequences.held  # every request gave its sequences back
