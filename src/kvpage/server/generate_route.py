"""The handler of ``POST /v1/completions`` and ``POST /v1/chat/completions``: the raw
body is validated into the request model (pydantic's errors turned into one
``"field: expected X, got Y"`` message), converted into one ``GenerationRequest`` per
prompt (tokenized on the tokenize pool), admitted and run, and answered as one JSON
body or an SSE stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator
from typing import cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvpage.engine.tool_calls import releasable
from kvpage.errors import got_repr
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server import protocol as P
from kvpage.server.auth import request_priority, scoped_cache_salt
from kvpage.server.config import JSON_MAX_DEPTH
from kvpage.server.generation import Delta, current_placements, merged_placement
from kvpage.server.multi_stream import stream_many
from kvpage.server.request_models import CompletionPrompt
from kvpage.server.responses import (
    CAPPED_HEADER,
    CHAT_TEMPLATE_HEADER,
    GROUP_HEADER,
    REPLICA_HEADER,
    ChoiceState,
    RequestResult,
    build_body,
    prompt_text,
    stream_chunk,
)
from kvpage.server.security import may_see_topology, request_tenant
from kvpage.server.service import APIError, Charge, ServingState, Usage
from kvpage.server.sse import _Stream, _until_disconnect, sse_event
from kvpage.server.validation import check_duplicate_keys, prepare_request

__all__: list[str] = []

#: what a field accepts, for union-typed fields (pydantic reports one error per branch)
_ACCEPTS = {
    "prompt": "a string, a list of token ids (ints), a list of strings or a list of token-id lists",
    "stop": "a non-empty string or a list of them",
    "content": "a string or a list of text parts",
}


#: a parsed generation body
_Body = P.CompletionRequest | P.ChatCompletionRequest


def _clean_loc(loc: tuple[int | str, ...]) -> list[str]:
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
    got_s = "missing" if err.get("type") == "missing" else f"{type(got).__name__} {got_repr(got)}"
    msg = str(err.get("msg", "a valid value"))
    msg = msg.removeprefix("Input should be ").removeprefix("Value error, ")
    ctx = err.get("ctx") or {}
    field = parts[-1] if parts else ""
    if err.get("type") == "missing":
        msg = "a value (required field)"
    elif err.get("type") == "extra_forbidden":
        msg = "no such field (unknown field)"
    elif err.get("type") == "string_too_long":
        msg = f"a string of at most {ctx.get('max_length')} characters"
        got_s = f"{len(got) if isinstance(got, str) else '?'} characters"
    elif err.get("type") == "too_short":
        n = ctx.get("min_length", 1)
        msg = f"at least {n} item{'s' if n != 1 else ''}"
        got_s = f"{ctx.get('actual_length', len(got) if hasattr(got, '__len__') else '?')}"
    elif field in _ACCEPTS and (len(errors) > 1 or "[" in str(err.get("loc", ""))):
        msg = _ACCEPTS[field]
        got_s = f"{type(got).__name__} {got_repr(got)}"
    return f"{loc or 'body'}: expected {msg}, got {got_s}", loc or None


def _response_headers(
    state: ServingState, request: Request, reqs: list[P.GenerationRequest]
) -> dict[str, str]:
    """Headers known once every prompt is admitted and has started: the degraded-mode
    cap (:data:`CAPPED_HEADER`, the lowest cap applied at admission) and, for callers
    allowed to see the topology (:func:`may_see_topology`), the group and replica that
    serve the request (a scaled-out ingress; ``mixed`` when prompts went to several);
    for chat, the template that rendered the prompt (:data:`CHAT_TEMPLATE_HEADER`)."""
    headers: dict[str, str] = {}
    if reqs and reqs[0].chat_template is not None:
        headers[CHAT_TEMPLATE_HEADER] = reqs[0].chat_template
    capped = [r.max_tokens for r in reqs if r.requested_max_tokens is not None]
    if capped:
        headers[CAPPED_HEADER] = str(min(capped))
    where = merged_placement(current_placements())
    if where and may_see_topology(state, request):
        if "group" in where:
            headers[GROUP_HEADER] = where["group"]
        if where.get("replica"):
            headers[REPLICA_HEADER] = where["replica"]
    return headers


def _parse(
    model_cls: type[P.CompletionRequest] | type[P.ChatCompletionRequest], raw: bytes
) -> _Body:
    """The validated body (on the tokenize pool: parsing a 4 MiB body takes long).
    A key given twice in one JSON object is refused (:func:`check_duplicate_keys`)."""
    try:
        body = model_cls.model_validate_json(raw)
    except ValidationError as exc:
        msg, param = _validation_message(exc)
        raise APIError(400, msg, param=param, reason="invalid_request") from None
    check_duplicate_keys(raw)
    return body


def _split_prompts(body: _Body) -> list[CompletionPrompt | None]:
    """The prompts of a body: the entries of a list of strings / of token-id lists, else
    the one prompt (chat: ``[None]``, the messages are the prompt)."""
    if isinstance(body, P.CompletionRequest):
        p = body.prompt
        if isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list)):
            # pydantic validated one of the union's list types: all strings or all lists
            return list(cast("list[str] | list[list[int]]", p))
        return [p]
    return [None]


def check_request_size(state: ServingState, prompts: list[CompletionPrompt | None], n: int) -> None:
    """400 when a body asks for more prompts or sequences (``n x prompts``) than
    ``admission.max_prompts_per_request`` / ``max_sequences_per_request`` allow.

    Raises:
        APIError: 400 ``too_many_prompts`` (``param: prompt``) or ``too_many_sequences``
            (``param: n``), naming the limit.
    """
    cfg = state.config.admission
    if len(prompts) > cfg.max_prompts_per_request:
        raise APIError(
            400,
            f"prompt: expected at most {cfg.max_prompts_per_request} prompts per request "
            f"(admission.max_prompts_per_request), got {len(prompts)}",
            param="prompt",
            code="too_many_prompts",
            reason="invalid_request",
        )
    if len(prompts) * n > cfg.max_sequences_per_request:
        raise APIError(
            400,
            f"n: expected n x prompts at most {cfg.max_sequences_per_request} sequences per "
            f"request (admission.max_sequences_per_request), got {n} x {len(prompts)} = "
            f"{n * len(prompts)}",
            param="n",
            code="too_many_sequences",
            reason="invalid_request",
        )


def _prepare_all(
    state: ServingState,
    kind: str,
    body: _Body,
    prompts: list[CompletionPrompt | None],
    tenant: str,
) -> tuple[list[P.GenerationRequest], list[str]]:
    """One ``GenerationRequest`` per prompt and the texts ``echo`` prepends (on the
    tokenize pool: the work grows with the body). The first refused prompt raises."""
    reqs = []
    for prompt in prompts:
        one = body if len(prompts) == 1 else body.model_copy(update={"prompt": prompt})
        req = prepare_request(
            kind,
            one,
            tenant,
            model_name=state.config.model_name,
            tokenizer=state.tokenizer,
            max_model_len=state.max_model_len,
            max_bytes_per_token=state.max_bytes_per_token,
            allow_unknown_fields=state.config.allow_unknown_fields,
            tool_call_parser=(
                state.config.tool_call_parser if state.config.enable_auto_tool_choice else None
            ),
            retention_limits=(
                state.config.admission.kv_retention_max_priority,
                state.config.admission.kv_retention_max_ttl_s,
            ),
            chat_template=state.chat_template,
            sampling_defaults=state.sampling_defaults,
        )
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = req.logprobs  # echo shows the prompt tokens' logprobs
        reqs.append(req)
    echo_texts = [
        prompt_text(r, pr, state.tokenizer) if r.echo else "" for r, pr in zip(reqs, prompts)
    ]
    return reqs, echo_texts


async def _generate(state: ServingState, request: Request, kind: str) -> Response:
    """``POST /v1/completions`` (``kind="completion"``) or ``/v1/chat/completions``
    (``"chat"``): the JSON body of the finished request(s), or an SSE stream.

    Raises:
        APIError: the request was refused (before any byte of a stream was sent).
    """
    body, reqs, echo_texts = await _parsed_requests(state, request, kind)
    if not reqs[0].stream:
        results = await _run_all(state, request, reqs, echo_texts)
        headers = _response_headers(state, request, reqs) or None  # reads the context
        asked_plp = body.prompt_logprobs is not None

        def response() -> Response:  # the body's JSON grows with n x prompts: off the loop
            return JSONResponse(build_body(results, asked_plp, state.tokenizer), headers=headers)

        return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, response)
    # Streams: the headers are built once admission (which applies the degraded-mode
    # cap) and the engine's accept are done, just before the 200 is sent.
    if len(reqs) > 1:
        return await stream_many(
            state,
            reqs,
            echo_texts,
            lambda content, done: _Stream(
                content,
                done,
                {"Cache-Control": "no-cache", **_response_headers(state, request, reqs)},
            ),
        )
    return await _stream_one(state, request, reqs, echo_texts[0])


async def _parsed_requests(
    state: ServingState, request: Request, kind: str
) -> tuple[_Body, list[P.GenerationRequest], list[str]]:
    """``(parsed body, one validated request per prompt, their echo texts)``, with the
    tenant's cache salt and priority set.

    Raises:
        APIError: 400 (413 too large) on an invalid body.
    """
    raw = await request.body()
    model_cls: type[P.CompletionRequest] | type[P.ChatCompletionRequest] = (
        P.ChatCompletionRequest if kind == "chat" else P.CompletionRequest
    )
    # Nothing that grows with the body runs on the event loop: parsing, validation,
    # tokenization and the JSON of the response run on the tokenize pool, so
    # /health and the other requests are never blocked behind a large body.
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(state.tokenize_pool, _parse, model_cls, raw)
    prompts = _split_prompts(body)
    check_request_size(state, prompts, body.n or 1)
    tenant = request_tenant(request, body.user)
    salt = scoped_cache_salt(state.config.security.prefix_cache_scope, tenant, body.cache_salt)
    try:
        priority = request_priority(tenant, body.priority, state.scheduling_policy)
    except ValueError as exc:
        raise APIError(400, str(exc), param="priority", reason="invalid_request") from None
    reqs, echo_texts = await loop.run_in_executor(
        state.tokenize_pool,
        functools.partial(_prepare_all, state, kind, body, prompts, tenant.name),
    )
    for r in reqs:
        r.cache_salt = salt
        r.priority = priority
    return body, reqs, echo_texts


async def _run_one(
    state: ServingState,
    request: Request,
    r: P.GenerationRequest,
    echo_text: str,
    charge: Charge | None = None,
) -> RequestResult:
    """Admit and run one non-streamed request to its end (aborted if the client leaves)."""
    res = RequestResult(r, [ChoiceState() for _ in range(r.n)], Usage(), echo_text)
    async with state.admitted(r, charge):
        if charge is not None:
            charge.started = True
        gen = state.generation.generate(r, res.usage)
        async with contextlib.aclosing(gen):
            async for d in _until_disconnect(gen, request):
                res.choices[d.index].add(d)
    return res


async def _run_all(
    state: ServingState,
    request: Request,
    reqs: list[P.GenerationRequest],
    echo_texts: list[str],
) -> list[RequestResult]:
    """Run every prompt's request concurrently under one charge; when one fails the
    others are aborted (cause ``sibling_failed`` for an API error) and it re-raises."""
    if len(reqs) == 1:
        return [await _run_one(state, request, reqs[0], echo_texts[0])]
    # One request, one charge: the tenant pays the summed cost before any
    # prompt starts (refused -> nothing charged, nothing runs).
    async with state.charged(reqs) as charge:
        tasks = [
            asyncio.ensure_future(_run_one(state, request, r, e, charge))
            for r, e in zip(reqs, echo_texts)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException as exc:  # one prompt failed: abort the others
            if isinstance(exc, APIError):
                for r in reqs:
                    state.generation.cancel_causes[r.request_id] = "sibling_failed"
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in reqs:
                state.generation.cancel_causes.pop(r.request_id, None)
            raise


async def _stream_one(
    state: ServingState, request: Request, reqs: list[P.GenerationRequest], echo_text: str
) -> Response:
    """The SSE response of one streamed request.

    Admission and the engine's accept/refuse happen before the 200 is sent, so refusals
    are plain 4xx; cleanup is tied to the response's life (see :class:`_Stream`).
    """
    req = reqs[0]
    usage = Usage()
    admission = state.admitted(req)
    await admission.__aenter__()
    gen = state.generation.generate(req, usage)
    try:
        first: Delta | None = await gen.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException as exc:
        await gen.aclose()
        await admission.__aexit__(type(exc), exc, exc.__traceback__)
        raise

    async def cleanup() -> None:
        await gen.aclose()  # aborts the request if it is still running (client gone)
        await admission.__aexit__(None, None, None)

    headers = {"Cache-Control": "no-cache", **_response_headers(state, request, reqs)}
    events = _sse(_ChoiceEvents(req, echo_text, usage, state.tokenizer), gen, first)
    return _Stream(events, cleanup, headers)


async def _sse(
    choices: _ChoiceEvents, gen: AsyncIterator[Delta], first: Delta | None
) -> AsyncIterator[str]:
    """The events of a streamed request: its chunks, an error event if the engine
    failed mid-stream, the usage chunk when asked, then ``[DONE]``."""
    req, usage = choices.req, choices.usage
    pending = [first] if first is not None else []
    while True:
        for d in pending:
            for event in choices.events(d):
                yield event
        try:
            pending = [await gen.__anext__()]
        except StopAsyncIteration:
            break
        except APIError as e:
            yield sse_event(P.error_body(e.message, type=e.type, code=e.code))
            break
    if req.include_usage:
        u = P.usage_chunk(req, usage.completion_tokens, usage.cached_tokens, [usage.cache_info])
        yield sse_event(u)
    yield "data: [DONE]\n\n"


class _ChoiceEvents:
    """Per-choice state of one streamed request: what each delta becomes as events.

    A tool-calling choice's text is held until it can be parsed; with
    ``tool_choice: "auto"``, the part that is surely content
    (:func:`~kvpage.engine.tool_calls.releasable`) streams as it comes.
    """

    def __init__(
        self, req: P.GenerationRequest, echo_text: str, usage: Usage, tokenizer: Tokenizer
    ) -> None:
        self.req, self.echo_text, self.usage, self.tokenizer = req, echo_text, usage, tokenizer
        self.started = [False] * req.n  # a chunk of the choice was sent
        self.offsets = [0] * req.n  # text offset of the choice's next chunk (logprobs)
        self.held = [""] * req.n  # tool-calling choices: text generated so far
        self.sent = [0] * req.n  # ... and how much of it was sent as content
        tc = req.tool_choice
        self.auto = tc.get("auto") if isinstance(tc, dict) else None

    def events(self, d: Delta) -> list[str]:
        """The SSE events of delta ``d`` (maybe none) in order."""
        out: list[str] = []
        if self.req.tool_choice is not None:
            content = self._tool_events(d, out)
            if content is None:
                return out
            d = content
        out.append(self._chunk(d))
        return out

    def _tool_events(self, d: Delta, out: list[str]) -> Delta | None:
        """Append the events of a tool-calling choice's delta; return the delta to send
        as plain content (a finished choice that made no call), else None."""
        req, i, held, sent, started = self.req, d.index, self.held, self.sent, self.started
        held[i] += d.text
        if d.finish_reason is None:
            r = releasable(self.auto, held[i]) if self.auto is not None else 0
            if r > sent[i]:
                c = P.chunk(req, i, held[i][sent[i] : r], None, first=not started[i])
                started[i], sent[i] = True, r
                out.append(sse_event(c))
            return None
        reply = P.tool_reply(req, held[i], d.finish_reason)
        if reply is None:
            return dataclasses.replace(d, text=held[i][sent[i] :])  # no call: content
        rest = (reply[0] or "")[len(held[i][: sent[i]].strip()) :].strip()
        if rest:
            out.append(sse_event(P.chunk(req, i, rest, None, first=not started[i])))
            started[i] = True
        out.append(sse_event(P.tool_call_chunk(req, i, reply[1], first=not started[i])))
        started[i] = True
        return None

    def _chunk(self, d: Delta) -> str:
        req, i = self.req, d.index
        echo = None
        if req.echo:
            plp = self.usage.prompt_logprobs or [None] * len(req.prompt_token_ids)
            echo = (req.prompt_token_ids, list(plp))
        c = stream_chunk(
            req,
            d,
            first=not self.started[i],
            echo_text=self.echo_text,
            echo_entries=echo,
            offset=self.offsets[i],
            tokenizer=self.tokenizer,
        )
        if not self.started[i] and req.echo:
            self.offsets[i] += len(self.echo_text)
        self.offsets[i] += len(d.text)
        self.started[i] = True
        return sse_event(c)
