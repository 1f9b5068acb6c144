"""Operator routes: who may call them, and ``GET /admin/config``.

:func:`operator_refusal` is the rule of every ``/admin/*`` route and of ``/metrics``:
with API keys configured the caller needs an operator key (``metrics_api_keys`` or a
keys-file tenant with ``operator: true``), or any valid key when no operator key
exists; no or an unknown key -> 401 ``invalid_api_key``, a tenant's key -> 403
``operator_key_required``. Without keys the routes are open (a loopback-only or
``--allow-unauthenticated`` server, as ``/metrics``).

``GET /admin/config`` answers the running server's effective configuration
(``ServingState.effective_config``): ``{"config": <the config file>, "machines":
{...}}`` -- the config file as ``--dump-config --resolved`` would write it (secrets
never included) with what start-up decided pinned, and the facts of the machine(s)
it runs on (``kvpage.server.resolved.machine_facts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvpage.server import protocol as P
from kvpage.server.auth import Authenticator, bearer_token

if TYPE_CHECKING:
    from kvpage.server.service import ServingState

__all__ = ["operator_refusal", "register_config_route"]


def operator_refusal(auth: Authenticator, request: Request) -> JSONResponse | None:
    """The error response for a caller that may not use an operator route, or None.

    Args:
        auth: the server's :class:`~kvpage.server.auth.Authenticator`.
        request: the HTTP request (its ``Authorization`` header).
    """
    if not auth.enabled:
        return None
    tenant = auth.authenticate(bearer_token(request.headers))
    if tenant is None:
        return JSONResponse(
            P.error_body(
                "Authorization: expected 'Bearer <a valid API key>' of an operator",
                code="invalid_api_key",
            ),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    if auth.has_operator_keys and not tenant.operator:
        # a valid key without the right: 403, as /metrics answers it
        return JSONResponse(
            P.error_body(
                f"Authorization: expected an operator's key for {request.url.path}, "
                "got a tenant's key",
                code="operator_key_required",
            ),
            status_code=403,
        )
    return None


def register_config_route(app: FastAPI, state: ServingState) -> None:
    """Add ``GET /admin/config`` (see module doc) answering ``state.effective_config()``."""

    @app.get("/admin/config")
    async def admin_config(request: Request) -> JSONResponse:
        bad = operator_refusal(state.auth, request)
        return bad if bad is not None else JSONResponse(state.effective_config())
