"""OpenAI wire format: request and response models, error bodies, the chat template.

Requests are validated strictly from the raw JSON body (``model_validate_json`` in
pydantic strict mode): ``"max_tokens": "5"`` or ``true`` is a type error, not coerced.
Unknown fields are ignored, as OpenAI-compatible servers commonly do, except the
unsupported features listed in :data:`UNSUPPORTED_FIELDS`, which are refused so that a
client never silently gets something other than what it asked for.

Chat template (documented in docs/serving.md): stories260K is a plain language model
with no chat training, so a conversation is rendered as plain text, one message per
line, ``"{role}: {content}\\n"``, followed by ``"assistant:"``. The model then continues
the assistant line.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

__all__ = [
    "APIError",
    "UNSUPPORTED_FIELDS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerationRequest",
    "StreamOptions",
    "error_body",
    "render_chat",
]

#: Fields of the OpenAI API kvpage does not implement; a request using them gets 400.
UNSUPPORTED_FIELDS = (
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "logit_bias",
    "tools",
    "functions",
    "response_format",
)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a bool) asks for a final usage chunk."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: prefix-cache salt (vLLM's field): requests with different salts share no KV block
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    def stop_strings(self) -> list[str]:
        """The stop strings as a list (``prepare_request`` refuses empty ones)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (``stream_options``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported_fields(self) -> list[str]:
        """Names of requested-but-unsupported features (non-null, non-false values)."""
        extra = self.model_extra or {}
        return [k for k in UNSUPPORTED_FIELDS if extra.get(k) not in (None, False, 0)]


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of
    exactly one of those. ``max_tokens`` defaults to 16 (OpenAI's default)."""

    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be a string or a list of ``{"type": "text"}`` parts."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None  # required; null only for "assistant"

    @field_validator("content")
    @classmethod
    def _content_present(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("a string or a list of text parts (null only for role assistant)")
        return v

    def text(self) -> str:
        """The message's text (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``)
    defaults to the room left in the context (max model length minus prompt)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def render_chat(messages: list[ChatMessage]) -> str:
    """Render a conversation with kvpage's plain-text chat template.

    Returns:
        ``"".join(f"{m.role}: {m.text()}\\n" for m in messages) + "assistant:"``.
    """
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


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
    stream: bool
    include_usage: bool
    tenant: str
    #: the salt the engine mixes into the block hashes (tenant/scope folded in), or None
    cache_salt: str | None = None
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
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """A non-streamed response body (``text_completion`` or ``chat.completion``)."""
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": choices,
        "usage": usage(req, completion_tokens, cached_tokens),
    }


def usage(
    req: GenerationRequest, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """The ``usage`` object (prompt tokens counted once, even for ``n > 1``), with
    ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache)
    when known."""
    p = len(req.prompt_token_ids)
    out: dict[str, Any] = {
        "prompt_tokens": p,
        "completion_tokens": completion_tokens,
        "total_tokens": p + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def choice(req: GenerationRequest, index: int, text: str, finish: str | None) -> dict[str, Any]:
    """One non-streamed choice."""
    if req.kind == "chat":
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}


def chunk(
    req: GenerationRequest,
    index: int,
    text: str,
    finish: str | None,
    *,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed chunk for one choice (``text_completion`` / ``chat.completion.chunk``)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"content": text} if text or not finish else {}
        if first:
            delta["role"] = "assistant"
        c: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        c = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [c],
    }


def usage_chunk(
    req: GenerationRequest, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """The final streamed chunk carrying ``usage`` (``stream_options.include_usage``)."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [],
        "usage": usage(req, completion_tokens, cached_tokens),
    }


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
