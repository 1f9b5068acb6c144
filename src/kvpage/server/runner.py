"""Running the app under uvicorn: in the foreground (``kvpage serve``) or in a thread.

:class:`BackgroundServer` starts a real uvicorn server on a loopback socket it binds
itself (port 0 = a free port chosen by the OS, so there is no race between picking a
port and binding it) and stops it on exit; tests and the load benchmark use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from typing import Any, Literal, TypedDict

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.server import ServerState

from kvpage.errors import got_repr
from kvpage.server.config import SecurityConfig, ServerConfig
from kvpage.server.protocol import error_body

__all__ = [
    "BackgroundServer",
    "IdleOnlyH11Protocol",
    "prepare_serving_process",
    "run_server",
    "unread_bytes",
    "uvicorn_limits",
]


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for ``transport``'s socket that the event loop has not
    read yet (``FIONREAD``); 0 when unknown (no socket, or a platform without it)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        import fcntl
        import struct
        import termios

        buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        return int(struct.unpack("i", buf)[0])
    except (ImportError, OSError, ValueError):
        return 0


class IdleOnlyH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose keep-alive timeout closes only *idle* connections.

    uvicorn arms a timer of ``timeout_keep_alive`` when a response completes and cancels
    it when the connection's next bytes are read. Under uvloop (uvicorn's default loop
    when installed) an iteration runs the due timers *before* it polls the sockets, so
    when the loop is busy past the moment the timer falls due (an engine output batch, a
    garbage collection, a long I/O callback), a request that reached the socket in the
    meantime is still unread when the timer closes the connection: the client sees the
    connection closed with no status line, and the server has no record of the request
    (reproduced in tests/server/test_keep_alive.py). nginx and envoy close only idle
    connections; this does the same: when the timer fires with bytes waiting in the
    socket (:func:`unread_bytes`), the timer is re-armed and the bytes are served as
    the request they are.

    The remaining race is the one no server can close: a client that sends on a
    connection at the moment the server's idle timeout closes it. Only the client
    avoids it, by expiring its idle connections first (``keep_alive_timeout_s``,
    docs/serving.md "Keep-alive").
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],  # uvicorn's own (the lifespan state)
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        #: the parser's last refusal of the client's bytes (its reason, for the 4xx)
        self.framing_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def recorded() -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self.framing_error = e
                raise

        self.conn.next_event = recorded  # type: ignore[method-assign]

    def send_400_response(self, msg: str) -> None:
        """The parser (h11) refused the request's framing (a bad ``Content-Length``, a
        ``Transfer-Encoding`` other than chunked, a malformed request line or chunk):
        answer the documented OpenAI error body with the parser's reason and status
        hint (400, 431 or 501; uvicorn's own answer is a plain-text 400), then close.
        A request whose response has already started cannot be answered: only closed."""
        err = self.framing_error
        status = int(getattr(err, "error_status_hint", 400) or 400)
        why = str(err) if err is not None else msg
        body = json.dumps(
            error_body(
                f"request: expected a valid HTTP/1.1 request, got {got_repr(why)} "
                "(refused by the HTTP parser)",
                type="invalid_request_error",
                code="invalid_framing",
            )
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            reason = STATUS_PHRASES.get(status, b"")
            self.transport.write(
                self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
                or b""
            )
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            pass  # a response was under way: the HTTP layer allows no second one
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing() and unread_bytes(self.transport) > 0:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()


class UvicornLimits(TypedDict):
    """``uvicorn.Config`` keyword arguments of the HTTP limits (:func:`uvicorn_limits`)."""

    http: type[H11Protocol]
    h11_max_incomplete_event_size: int
    timeout_keep_alive: int  # seconds (a float: see uvicorn_limits)
    server_header: bool


def uvicorn_limits(security: SecurityConfig) -> UvicornLimits:
    """uvicorn settings of the HTTP limits: the h11 parser (its incomplete-event limit
    bounds the request line plus headers to ``max_header_bytes``; the protocol is
    :class:`IdleOnlyH11Protocol`) and the keep-alive timeout of idle connections."""
    return {
        "http": IdleOnlyH11Protocol,
        "h11_max_incomplete_event_size": security.max_header_bytes,
        # uvicorn annotates int but only passes it to loop.call_later: seconds, a float
        "timeout_keep_alive": security.keep_alive_timeout_s,  # type: ignore[typeddict-item]
        "server_header": False,
    }


#: GIL switch interval of a ``kvpage serve`` process (Python's default is 5 ms): the
#: event loop thread (``/health``, streams) gets the GIL within about this long when the
#: engine thread is computing
SWITCH_INTERVAL_S = 0.001


#: modules the serving path otherwise imports lazily, on the event loop, at first use:
#: anyio's asyncio backend (Starlette's first ``request.is_disconnected()``) and
#: ``numpy.ma`` (NumPy imports it inside the first ``np.percentile``, the degradation
#: controller's p99); each import was one stall of the loop of tens to hundreds of ms
PREIMPORT = ("anyio._backends._asyncio", "numpy.ma")


def prepare_serving_process(app: Starlette | None = None) -> None:
    """Make the first requests as cheap as the later ones, and full garbage collections
    short. Called by :func:`run_server` once the app (and in thread mode the engine) is
    built, before serving; the load benchmark calls it too.

    1. Imports :data:`PREIMPORT` (first-use imports on the event loop, found by tracing
       the loop's stalls under the load test).
    2. Starts every worker of ``app``'s tokenizer pool: ``ThreadPoolExecutor`` starts
       a worker on a submit, and ``Thread.start`` waits until the new thread runs,
       which is one more wait of the event loop for the OS scheduler.
    3. Runs one full collection, then ``gc.freeze()``: every object alive now (the
       imports, the app, a thread-mode engine and its model) moves to the collector's
       permanent generation, so no later collection scans it. Measured in the server
       process under the load test: full collections of 230-800 ms each, each a stall
       of the event loop (``/health`` included); vLLM's engine core freezes its
       start-up heap for the same reason. Cost: cyclic garbage made of frozen objects is
       not collected while serving (there is none now: the collection just ran); an
       ``atexit`` hook unfreezes the heap before the interpreter's last collection.
    """
    import atexit
    import gc
    import importlib

    for name in PREIMPORT:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    serving = getattr(getattr(app, "state", None), "serving", None)
    pool = getattr(serving, "tokenize_pool", None)
    workers = int(getattr(pool, "_max_workers", 0) or 0)
    if pool is not None and workers > 0:
        # each task waits for all of them, so each needs its own new thread
        barrier = threading.Barrier(workers)
        for fut in [pool.submit(barrier.wait, 30.0) for _ in range(workers)]:
            fut.result()
    gc.collect()
    gc.freeze()
    # unfrozen again at exit, before the interpreter's final collection: extensions that
    # check for leaks then (triton's nanobind) would report frozen cycles as leaked
    atexit.register(gc.unfreeze)


def bind_listener(host: str, port: int, what: str = "port") -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6 as ``host`` resolves).

    Bound *before* the model loads, so a busy port fails in a second with one line
    instead of after the weights are read; uvicorn then serves on this socket.

    Raises:
        SpecError: the address is in use or cannot be bound.
    """
    from kvpage.errors import SpecError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise SpecError(
            f"host: expected an address this machine can bind, got {host!r} ({e})"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SpecError(
            f"{what}: expected a free port on {host}, got {port} ({e.strerror or e})"
        ) from None
    return sock


def run_server(config: ServerConfig, app: Starlette | None = None) -> None:
    """Serve ``app`` (built from ``config`` when None) on ``config.host:config.port``
    and, with ``security.metrics_port``, ``/metrics`` on ``metrics_host:metrics_port``;
    blocks.

    Raises:
        SpecError: an unauthenticated server asked to bind a non-loopback address
            (see :func:`kvpage.server.security.check_bind`), or a bad keys file.
    """
    from kvpage.server.auth import Authenticator
    from kvpage.server.resolved import warn_if_elsewhere
    from kvpage.server.security import check_bind

    # the keys file (mode, contents) first: no "API keys required" line before a refusal
    Authenticator(config.security)
    check_bind(config, config.security.auth_enabled)  # before the engine is built
    warn_if_elsewhere(config)
    listener, side_listener = _bind_listeners(config)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if app is None:
        app = _build_app_or_close(config, listener, side_listener)
    prepare_serving_process(app)
    limits = uvicorn_limits(config.security)
    main = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=30,  # in-flight streams get 30 s to finish, then cut
            **limits,
        )
    )
    metrics_app = getattr(app.state, "metrics_app", None)
    if metrics_app is None or side_listener is None:
        if side_listener is not None:
            side_listener.close()
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises SIGINT after shutdown
            main.run(sockets=[listener])
        return
    _serve_with_metrics(config, main, listener, metrics_app, side_listener, limits)


def _bind_listeners(config: ServerConfig) -> tuple[socket.socket, socket.socket | None]:
    """The API socket and, with ``security.metrics_port``, the metrics socket (None
    without); a failure to bind the second closes the first."""
    listener = bind_listener(config.host, config.port)
    if config.security.metrics_port is None:
        return listener, None
    try:
        side = bind_listener(
            config.security.metrics_host, config.security.metrics_port, "metrics_port"
        )
    except BaseException:
        listener.close()
        raise
    return listener, side


def _build_app_or_close(
    config: ServerConfig, listener: socket.socket, side_listener: socket.socket | None
) -> Starlette:
    """:func:`kvpage.server.app.create_app` of ``config``; the bound sockets are closed
    when it raises."""
    from kvpage.server.app import create_app

    try:
        return create_app(config)
    except BaseException:
        listener.close()
        if side_listener is not None:
            side_listener.close()
        raise


def _serve_with_metrics(
    config: ServerConfig,
    main: uvicorn.Server,
    listener: socket.socket,
    metrics_app: Starlette,
    side_listener: socket.socket,
    limits: UvicornLimits,
) -> None:
    """Run ``main`` on ``listener`` and ``metrics_app`` on ``side_listener`` in one
    event loop until ``main`` exits (the metrics server is then told to exit too)."""
    side = uvicorn.Server(
        uvicorn.Config(
            metrics_app,
            host=config.security.metrics_host,
            port=config.security.metrics_port or 0,
            log_level=config.log_level,
            lifespan="off",
            **limits,
        )
    )

    async def both() -> None:
        task = asyncio.create_task(side.serve(sockets=[side_listener]))
        try:
            await main.serve(sockets=[listener])
        finally:
            side.should_exit = True
            await task

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(both())


class BackgroundServer:
    """A uvicorn server for ``app`` in a daemon thread, bound to ``host`` (loopback).

    Use as a context manager; ``base_url`` is ``http://127.0.0.1:PORT``.

    Raises:
        RuntimeError: the server did not start within ``start_timeout_s``.
    """

    def __init__(
        self,
        app: Starlette,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 60.0,
        lifespan: Literal["auto", "on", "off"] = "on",
    ) -> None:
        self.app = app
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are
        # TCP; with proto 0 every response body waited for the client's delayed ACK
        # (~40 ms per request on Linux)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        serving = getattr(getattr(app, "state", None), "serving", None)
        if serving is not None:  # the app's own HTTP limits
            cfg = uvicorn.Config(
                app,
                log_level="warning",
                lifespan=lifespan,
                timeout_graceful_shutdown=5,
                **uvicorn_limits(serving.config.security),
            )
        else:
            cfg = uvicorn.Config(
                app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=5
            )
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
