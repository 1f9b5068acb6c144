"""Admin routes of the scaled-out ingress: the canary traffic share (``/admin/config``,
the effective configuration of the ingress and each group, is the server's own route,
:mod:`kvpage.server.admin_routes`, answering ``ClusterState.effective_config``).

``GET /admin/canary`` -> ``{"traffic_fraction": f, "groups": [...]}``;
``POST /admin/canary`` with ``{"traffic_fraction": f}`` sets it (0 = roll back) for
requests arriving afterwards; requests in flight finish on the replica they are on.
With API keys configured these need an operator key (the rule of ``/metrics``: an
operator key, or any valid key when no operator key exists): no or an unknown key ->
401 ``invalid_api_key``, a tenant's key -> 403 ``operator_key_required`` (as
``/metrics``); errors are the server's OpenAI-style bodies.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvpage.errors import got_repr
from kvpage.server import protocol as P
from kvpage.server.admin_routes import operator_refusal
from kvpage.server.protocol import APIError
from kvpage.server.validation import check_duplicate_keys

__all__ = ["register_admin_routes"]


def _err(status: int, message: str, param: str | None = None, code: str | None = None) -> Any:
    return JSONResponse(P.error_body(message, param=param, code=code), status_code=status)


def register_admin_routes(app: FastAPI, state: Any, ingress: Any) -> None:
    """Add ``/admin/canary`` to ``app`` (see module doc).

    Args:
        app: the ingress app.
        state: its serving state (``auth``).
        ingress: the :class:`~kvpage.cluster.ingress.Ingress` (``selector``,
            ``set_canary``).
    """

    def refused(request: Request) -> Any:
        return operator_refusal(state.auth, request)

    def current() -> dict[str, Any]:
        return {
            "traffic_fraction": ingress.selector.canary_fraction,
            "groups": sorted(ingress.handles),
        }

    @app.get("/admin/canary")
    async def get_canary(request: Request) -> Any:
        bad = refused(request)
        return bad if bad is not None else current()

    @app.post("/admin/canary")
    async def set_canary(request: Request) -> Any:
        bad = refused(request)
        if bad is not None:
            return bad
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return _err(400, f"body: expected valid JSON, got invalid JSON ({exc})")
        try:
            check_duplicate_keys(raw)
        except APIError as e:
            return _err(e.status, e.message, param=e.param, code=e.code)
        if not isinstance(body, dict) or set(body) != {"traffic_fraction"}:
            return _err(
                400,
                f'body: expected {{"traffic_fraction": <number in [0, 1]>}}, got {got_repr(body)}'[
                    :300
                ],
            )
        f = body["traffic_fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            return _err(
                400,
                f"traffic_fraction: expected a number in [0, 1], got {got_repr(f)}"[:200],
                param="traffic_fraction",
            )
        try:
            ingress.set_canary(float(f))
        except ValueError as exc:
            return _err(400, str(exc), param="traffic_fraction")
        return current()
