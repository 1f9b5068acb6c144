"""vLLM's utility routes: ``/tokenize``, ``/detokenize``, ``/version`` and ``/ping``.

* ``POST /tokenize`` ``{"model"?, "prompt": str, "add_special_tokens"?: bool}`` or
  ``{"model"?, "messages": [...], "add_generation_prompt"?, "continue_final_message"?,
  "chat_template"?, "chat_template_kwargs"?}`` -> ``{"count", "max_model_len",
  "tokens"}``; for a prompt, ``add_special_tokens`` (default true) adds the tokenizer's
  special tokens (BOS where it adds one); messages are rendered and tokenized exactly as
  /v1/chat/completions does (``add_special_tokens`` is refused with them: the template
  decides the special tokens).
* ``POST /detokenize`` ``{"model"?, "tokens": [int]}`` -> ``{"prompt": str}``.
* ``GET /version`` -> ``{"version": kvpage.__version__}``.
* ``GET|POST /ping`` -> 200 ``{}`` while the engine loop runs, else 503 (as /health).

Bodies are validated like the completion routes: strict types, unknown fields refused
with 400 naming them, ``model`` (when given) must be the served model (404).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpage.engine.chat import message_text
from kvpage.errors import RequestRejected, got_repr
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server.protocol import APIError, ChatMessage, render_chat
from kvpage.server.validation import check_duplicate_keys, check_text_fits

if TYPE_CHECKING:
    from kvpage.server.service import ServingState

__all__ = ["DetokenizeRequest", "TokenizeRequest", "register_utility_routes"]


class _UtilityRequest(BaseModel):
    """Fields every utility body has: ``model``, when given, must be the served model."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None


class TokenizeRequest(_UtilityRequest):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_UtilityRequest):
    """``POST /detokenize``."""

    tokens: list[int]


_Body = TypeVar("_Body", bound=_UtilityRequest)
_Formatter = Callable[[ValidationError], tuple[str, str | None]]


def _render_ids(
    messages: list[ChatMessage],
    tokenizer: Tokenizer,
    *,
    default_chat_template: str | None,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> list[int]:
    """Prompt ids of a conversation, as /v1/chat/completions renders it."""
    return render_chat(
        messages,
        tokenizer,
        default_chat_template=default_chat_template,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    ).prompt_token_ids


async def _parse(
    state: ServingState, request: Request, cls: type[_Body], validation_message: _Formatter
) -> _Body:
    """The request's body as ``cls``.

    Raises:
        APIError: 400 invalid or duplicate keys, 404 another model.
    """
    raw = await request.body()
    try:
        body = cls.model_validate_json(raw)
    except ValidationError as exc:
        msg, param = validation_message(exc)
        raise APIError(400, msg, param=param) from None
    check_duplicate_keys(raw)
    name = state.config.model_name
    if body.model is not None and body.model != name:
        raise APIError(
            404,
            f"model: expected {name!r}, got {got_repr(body.model)}",
            code="model_not_found",
            param="model",
        )
    return body


def _check_tokenize_fields(body: TokenizeRequest) -> None:
    """Raises APIError (400) unless exactly one of prompt and messages is given, with
    only the fields that apply to it."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(
            400,
            "prompt: expected exactly one of prompt and messages, got "
            + ("both" if body.prompt is not None else "neither"),
            param="prompt",
        )
    chat_only = ("continue_final_message", "chat_template", "chat_template_kwargs")
    if body.messages is not None and "add_special_tokens" in body.model_fields_set:
        raise APIError(
            400,
            "add_special_tokens: expected unset with messages (the chat template "
            f"decides the special tokens), got {body.add_special_tokens}",
            param="add_special_tokens",
        )
    if body.messages is None:
        given = [k for k in chat_only if k in body.model_fields_set]
        if given:
            raise APIError(
                400, f"{given[0]}: expected unset without messages, got a value", param=given[0]
            )


def _encoder(state: ServingState, body: TokenizeRequest) -> Callable[[], list[int]]:
    """The tokenizing call of a checked body (run on the tokenize pool).

    Bounded work: text that provably cannot fit the context is refused here, before
    encoding (as for completions).

    Raises:
        APIError: 400 ``context_length_exceeded``.
    """
    param = "messages" if body.messages is not None else "prompt"
    if body.messages is None:
        text = body.prompt or ""
        check_text_fits(text, state.max_bytes_per_token, state.max_model_len, param)
        return functools.partial(state.tokenizer.encode, text, bos=body.add_special_tokens)
    text = "".join(message_text(m.content) for m in body.messages)
    check_text_fits(text, state.max_bytes_per_token, state.max_model_len, param)
    # the same rendering as /v1/chat/completions (the template writes its own
    # special tokens; add_special_tokens is not applied on top, as vLLM's default)
    return functools.partial(
        _render_ids,
        body.messages,
        state.tokenizer,
        default_chat_template=state.chat_template,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )


def register_utility_routes(
    app: FastAPI, state: ServingState, validation_message: _Formatter
) -> None:
    """Add the routes to ``app``.

    Args:
        app: the FastAPI app (its APIError handler answers the errors).
        state: the serving state.
        validation_message: the app's ``ValidationError -> (message, param)`` formatter.
    """

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _parse(state, request, TokenizeRequest, validation_message)
        _check_tokenize_fields(body)
        encode = _encoder(state, body)
        # tokenizing runs on the tokenize pool, never on the event loop that answers
        # every other request
        try:
            ids = list(
                await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, encode)
            )
        except RequestRejected as e:
            bad = str(e).split(":", 1)[0].strip()
            raise APIError(400, str(e), param=bad) from None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _parse(state, request, DetokenizeRequest, validation_message)
        vocab = int(state.tokenizer.vocab_size)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"tokens: expected ids in [0, {vocab}), got {got_repr(bad[0])}", param="tokens"
            )
        return {"prompt": str(state.tokenizer.decode(body.tokens))}

    @app.get("/version")
    async def version() -> dict[str, str]:
        from kvpage.version import __version__

        return {"version": __version__}

    # one route per method: a shared route gives both OpenAPI operations one operation id
    @app.get("/ping", operation_id="ping_get")
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> JSONResponse:
        ok = state.loop.running
        return JSONResponse({} if ok else {"status": "engine loop not running"}, 200 if ok else 503)
