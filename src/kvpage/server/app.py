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
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpage.errors import RequestRejected
from kvpage.server import protocol as P
from kvpage.server.auth import request_priority, scoped_cache_salt
from kvpage.server.config import JSON_MAX_DEPTH, ServerConfig
from kvpage.server.multi_stream import stream_many
from kvpage.server.openapi import install_openapi
from kvpage.server.responses import (
    CAPPED_HEADER,
    ChoiceState,
    RequestResult,
    build_body,
    prompt_text,
    stream_chunk,
)
from kvpage.server.security import (
    create_metrics_app,
    install_security,
    metrics_response,
    request_tenant,
)
from kvpage.server.service import APIError, ServingState, Usage, rejection_error
from kvpage.server.utility_routes import register_utility_routes
from kvpage.server.validation import prepare_request

__all__ = ["build_engine", "create_app"]

logger = logging.getLogger("kvpage.server")


def build_engine(config: ServerConfig) -> tuple[Any, Callable[..., Any]]:
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


#: what a field accepts, for union-typed fields (pydantic reports one error per branch)
_ACCEPTS = {
    "prompt": "a string, a list of token ids (ints), a list of strings or a list of token-id lists",
    "stop": "a non-empty string or a list of them",
    "content": "a string or a list of text parts",
}


def _clean_loc(loc: Any) -> list[str]:
    # drop pydantic's union-branch tags ("str", "list[int]", "function-after[...]")
    out = []
    for x in loc:
        s = str(x)
        if isinstance(x, str) and ("[" in s or s in {"str", "int", "float", "bool", "dict"}):
            continue
        out.append(s)
    return out


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    err = errors[0]
    if err.get("type") == "json_invalid":
        if "recursion limit" in str(err.get("msg")):
            return f"body: expected JSON nested at most {JSON_MAX_DEPTH} levels, got deeper", None
        why = str(err.get("msg"))
        if "hex escape" in why or "surrogate" in why:  # e.g. a lone "\ud800"
            why += "; a \\u escape must be a whole character (a lone UTF-16 surrogate is not)"
        return f"body: expected valid JSON, got invalid JSON ({why})", None
    parts = _clean_loc(err.get("loc", ()))
    loc = ".".join(parts)
    got = err.get("input")
    got_s = "missing" if err.get("type") == "missing" else f"{type(got).__name__} {got!r}"[:200]
    msg = str(err.get("msg", "a valid value"))
    msg = msg.removeprefix("Input should be ").removeprefix("Value error, ")
    ctx = err.get("ctx") or {}
    field = parts[-1] if parts else ""
    if err.get("type") == "missing":
        msg = "a value (required field)"
    elif err.get("type") == "extra_forbidden":
        msg = "no such field (unknown field)"
    elif err.get("type") == "too_short":
        n = ctx.get("min_length", 1)
        msg = f"at least {n} item{'s' if n != 1 else ''}"
        got_s = f"{ctx.get('actual_length', len(got) if hasattr(got, '__len__') else '?')}"
    elif field in _ACCEPTS and (len(errors) > 1 or "[" in str(err.get("loc", ""))):
        msg = _ACCEPTS[field]
        got_s = f"{type(got).__name__} {got!r}"[:200]
    return f"{loc or 'body'}: expected {msg}, got {got_s}", loc or None


