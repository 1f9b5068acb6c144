"""FastAPI application: the OpenAI-compatible routes, /health and /metrics.

``create_app(config, engine=..., sampling_params_cls=...)`` returns a FastAPI app whose
lifespan starts the background engine loop and the degradation ticker and stops both on
shutdown (aborting whatever is still running). ``build_engine(config)`` makes the real
``kvpage.engine.LLMEngine`` from the config's engine section.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and vLLM's
``/tokenize``, ``/detokenize``, ``/version``, ``/ping`` (``kvpage.server.utility_routes``). Every error is
an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpage.errors import GOT_REPR_MAX, RequestRejected, got_repr
from kvpage.server import protocol as P
from kvpage.server.admin_routes import register_config_route
from kvpage.server.config import ServerConfig
from kvpage.server.generate_route import _generate, _validation_message
from kvpage.server.generation import merged_placement, track_placements
from kvpage.server.openapi import install_openapi
from kvpage.server.security import (
    create_metrics_app,
    install_security,
    metrics_response,
)
from kvpage.server.service import APIError, ServingState, chat_template_name, rejection_error
from kvpage.server.utility_routes import register_utility_routes

if TYPE_CHECKING:
    from kvpage.engine import LLMEngine, SamplingParams
    from kvpage.server.engine_client import ServedEngine
    from kvpage.server.engine_process import EngineProcess

__all__ = ["build_engine", "create_app"]

logger = logging.getLogger("kvpage.server")


def build_engine(
    config: ServerConfig,
) -> tuple[LLMEngine | EngineProcess, type[SamplingParams]]:
    """Build the real engine from ``config.engine``; return ``(engine, SamplingParams)``.

    With ``config.engine_process`` the engine is built in a child process and the
    returned object is its :class:`kvpage.server.engine_process.EngineProcess` stand-in.
    """
    from kvpage.engine import LLMEngine, SamplingParams

    if config.engine_process:
        from kvpage.server.engine_process import EngineProcess

        proc = EngineProcess(
            config.engine.engine_kwargs(),
            log_level=config.log_level,
            niceness=config.engine_niceness,
        )
        return proc, SamplingParams
    return LLMEngine.from_config(**config.engine.engine_kwargs()), SamplingParams


#: ``error.code`` of routing errors (unknown route, wrong method), as docs/serving.md lists
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(
        P.error_body(e.message, type=e.type, param=e.param, code=e.code),
        status_code=e.status,
        headers=e.headers,
    )


def create_app(
    config: ServerConfig,
    engine: ServedEngine | None = None,
    sampling_params_cls: Callable[..., SamplingParams] | None = None,
    *,
    state: ServingState | None = None,
) -> FastAPI:
    """Create the server app.

    Args:
        config: server configuration (``config.engine`` is used only when ``engine`` is
            None).
        engine: the engine to serve (an ``LLMEngine`` or an :class:`EngineProcess`;
            :class:`~kvpage.server.engine_client.ServedEngine`); built with
            :func:`build_engine` when None.
        sampling_params_cls: the engine's ``SamplingParams``; required with ``engine``.
        state: a ready serving state to serve (then ``engine`` and
            ``sampling_params_cls`` are ignored): the scaled-out ingress passes its
            :class:`kvpage.cluster.ingress.ClusterState`, whose engine loop sends the
            requests to replicas.

    The serving state is available as ``app.state.serving`` (a :class:`ServingState`).
    With ``security.metrics_port`` set, ``/metrics`` is not served here but by
    ``app.state.metrics_app`` (run it on its own listener). The app is wrapped in the
    HTTP guard (:mod:`kvpage.server.http_limits`): API keys, body and content-type limits.
    """
    # constraints are checked with xgrammar in the request handlers: import it here,
    # not on the event loop during the first constrained request
    from kvpage.engine.structured import preload

    preload()
    if state is None:
        state = _serving_state(config, engine, sampling_params_cls)
    # redirect_slashes=False: "/tokenize/" is an unknown route (404, OpenAI body), never
    # an empty 307 whose Location is built from the client's Host header
    app = FastAPI(
        title="kvpage",
        lifespan=_lifespan(state),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.state.serving = state
    app.state.metrics_app = (
        create_metrics_app(state) if config.security.metrics_port is not None else None
    )
    install_security(app, state)
    install_openapi(app, config.model_name)
    _install_error_handlers(app)
    _register_routes(app, state)
    return app


def _register_routes(app: FastAPI, state: ServingState) -> None:
    """Every route of the API: generation, models, utilities, the effective config and
    (unless a metrics port serves it) ``/metrics``."""
    _register_generation_routes(app, state)
    _register_model_routes(app, state)
    register_utility_routes(app, state, _validation_message)
    register_config_route(app, state)

    if app.state.metrics_app is None:

        @app.get("/metrics")
        async def metrics() -> Response:
            return metrics_response(state)


def _serving_state(
    config: ServerConfig,
    engine: ServedEngine | None,
    sampling_params_cls: Callable[..., SamplingParams] | None,
) -> ServingState:
    """The serving state over ``engine`` (built from ``config`` when None); an engine
    process is closed when the state cannot be built (it does not outlive us).

    Raises:
        TypeError: ``engine`` given without ``sampling_params_cls``.
    """
    if engine is None:
        engine, sampling_params_cls = build_engine(config)
    if sampling_params_cls is None:
        raise TypeError("sampling_params_cls: expected a SamplingParams class, got None")
    try:
        return ServingState(config, engine, sampling_params_cls)
    except BaseException:
        from kvpage.server.engine_spawn import SpawnedEngine

        if isinstance(engine, SpawnedEngine):
            engine.close()
        raise


def _lifespan(
    state: ServingState,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine loop and the degradation ticker run while it is
    open; at its end both stop and the tokenize pool shuts down."""
    config, engine = state.config, state.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start(asyncio.get_running_loop())
        ticker = asyncio.create_task(_tick(state))
        logger.info(
            "kvpage serve: model %s, %d blocks x %d tokens, backend %s",
            config.model_name,
            engine.cache_spec.num_blocks,
            engine.cache_spec.block_size,
            engine.backend_name,
        )
        try:
            yield
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            await asyncio.to_thread(state.loop.stop)
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _install_error_handlers(app: FastAPI) -> None:
    """Every error is answered with an OpenAI error body (:func:`_error`)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, str(exc.status_code))
        path = request.url.path
        if len(path) > GOT_REPR_MAX:  # the path is the client's: quote it bounded
            path = f"{path[:GOT_REPR_MAX]}... ({len(path)} characters)"
        return _error(APIError(exc.status_code, f"{path}: {exc.detail}", code=code))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("kvpage serve: unhandled error on %s", request.url.path)
        return _error(
            APIError(500, f"server: internal error ({type(exc).__name__})", type="server_error")
        )


def _register_generation_routes(app: FastAPI, state: ServingState) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions`` (:func:`_generate`), counted
    by endpoint, status and placement."""

    async def handle(request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == "chat" else "completions"
        m = state.metrics
        with track_placements() as placed:
            try:
                try:
                    resp = await _generate(state, request, kind)
                except RequestRejected as exc:  # defensive: every refusal is a 4xx
                    raise rejection_error(exc) from None
            except APIError as e:
                where = merged_placement(placed)
                m.count_rejected(e.reason, where)
                m.count_request(endpoint, e.status, where)
                return _error(e)
            except Exception:
                m.count_request(endpoint, 500, merged_placement(placed))
                raise  # answered by the generic 500 handler
            m.count_request(endpoint, resp.status_code, merged_placement(placed))
        return resp

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")


def _register_model_routes(app: FastAPI, state: ServingState) -> None:
    """``GET /v1/models``, ``/v1/models/{id}`` and ``/health``."""
    config = state.config
    started = int(time.time())  # /v1/models "created": when this server started (Unix s)

    def model_card() -> dict[str, Any]:
        return {
            "id": config.model_name,
            "object": "model",
            "created": started,
            "owned_by": "kvpage",
            "max_model_len": state.max_model_len,
            # kvpage extension: what a request that sets none of them gets
            "chat_template": chat_template_name(state),
            "generation_defaults": dict(state.sampling_defaults),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        # OpenAI's "retrieve model"; the openai client's models.retrieve() calls it
        if model_id == config.model_name:
            return JSONResponse(model_card())
        if not model_id:  # "/v1/models/": a trailing slash is an unknown route, as elsewhere
            raise StarletteHTTPException(404, "Not Found")
        raise P.APIError(
            404,
            f"model: expected {config.model_name!r}, got {got_repr(model_id)}",
            code="model_not_found",
            param="model",
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        # normally answered by the HTTP guard before routing (same function)
        status, body = state.health()
        return JSONResponse(body, status_code=status)


async def _tick(state: ServingState) -> None:
    interval = state.config.degradation.eval_interval_s
    while True:  # ends when the lifespan cancels it
        await asyncio.sleep(interval)
        try:
            state.tick()
        except Exception:
            logger.exception("kvpage serve: degradation tick failed")
