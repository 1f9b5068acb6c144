"""OpenAI wire format: the request as the generation path sees it, response bodies and
chunks, error bodies.

The request models of the endpoints (validated strictly from the raw JSON body) and the
chat template are in :mod:`kvpage.server.request_models`, re-exported here.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpage.engine.chat import fold_lines
from kvpage.server.request_models import MAX_LOGPROBS as MAX_LOGPROBS  # re-exported
from kvpage.server.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    render_chat,
)

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerationRequest",
    "StreamOptions",
    "error_body",
    "fold_lines",
    "render_chat",
]


class GenerationRequest(BaseModel):
    """A validated request as the generation path sees it (after tokenization)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    kind: Literal["completion", "chat"]
    request_id: str
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    n: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    #: the asked ``max_tokens`` when degraded mode capped it (see ``max_tokens_capped``)
    requested_max_tokens: int | None = None
    stream: bool
    include_usage: bool
    tenant: str
    #: the salt the engine mixes into the block hashes (tenant/scope folded in), or None
    cache_salt: str | None = None
    #: the engine's scheduling priority (tenant floor applied, see ``request_priority``)
    priority: int = 0
    #: the validated ``kv_retention`` policy in its dict form, or None
    kv_retention: dict[str, Any] | None = None
    #: chat: where the chat template came from ("request", "server", "model" or
    #: "kvpage", ``kvpage.engine.chat.ChatPrompt.template``); None for completions
    chat_template: str | None = None
    #: the ``StructuredOutputsParams`` keyword arguments of the request's constraint
    #: (``kvpage.server.structured_fields``), or None
    structured_outputs: dict[str, Any] | None = None
    #: chat ``tool_choice`` "required" or ``{"type": "function", ...}`` whose schema
    #: constrains the output, or ``{"auto": parser name}`` (the reply is parsed); both
    #: answered as ``tool_calls`` (:func:`tool_reply`); None = no tools
    tool_choice: Any = None
    created: int = Field(default_factory=lambda: int(time.time()))
    #: ``time.monotonic()`` seconds when the server received the request (TTFT/e2e start)
    arrival_s: float = Field(default_factory=time.monotonic)

    @property
    def cost(self) -> int:
        """Admission cost in tokens: ``prompt_tokens + n * max_tokens``."""
        return len(self.prompt_token_ids) + self.n * self.max_tokens