def create_app(
    config: ServerConfig,
    engine: Any | None = None,
    sampling_params_cls: Callable[..., Any] | None = None,
    *,
    state: ServingState | None = None,
) -> FastAPI:
    """Create the server app.

    Args:
        config: server configuration (``config.engine`` is used only when ``engine`` is
            None).
        engine: an engine honouring the Engine contract; built with :func:`build_engine`
            when None.
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
    if state is None:
        if engine is None:
            engine, sampling_params_cls = build_engine(config)
        if sampling_params_cls is None:
            raise TypeError("sampling_params_cls: expected a SamplingParams class, got None")
        try:
            state = ServingState(config, engine, sampling_params_cls)
        except BaseException:
            close = getattr(engine, "close", None)  # an engine process does not outlive us
            if callable(close):
                close()
            raise
    engine = state.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start(asyncio.get_running_loop())
        ticker = asyncio.create_task(_tick(state))
        logger.info(
            "kvpage serve: model %s, %d blocks x %d tokens, backend %s",
            config.model_name,
            engine.cache_spec.num_blocks,
            engine.cache_spec.block_size,
            getattr(engine, "backend_name", "?"),
        )
        try:
            yield
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            await asyncio.to_thread(state.loop.stop)
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="kvpage", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.serving = state
    app.state.metrics_app = (
        create_metrics_app(state) if config.security.metrics_port is not None else None
    )
    install_security(app, state)
    install_openapi(app, config.model_name)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, str(exc.status_code))
        return _error(APIError(exc.status_code, f"{request.url.path}: {exc.detail}", code=code))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("kvpage serve: unhandled error on %s", request.url.path)
        return _error(
            APIError(500, f"server: internal error ({type(exc).__name__})", type="server_error")
        )

    async def handle(request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            try:
                resp = await _generate(state, request, kind)
            except RequestRejected as exc:  # defensive: every refusal is a 4xx
                raise rejection_error(exc) from None
        except APIError as e:
            state.metrics.rejected.labels(reason=e.reason).inc()
            state.metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
            return _error(e)
        except Exception:
            state.metrics.requests.labels(endpoint=endpoint, status="500").inc()
            raise  # answered by the generic 500 handler
        state.metrics.requests.labels(endpoint=endpoint, status=str(resp.status_code)).inc()
        return resp

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    started = int(time.time())  # /v1/models "created": when this server started (Unix s)

    def model_card() -> dict[str, Any]:
        return {
            "id": config.model_name,
            "object": "model",
            "created": started,
            "owned_by": "kvpage",
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        # OpenAI's "retrieve model"; the openai client's models.retrieve() calls it
        if model_id == config.model_name:
            return JSONResponse(model_card())
        raise P.APIError(
            404,
            f"model: expected {config.model_name!r}, got {model_id!r}",
            code="model_not_found",
            param="model",
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        # normally answered by the HTTP guard before routing (same function)
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    register_utility_routes(app, state, _validation_message)

    if app.state.metrics_app is None:

        @app.get("/metrics")
        async def metrics() -> Response:
            return metrics_response(state)  # type: ignore[no-any-return]

    return app


async def _tick(state: ServingState) -> None:
    interval = state.config.degradation.eval_interval_s
    while True:  # ends when the lifespan cancels it
        await asyncio.sleep(interval)
        try:
            state.tick()
        except Exception:
            logger.exception("kvpage serve: degradation tick failed")


async def _generate(state: ServingState, request: Request, kind: str) -> Response:
    raw = await request.body()
    model_cls: type[P.CompletionRequest] | type[P.ChatCompletionRequest] = (
        P.ChatCompletionRequest if kind == "chat" else P.CompletionRequest
    )
    try:
        body = model_cls.model_validate_json(raw)
    except ValidationError as exc:
        msg, param = _validation_message(exc)
        raise APIError(400, msg, param=param, reason="invalid_request") from None
    prompts: list[Any] = [None]
    if isinstance(body, P.CompletionRequest):
        p = body.prompt
        several = isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list))
        prompts = list(p) if several else [p]
    asked_plp = body.prompt_logprobs is not None
    tenant = request_tenant(request, body.user)
    salt = scoped_cache_salt(state.config.security.prefix_cache_scope, tenant, body.cache_salt)
    try:
        priority = request_priority(tenant, body.priority, state.scheduling_policy)
    except ValueError as exc:
        raise APIError(400, str(exc), param="priority", reason="invalid_request") from None
    reqs = []
    for prompt in prompts:
        one = body if len(prompts) == 1 else body.model_copy(update={"prompt": prompt})
        # Tokenizing a long text takes long (and the tokenizer is pure Python): run it on
        # the tokenize pool so /health and the other requests are never blocked behind it.
        req = await asyncio.get_running_loop().run_in_executor(
            state.tokenize_pool,
            functools.partial(
                prepare_request,
                kind,
                one,
                tenant.name,
                model_name=state.config.model_name,
                tokenizer=state.tokenizer,
                max_model_len=state.max_model_len,
                max_bytes_per_token=state.max_bytes_per_token,
                allow_unknown_fields=state.config.allow_unknown_fields,
                retention_limits=(
                    state.config.admission.kv_retention_max_priority,
                    state.config.admission.kv_retention_max_ttl_s,
                ),
            ),
        )
        req.cache_salt = salt
        req.priority = priority
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = req.logprobs  # echo shows the prompt tokens' logprobs
        reqs.append(req)
    echo_texts = [
        prompt_text(r, pr, state.tokenizer) if r.echo else "" for r, pr in zip(reqs, prompts)
    ]
    req = reqs[0]
    if not req.stream:

        async def one_request(r: P.GenerationRequest, echo_text: str) -> RequestResult:
            res = RequestResult(r, [ChoiceState() for _ in range(r.n)], Usage(), echo_text)
            async with state.admitted(r):
                gen = state.generate(r, res.usage)
                async with contextlib.aclosing(gen):
                    async for d in _until_disconnect(gen, request):
                        res.choices[d.index].add(d)
            return res

        if len(reqs) == 1:
            results = [await one_request(req, echo_texts[0])]
        else:
            tasks = [asyncio.ensure_future(one_request(r, e)) for r, e in zip(reqs, echo_texts)]
            try:
                results = list(await asyncio.gather(*tasks))
            except BaseException:  # one prompt failed: cancel (abort) the others
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        capped = [r.max_tokens for r in reqs if r.requested_max_tokens is not None]
        return JSONResponse(
            build_body(results, asked_plp, state.tokenizer),
            headers={CAPPED_HEADER: str(min(capped))} if capped else None,
        )
    headers = {"Cache-Control": "no-cache"}
    capped = [r.max_tokens for r in reqs if r.requested_max_tokens is not None]
    if capped:
        headers[CAPPED_HEADER] = str(min(capped))
    if len(reqs) > 1:
        return await stream_many(
            state, reqs, echo_texts, lambda content, done: _Stream(content, done, headers)
        )
    usage = Usage()

    # Streaming: admission and the engine's accept/refuse happen before the 200 is sent,
    # so refusals are plain 4xx; cleanup is tied to the response's life (see _Stream).
    admission = state.admitted(req)
    await admission.__aenter__()
    gen = state.generate(req, usage)
    try:
        first: Any = await gen.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException as exc:
        await gen.aclose()
        await admission.__aexit__(type(exc), exc, exc.__traceback__)
        raise

    async def sse() -> AsyncIterator[str]:
        started = [False] * req.n
        offsets = [0] * req.n
        pending = [first] if first is not None else []
        while True:
            for d in pending:
                echo = None
                if req.echo:
                    plp = usage.prompt_logprobs or [None] * len(req.prompt_token_ids)
                    echo = (req.prompt_token_ids, list(plp))
                c = stream_chunk(
                    req,
                    d,
                    first=not started[d.index],
                    echo_text=echo_texts[0],
                    echo_entries=echo,
                    offset=offsets[d.index],
                    tokenizer=state.tokenizer,
                )
                if not started[d.index] and req.echo:
                    offsets[d.index] += len(echo_texts[0])
                offsets[d.index] += len(d.text)
                started[d.index] = True
                yield "data: " + json.dumps(c) + "\n\n"
            try:
                pending = [await gen.__anext__()]
            except StopAsyncIteration:
                break
            except APIError as e:
                yield (
                    "data: "
                    + json.dumps(P.error_body(e.message, type=e.type, code=e.code))
                    + "\n\n"
                )
                break
        if req.include_usage:
            u = P.usage_chunk(req, usage.completion_tokens, usage.cached_tokens, [usage.cache_info])
            yield "data: " + json.dumps(u) + "\n\n"
        yield "data: [DONE]\n\n"

    async def cleanup() -> None:
        await gen.aclose()  # aborts the request if it is still running (client gone)
        await admission.__aexit__(None, None, None)

    return _Stream(sse(), cleanup, headers)


class _Stream(StreamingResponse):
    """An SSE response that always runs ``cleanup`` when the response ends, however it
    ends (completed, client disconnected before or during the stream, server stopping)."""

    def __init__(
        self, content: AsyncIterator[str], cleanup: Callable[[], Any], headers: dict[str, str]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


async def _until_disconnect(
    gen: AsyncIterator[Any], request: Request, every_s: float = 0.25
) -> AsyncIterator[Any]:
    """Iterate ``gen``; stop (closing it, which aborts the request) if the client leaves.

    The connection is checked at least every ``every_s`` seconds, whether or not ``gen``
    is producing items.
    """
    loop = asyncio.get_running_loop()
    it = gen.__aiter__()
    next_check = loop.time() + every_s
    nxt: asyncio.Future[Any] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=max(0.0, next_check - loop.time()))
                if loop.time() >= next_check:
                    next_check = loop.time() + every_s
                    if await request.is_disconnected():
                        return
                if done:
                    break
            try:
                yield nxt.result()
            except StopAsyncIteration:
                return
    finally:
        # leave no __anext__ of ``gen`` running (also when this generator is cancelled or
        # closed from outside): closing ``gen`` while one runs raises "aclose(): asynchronous
        # generator is already running" (seen when Ray's proxy dropped a connection)
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await nxt
