"""Keep-alive: a request sent on a reused connection is never dropped by the server.

The mechanism of the requests lost under load (issue 23): uvicorn arms a keep-alive timer
when a response completes and cancels it when the connection's next bytes are read; under
uvloop an iteration runs due timers before it polls the sockets, so a loop busy in an I/O
callback past the timer's deadline closed a connection whose next request was already in
the socket (the client saw the connection closed with no status line). These tests build
that order of events deterministically (no timing assumption: the stall lasts until the
client has sent and the timer is due) and check that kvpage's protocol serves the request.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpage.server.config import SecurityConfig
from kvpage.server.runner import IdleOnlyH11Protocol, uvicorn_limits

pytest.importorskip("uvloop")

KEEP_ALIVE_S = 0.3


class _Stalling:
    """An ASGI app whose ``/stall`` makes the event loop run one I/O callback that lasts
    until ``client_sent`` is set and the keep-alive timeout has passed after it."""

    def __init__(self) -> None:
        self.stall_started = threading.Event()
        self.client_sent = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/stall":
            loop = asyncio.get_running_loop()
            r, w = socket.socketpair()
            r.setblocking(False)

            def on_readable() -> None:  # runs in the loop's poll phase
                loop.remove_reader(r)
                self.stall_started.set()
                self.client_sent.wait(10)
                time.sleep(KEEP_ALIVE_S + 0.2)  # the idle connection's timer is now due
                r.close()
                w.close()

            loop.add_reader(r, on_readable)
            w.send(b"x")
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})


def _serve(app: Any, protocol: type[asyncio.Protocol]) -> tuple[uvicorn.Server, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    limits = {**uvicorn_limits(SecurityConfig(keep_alive_timeout_s=KEEP_ALIVE_S))}
    limits["http"] = protocol
    srv = uvicorn.Server(
        uvicorn.Config(app, loop="uvloop", log_level="critical", lifespan="off", **limits)
    )
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return srv, sock.getsockname()[1]


def _get(s: socket.socket) -> None:
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")


def _read_response(s: socket.socket) -> str:
    """The status line of one response (``"closed"`` / ``"reset"`` when none came)."""
    s.settimeout(10)
    data = b""
    try:
        while b"\r\n\r\n" not in data or not data.endswith(b"ok"):
            chunk = s.recv(65536)
            if not chunk:
                return "closed"
            data += chunk
    except ConnectionResetError:
        return "reset"
    return data.split(b"\r\n", 1)[0].decode()


def _reuse_during_stall(protocol: type[asyncio.Protocol]) -> str:
    """Connection A goes idle; the loop stalls (connection B); A's next request arrives
    during the stall, and the stall outlasts A's keep-alive deadline. Returns what A got."""
    app = _Stalling()
    srv, port = _serve(app, protocol)
    try:
        a = socket.create_connection(("127.0.0.1", port))
        b = socket.create_connection(("127.0.0.1", port))
        _get(a)
        assert _read_response(a) == "HTTP/1.1 200 OK"  # A's keep-alive timer is armed
        b.sendall(b"GET /stall HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert app.stall_started.wait(10)
        _get(a)  # reaches A's socket while the loop is stalled
        app.client_sent.set()
        got = _read_response(a)
        assert _read_response(b) == "HTTP/1.1 200 OK"
        a.close()
        b.close()
        return got
    finally:
        app.client_sent.set()
        srv.should_exit = True


def test_uvicorn_h11_drops_a_request_that_arrived_during_a_stall() -> None:
    # the reproduction: uvicorn's own protocol closes the connection with the request in it
    assert _reuse_during_stall(H11Protocol) in ("closed", "reset")


def test_keep_alive_timeout_never_drops_a_waiting_request() -> None:
    assert _reuse_during_stall(IdleOnlyH11Protocol) == "HTTP/1.1 200 OK"


def test_keep_alive_timeout_still_closes_idle_connections() -> None:
    srv, port = _serve(_Stalling(), IdleOnlyH11Protocol)
    try:
        a = socket.create_connection(("127.0.0.1", port))
        _get(a)
        assert _read_response(a) == "HTTP/1.1 200 OK"
        a.settimeout(10)
        t0 = time.monotonic()
        assert a.recv(1) == b""  # the server closed the idle connection
        assert time.monotonic() - t0 < 5
        a.close()
    finally:
        srv.should_exit = True


def test_default_keep_alive_outlives_common_clients_idle_expiry() -> None:
    """The server's idle timeout must outlive the client's (else the client reuses a
    connection the server is closing): httpx's default pool expiry, read from httpx,
    and the 60 s of nginx's upstream ``keepalive_timeout`` and AWS ALB's idle timeout
    (docs/serving.md, Keep-alive)."""
    pool = httpx.AsyncHTTPTransport()._pool
    httpx_expiry = float(pool._keepalive_expiry or 0.0)
    default = SecurityConfig().keep_alive_timeout_s
    assert default > httpx_expiry
    assert default > 60.0
    assert uvicorn_limits(SecurityConfig())["timeout_keep_alive"] == default
    assert uvicorn_limits(SecurityConfig())["http"] is IdleOnlyH11Protocol
