"""Wiring of the security features into the app: middleware, /metrics, bind checks.

* :func:`install_security` wraps the FastAPI app in :class:`~kvpage.server.http_limits.HTTPGuard`
  (authentication, content type, body limits, timeouts) and, only when
  ``allowed_origins`` is set, Starlette's ``CORSMiddleware``.
* :func:`create_metrics_app` is the separate ``/metrics`` listener
  (``--metrics-host/--metrics-port``).
* :func:`request_tenant` is a request's tenant: the authenticated one, or on a server
  without keys the client-chosen label (:func:`kvpage.server.auth.unauthenticated_tenant`).
* :func:`check_bind` refuses an unauthenticated non-loopback bind and logs the mode.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvpage.errors import SpecError
from kvpage.server.auth import Tenant, bearer_token, is_loopback_host, unauthenticated_tenant
from kvpage.server.config import ServerConfig
from kvpage.server.http_limits import HTTPGuard

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from kvpage.server.service import ServingState

__all__ = [
    "check_bind",
    "create_metrics_app",
    "install_security",
    "may_see_topology",
    "metrics_response",
    "request_tenant",
]

logger = logging.getLogger("kvpage.server")


def install_security(app: FastAPI, state: ServingState) -> None:
    """Add the HTTP guard (and CORS when configured) to ``app`` (a FastAPI app).

    Args:
        app: the FastAPI app.
        state: its :class:`~kvpage.server.service.ServingState` (auth, metrics, config).
    """
    sec = state.config.security
    app.add_middleware(
        HTTPGuard,
        security=sec,
        auth=state.auth,
        on_refusal=lambda reason: state.metrics.count_rejected(reason),
        metrics_need_key=sec.metrics_port is None,
        health=state.health,
        loopback_host_only=not state.auth.enabled and is_loopback_host(state.config.host),
    )
    if sec.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(sec.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )


def metrics_response(state: ServingState) -> Response:
    """The ``GET /metrics`` response: gauges refreshed, the registry in Prometheus text."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.responses import Response

    state.tick_gauges()
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_metrics_app(state: ServingState) -> Starlette:
    """A minimal ASGI app serving only ``GET /metrics`` from ``state``'s registry.

    Runs without lifespan (the main app owns the engine loop); meant for a listener
    bound to an operator-only address (``security.metrics_host``, default 127.0.0.1).
    """
    from starlette.applications import Starlette
    from starlette.routing import Route

    async def metrics(request: Request) -> Response:
        return metrics_response(state)

    app = Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])
    app.router.redirect_slashes = False  # "/metrics/" is a 404, not a redirect
    return app


def request_tenant(request: Request, user: str | None) -> Tenant:
    """The tenant of ``request``: set by the guard when keys are configured, else the
    Bearer token / ``user`` / ``"anonymous"`` label of an unauthenticated server."""
    tenant = getattr(request.state, "kvpage_tenant", None)
    if isinstance(tenant, Tenant):
        return tenant
    return unauthenticated_tenant(bearer_token(request.headers), user)


def may_see_topology(state: ServingState, request: Request) -> bool:
    """Whether ``request``'s caller may be told which replica group and replica served
    it (the ``X-KVPage-Group`` / ``X-KVPage-Replica`` headers): the rule of
    ``/metrics``, which exports the same facts -- an operator key, or any valid key when
    no operator key exists, or anyone on a server without keys. Tenants of a server
    with operator keys never see it: a canary share or a replica id is deployment
    state, and knowing it would let a tenant aim at one replica's prefix cache."""
    auth = state.auth
    if not auth.enabled:
        return True
    tenant = getattr(request.state, "kvpage_tenant", None)
    return isinstance(tenant, Tenant) and (tenant.operator or not auth.has_operator_keys)


def _silent(*_args: object) -> None:
    pass


def check_bind(config: ServerConfig, auth_enabled: bool, log: bool = True) -> None:
    """Refuse to expose an unauthenticated server; log the security mode (``log``;
    ``--dump-config`` runs the check without logging).

    Raises:
        SpecError: ``security.allow_unauthenticated`` is not set and either there is
            no API key and ``host`` is not a loopback address, or the separate /metrics
            listener (``metrics_port``) would bind a non-loopback ``metrics_host``.
    """
    sec = config.security
    metrics = (
        f"{sec.metrics_host}:{sec.metrics_port}" if sec.metrics_port is not None else "API port"
    )
    if (
        sec.metrics_port is not None
        and not is_loopback_host(sec.metrics_host)
        and not sec.allow_unauthenticated
    ):
        raise SpecError(
            "metrics_host: expected a loopback address (the separate /metrics listener "
            "takes no key, and its prefix-cache counters are a side channel; docs/serving.md "
            f"Security), or --allow-unauthenticated, got {sec.metrics_host!r}"
        )
    if not auth_enabled and not is_loopback_host(config.host) and not sec.allow_unauthenticated:
        raise SpecError(
            f"host: expected a loopback address without API keys (or "
            f"--allow-unauthenticated), got {config.host!r}; set --api-key/--api-keys-file"
        )
    # every refusal above comes before the first log line: a server that does not
    # start never says how it is configured
    info, warning = (logger.info, logger.warning) if log else (_silent, _silent)
    info(
        "kvpage serve: prefix cache scope %s; /metrics on %s; CORS origins %s",
        sec.prefix_cache_scope,
        metrics,
        list(sec.allowed_origins) or "none",
    )
    if auth_enabled:
        info("kvpage serve: API keys required on /v1/*, /tokenize, /detokenize")
        return
    warning(
        "kvpage serve: running WITHOUT authentication on %s (%s); tenants are client-chosen labels",
        config.host,
        "loopback only" if is_loopback_host(config.host) else "--allow-unauthenticated",
    )
