"""Running the app under uvicorn: in the foreground (``kvpage serve``) or in a thread.

:class:`BackgroundServer` starts a real uvicorn server on a loopback socket it binds
itself (port 0 = a free port chosen by the OS, so there is no race between picking a
port and binding it) and stops it on exit; tests and the load benchmark use it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from kvpage.server.config import ServerConfig

__all__ = ["BackgroundServer", "run_server"]


def run_server(config: ServerConfig, app: Any | None = None) -> None:
    """Serve ``app`` (built from ``config`` when None) on ``config.host:config.port``; blocks."""
    if app is None:
        from kvpage.server.app import create_app

        app = create_app(config)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=30,  # in-flight streams get 30 s to finish, then are cut
    )


class BackgroundServer:
    """A uvicorn server for ``app`` in a daemon thread, bound to ``host`` (loopback).

    Use as a context manager; ``base_url`` is ``http://127.0.0.1:PORT``.

    Raises:
        RuntimeError: the server did not start within ``start_timeout_s``.
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 60.0
    ) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        cfg = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock]},
            name="kvpage-uvicorn",
            daemon=True,
        )
        self._start_timeout_s = start_timeout_s

    @property
    def base_url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        """Start serving and wait until uvicorn reports it started."""
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"server: expected to start within {self._start_timeout_s}s, got no start"
                )
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to exit (runs the app's shutdown) and join the thread (bounded)."""
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
