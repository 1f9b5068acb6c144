"""HTTP hygiene in front of the app: authentication, content type, body size, timeouts.

:class:`HTTPGuard` is a plain ASGI middleware (no framework import) wrapped around the
FastAPI app. For every HTTP request, before any routing or body parsing:

0. Request headers above ``max_header_bytes`` in all get 431.
1. ``/v1/...`` routes need a valid API key when keys are configured (401 otherwise);
   ``/metrics`` needs an operator key (see :class:`kvpage.server.auth.Authenticator`).
   The authenticated :class:`~kvpage.server.auth.Tenant` is put in
   ``scope["state"]["kvpage_tenant"]`` (``request.state.kvpage_tenant``).
2. A ``POST`` must send ``Content-Type: application/json`` (415 otherwise): a web page
   can send ``text/plain`` to ``127.0.0.1`` without a CORS preflight, but not JSON.
3. The body is read here, at most ``max_body_bytes`` (413, from ``Content-Length`` at
   once or while a chunked body arrives) within ``body_timeout_s`` (408), then replayed
   to the app; later ``receive`` calls (disconnect detection) go to the client. A body
   declared too large is read and dropped (up to 16x the limit, so the client can read
   the 413) without being kept.
4. Every ``send`` of the response must complete within ``send_timeout_s``: a client
   that stops reading a stream is cut off (the stream's cleanup aborts its request and
   frees its blocks) instead of holding its admission forever.

Refusals have OpenAI's error body and are counted in
``kvpage:server_requests_rejected_total{reason}`` with a fixed set of reasons
(``unauthenticated``, ``unsupported_media_type``, ``body_too_large``, ``body_timeout``,
``headers_too_large``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from kvpage.errors import got_repr
from kvpage.server.auth import Authenticator, bearer_token, is_loopback_host
from kvpage.server.config import SecurityConfig
from kvpage.server.protocol import error_body

__all__ = ["HTTPGuard"]

logger = logging.getLogger("kvpage.server.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Refusal(Exception):
    def __init__(
        self, status: int, message: str, type: str, code: str, reason: str, **headers: str
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.reason = reason
        self.headers = headers


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


class _Headers:
    def __init__(self, scope: Scope) -> None:
        self._scope = scope

    def get(self, name: str, default: str = "") -> str:
        v = _header(self._scope, name.encode("latin-1"))
        return default if v is None else v


class HTTPGuard:
    """ASGI middleware enforcing authentication and HTTP limits (see module docstring).

    Args:
        app: the wrapped ASGI app.
        security: limits and timeouts.
        auth: the key table (``auth.enabled`` False: no key is required).
        on_refusal: called with the reason of every refusal (metrics).
        metrics_need_key: whether ``/metrics`` on this listener needs a key.
        loopback_host_only: refuse (400) a request whose ``Host`` header names anything
            but a loopback address or ``localhost``: set for an unauthenticated server on
            loopback, where a web page could otherwise reach it by DNS rebinding (its
            own name resolving to 127.0.0.1).
        health: answers ``GET /health`` here, before routing, as ``(status, body)``
            (cheap: no framework work while the server is loaded); None = the app does.
    """

    def __init__(
        self,
        app: ASGIApp,
        security: SecurityConfig,
        auth: Authenticator,
        on_refusal: Callable[[str], None] | None = None,
        metrics_need_key: bool = True,
        health: Callable[[], tuple[int, dict[str, Any]]] | None = None,
        loopback_host_only: bool = False,
    ) -> None:
        self.app = app
        self.security = security
        self.auth = auth
        self._on_refusal = on_refusal
        self._metrics_need_key = metrics_need_key
        self._health = health
        self._loopback_host_only = loopback_host_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            _check_headers(scope, self.security.max_header_bytes)
            if self._health is not None and scope["path"] == "/health" and scope["method"] == "GET":
                status, payload = self._health()
                await _send_json(send, status, payload)
                return
            if self._loopback_host_only:
                _check_loopback_host(scope)
            self._authenticate(scope)
            if scope["method"] == "POST":
                _check_content_type(scope)
                body = await self._read_body(scope, receive)
                receive = _replay(body, receive)
        except _Refusal as r:
            if self._on_refusal is not None and r.reason != "client_gone":
                self._on_refusal(r.reason)
            await _send_error(send, r)
            return
        await self.app(scope, receive, self._timed_send(send))

    # ------------------------------------------------------------------ steps
    def _authenticate(self, scope: Scope) -> None:
        path: str = scope.get("path", "")
        # every route that reaches the model or the tokenizer needs a key (vLLM's own
        # check covers /v1 only; /tokenize and /detokenize cost tokenizer time too)
        api = path.startswith("/v1/") or path in ("/v1", "/tokenize", "/detokenize")
        metrics = path == "/metrics"
        if not self.auth.enabled or not (api or (metrics and self._metrics_need_key)):
            return
        token = bearer_token(_Headers(scope))
        tenant = self.auth.authenticate(token)
        if tenant is not None and metrics and self.auth.has_operator_keys and not tenant.operator:
            raise _Refusal(
                403,
                "Authorization: expected an operator's key for /metrics, got a tenant's key",
                "invalid_request_error",
                "operator_key_required",
                "forbidden",
            )
        if tenant is not None and api and tenant.cache_id == "":
            tenant = None  # a metrics-only key
        if tenant is None:
            header = _header(scope, b"authorization")
            if token is not None:
                what = "an unknown key"
            elif header is None or not header.strip():
                what = "no Authorization header"
            else:
                # name a standard scheme (Basic, Digest ...), never echo anything else:
                # a client may have put its key where the scheme goes
                scheme = header.split(maxsplit=1)[0]
                named = scheme.isalpha() and len(scheme) <= 16
                what = (
                    "no token"
                    if " " not in header.strip()
                    else f"the {scheme!r} scheme"
                    if named
                    else "another scheme"
                )
            raise _Refusal(
                401,
                f"Authorization: expected 'Bearer <a valid API key>'"
                f"{' of an operator' if metrics and self.auth.has_operator_keys else ''}, "
                f"got {what}",
                "invalid_request_error",
                "invalid_api_key",
                "unauthenticated",
                **{"WWW-Authenticate": "Bearer"},
            )
        scope.setdefault("state", {})["kvpage_tenant"] = tenant

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.security.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await self._discard(receive, int(declared))
            raise _too_large(limit, f"Content-Length {int(declared)}")
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise _Refusal(400, "body: client disconnected", "", "", "client_gone")
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit, f"at least {size} bytes")
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    return

        try:
            await asyncio.wait_for(read(), self.security.body_timeout_s)
        except asyncio.TimeoutError:
            raise _Refusal(
                408,
                f"body: expected the request body within {self.security.body_timeout_s:g}s, "
                f"got {size} bytes",
                "invalid_request_error",
                "request_timeout",
                "body_timeout",
                Connection="close",
            ) from None
        return b"".join(chunks)

    async def _discard(self, receive: Receive, declared: int) -> None:
        """Read and drop a refused body of up to ``16 x max_body_bytes`` (bounded by
        ``body_timeout_s``) so that a client still sending it can read the 413; larger
        bodies are not read (the connection closes after the 413)."""
        if declared > 16 * self.security.max_body_bytes:
            return

        async def drain() -> None:
            while True:
                msg = await receive()
                if msg["type"] != "http.request" or not msg.get("more_body", False):
                    return

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(drain(), self.security.body_timeout_s)

    def _timed_send(self, send: Send) -> Send:
        timeout = self.security.send_timeout_s

        async def timed(msg: Message) -> None:
            try:
                await asyncio.wait_for(send(msg), timeout)
            except asyncio.TimeoutError:
                logger.warning("http: client did not read the response for %gs; cut", timeout)
                raise OSError(f"send: expected the client to read within {timeout:g}s") from None

        return timed


def _too_large(limit: int, got: str) -> _Refusal:
    return _Refusal(
        413,
        f"body: expected at most {limit} bytes, got {got}",
        "invalid_request_error",
        "request_too_large",
        "body_too_large",
        Connection="close",
    )


def _check_headers(scope: Scope, limit: int) -> None:
    # h11 bounds headers that arrive in pieces (max_incomplete_event_size); headers that
    # arrive in one read are complete events it does not bound, so count them here too
    size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
    if size > limit:
        raise _Refusal(
            431,
            f"headers: expected at most {limit} bytes, got {size}",
            "invalid_request_error",
            "headers_too_large",
            "headers_too_large",
            Connection="close",
        )


def _check_loopback_host(scope: Scope) -> None:
    """400 unless the ``Host`` header names a loopback address or ``localhost`` (DNS
    rebinding: a page whose own name resolves to 127.0.0.1 sends its name as Host)."""
    host = _header(scope, b"host") or ""
    try:  # "name", "name:port", "[v6]:port" -> name (the URL parser's own rules)
        name = urlsplit("//" + host).hostname or ""
    except ValueError:  # e.g. a bad port
        name = ""
    if not is_loopback_host(name):
        raise _Refusal(
            400,
            f"Host: expected a loopback name (localhost, 127.0.0.1, [::1]) on a server "
            f"without API keys (DNS rebinding), got {host[:100]!r}",
            "invalid_request_error",
            "invalid_host",
            "invalid_host",
        )


def _check_content_type(scope: Scope) -> None:
    """415 unless the POST is JSON in UTF-8 (``charset`` absent or ``utf-8``, RFC 8259)
    without a content coding (``Content-Encoding`` absent or ``identity``: none is
    decoded here, RFC 9110 8.4: 415 for an unsupported coding); a POST without a body
    (no Content-Type, no Content-Length or 0, not chunked: e.g. vLLM's ``POST /ping``)
    carries nothing to misread and passes. 400 for a request framed by both
    ``Content-Length`` and ``Transfer-Encoding`` (RFC 9112 6.3: a smuggling vector;
    the connection closes)."""
    if _header(scope, b"transfer-encoding") is not None and (
        _header(scope, b"content-length") is not None
    ):
        raise _Refusal(
            400,
            "Content-Length: expected no Content-Length with Transfer-Encoding "
            "(RFC 9112 6.3), got both",
            "invalid_request_error",
            "invalid_framing",
            "invalid_framing",
            Connection="close",
        )
    ctype = _header(scope, b"content-type")
    if ctype is None and _header(scope, b"transfer-encoding") is None:
        length = (_header(scope, b"content-length") or "0").strip()
        if length == "0":
            return
    media, _, params = (ctype or "").partition(";")
    if media.strip().lower() != "application/json":
        raise _Refusal(
            415,
            f"Content-Type: expected application/json, got {got_repr(ctype or 'none')}",
            "invalid_request_error",
            "unsupported_media_type",
            "unsupported_media_type",
        )
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
            if charset not in ("utf-8", "utf8"):
                raise _Refusal(
                    415,
                    f"Content-Type: expected charset utf-8 (JSON is UTF-8, RFC 8259), "
                    f"got charset {got_repr(value.strip())}",
                    "invalid_request_error",
                    "unsupported_media_type",
                    "unsupported_charset",
                )
    coding = _header(scope, b"content-encoding")
    if coding is not None and coding.strip().lower() not in ("", "identity"):
        raise _Refusal(
            415,
            f"Content-Encoding: expected identity (no content coding is decoded), "
            f"got {got_repr(coding.strip())}",
            "invalid_request_error",
            "unsupported_media_type",
            "unsupported_content_encoding",
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, r: _Refusal) -> None:
    if r.reason == "client_gone":
        return
    await _send_json(send, r.status, error_body(r.message, type=r.type, code=r.code), r.headers)


async def _send_json(
    send: Send, status: int, body: Any, extra_headers: dict[str, str] | None = None
) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