def new_request_id(kind: str) -> str:
    """A fresh id: ``cmpl-<hex>`` or ``chatcmpl-<hex>``."""
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def completion_body(
    req: GenerationRequest,
    choices: list[dict[str, Any]],
    completion_tokens: int,
    *,
    cached_tokens: int = 0,
    prompt_tokens: int | None = None,
    prompt_logprobs: list[Any] | None = None,
    cache_info: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A non-streamed response body (``text_completion`` or ``chat.completion``).

    Chat bodies carry vLLM's top-level ``prompt_logprobs`` when the request asked for
    them; a body whose ``max_tokens`` degraded mode capped carries
    :func:`capped_field`; given ``cache_info`` it carries :func:`cache_field`."""
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    body: dict[str, Any] = {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": choices,
        "usage": usage(req, completion_tokens, cached_tokens, prompt_tokens),
    }
    if req.kind == "chat" and prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    body.update(capped_field(req))
    if cache_info is not None:
        body.update(cache_field(cache_info))
    return body


def capped_field(req: GenerationRequest) -> dict[str, Any]:
    """``{"kvpage_max_tokens_capped": {"requested", "cap"}}`` when degraded mode capped
    ``max_tokens`` (``degradation.max_tokens_cap``), else ``{}``."""
    if req.requested_max_tokens is None:
        return {}
    return {
        "kvpage_max_tokens_capped": {
            "requested": req.requested_max_tokens,
            "cap": req.max_tokens,
        }
    }


def usage(
    req: GenerationRequest,
    completion_tokens: int,
    cached_tokens: int = 0,
    prompt_tokens: int | None = None,
) -> dict[str, Any]:
    """The ``usage`` object (prompt tokens counted once, even for ``n > 1``), with
    ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""
    p = len(req.prompt_token_ids) if prompt_tokens is None else prompt_tokens
    return {
        "prompt_tokens": p,
        "completion_tokens": completion_tokens,
        "total_tokens": p + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice(
    req: GenerationRequest,
    index: int,
    text: str,
    finish: str | None,
    *,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    """One non-streamed choice (vLLM's ``stop_reason``; completions choices carry
    ``prompt_logprobs`` when asked). A chat choice of a forced ``tool_choice`` that
    finished with "stop" is answered as ``tool_calls`` (content null, finish reason
    ``"tool_calls"``)."""
    if req.kind == "chat":
        reply = tool_reply(req, text, finish)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reply is not None:
            message = {"role": "assistant", "content": reply[0], "tool_calls": reply[1]}
            finish = "tool_calls"
        return {
            "index": index,
            "message": message,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "logprobs": logprobs,
        }
    c = {
        "index": index,
        "text": text,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "logprobs": logprobs,
    }
    if prompt_logprobs is not None:
        c["prompt_logprobs"] = prompt_logprobs
    return c


def tool_reply(
    req: GenerationRequest, text: str, finish: str | None
) -> tuple[str | None, list[Any]] | None:
    """``(content, tool_calls)`` of a finished choice that called tools, else None (the
    text is plain content).

    A forced ``tool_choice`` (``kvpage.engine.tool_calls.calls_from_constrained``): the
    calls, content None; None when the choice was cut before its JSON ended
    (``"length"``). ``tool_choice`` ``{"auto": parser}``: what the server's parser finds,
    with the text outside the calls as content (None when empty); None when it finds no
    call. None for other requests and unfinished choices.
    """
    if req.tool_choice is None or finish is None:
        return None
    from kvpage.engine.tool_calls import TOOL_PARSERS, calls_from_constrained

    if isinstance(req.tool_choice, dict) and "auto" in req.tool_choice:
        content, calls = TOOL_PARSERS[req.tool_choice["auto"]](text)
        return (content or None, calls) if calls else None
    if finish != "stop":
        return None
    try:
        return None, calls_from_constrained(text, req.tool_choice)
    except (ValueError, KeyError, TypeError):
        return None


def tool_call_chunk(
    req: GenerationRequest, index: int, calls: list[Any], *, first: bool = False
) -> dict[str, Any]:
    """The final streamed chunk of a forced-``tool_choice`` choice: the calls as one
    ``delta.tool_calls`` (each with its ``index``), finish reason ``"tool_calls"``."""
    delta: dict[str, Any] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
    if first:
        delta["role"] = "assistant"
    return {
        "id": req.request_id,
        "object": "chat.completion.chunk",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "finish_reason": "tool_calls",
                "logprobs": None,
                "stop_reason": None,
            }
        ],
        **capped_field(req),
    }


def chunk(
    req: GenerationRequest,
    index: int,
    text: str,
    finish: str | None,
    *,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """One streamed chunk for one choice (``text_completion`` / ``chat.completion.chunk``)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"content": text} if text or not finish else {}
        if first:
            delta["role"] = "assistant"
        c: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": logprobs,
        }
        obj = "chat.completion.chunk"
    else:
        c = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    if finish is not None:
        c["stop_reason"] = stop_reason
    return {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [c],
        **capped_field(req),
    }


def usage_chunk(
    req: GenerationRequest,
    completion_tokens: int,
    cached_tokens: int = 0,
    cache_info: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The final streamed chunk carrying ``usage`` (``stream_options.include_usage``) and,
    given ``cache_info`` (one entry per prompt), :func:`cache_field`."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [],
        "usage": usage(req, completion_tokens, cached_tokens),
        **capped_field(req),
        **({} if cache_info is None else cache_field(cache_info)),
    }


def cache_field(per_prompt: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"kvpage_cache": {"cached_tokens_by_tier", "prompts"}}``: the kvpage extension
    next to ``usage`` (docs/vllm-checklist.md). ``per_prompt`` holds, per prompt in
    order, ``{"cached_tokens_by_tier": {...}, "miss": {...} | None}`` (the tenant's
    view of the explanation, ``CacheMissExplanation.public``); ``cached_tokens_by_tier``
    at the top sums them."""
    total: dict[str, int] = {}
    for p in per_prompt:
        for tier, n in (p.get("cached_tokens_by_tier") or {}).items():
            total[tier] = total.get(tier, 0) + int(n)
    return {"kvpage_cache": {"cached_tokens_by_tier": total, "prompts": per_prompt}}


class APIError(Exception):
    """An error answered with an OpenAI-style body.

    Attributes:
        status: HTTP status code; type/code/param: the body's fields;
        headers: extra response headers (``Retry-After``); reason: metric label.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str = "invalid_request",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.reason = reason
