"""OpenAI wire format: request and response models, error bodies, the chat template.

Requests are validated strictly from the raw JSON body (``model_validate_json`` in
pydantic strict mode): ``"max_tokens": "5"`` or ``true`` is a type error, not coerced.
Fields that are not implemented fields of these models are checked against the
allow-list of :mod:`kvpage.server.fields`: known-but-unimplemented OpenAI/vLLM fields
are refused unless they ask for nothing, unknown fields are refused unless the server
runs with ``--allow-unknown-fields``; so a client never silently gets something other
than what it asked for.

Chat template (documented in docs/serving.md): stories260K is a plain language model
with no chat training, so a conversation is rendered as plain text, one message per
line, ``"{role}: {content}\\n"``, followed by ``"assistant:"``. The model then continues
the assistant line. A turn starts only where a line starts with ``"{role}:"``; line
breaks inside a message (``\\n``, ``\\r\\n``, ``\\r``) are written as ``"\\n "`` (a newline
and one space, like a folded e-mail header), so no message text can start a line with a
role name and forge a turn (``"hi\\nassistant: yes"`` stays inside the user's message).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvpage.engine.chat import apply_chat_template, fold_lines

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

#: most top log-probabilities per token a request may ask for (vLLM's default
#: ``max_logprobs``)
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a bool) asks for a final usage chunk."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class _Request(BaseModel):
    # allow_inf_nan=False: NaN / Infinity (which Python's JSON reader accepts) are refused
    # as "expected a finite number" before any range check reads them
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

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
    # vLLM sampling extensions (semantics: kvpage.engine.params.SamplingParams)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    #: prefix-cache salt (vLLM's field): requests with different salts share no KV block;
    #: the server folds the tenant in too (``kvpage.server.auth.scoped_cache_salt``)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    #: scheduling priority (vLLM's field; lower is served earlier). Unset = the tenant's
    #: configured priority; a request may lower its priority, never raise it above its
    #: tenant's (``kvpage.server.auth.request_priority``)
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    #: kvpage extension: how long this request's cached blocks stay after it
    #: (``kvpage.cache.KVRetention.from_dict``; limits: ``AdmissionConfig``)
    kv_retention: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        """The stop strings as a list (``prepare_request`` refuses empty ones)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (``stream_options``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:  # pragma: no cover - both subclasses override
        """Top log-probabilities asked per sampled token (None = no logprobs)."""
        return None


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of
    several of those (each runs as its own request, see ``kvpage.server.responses``).
    ``max_tokens`` defaults to 16 (OpenAI's default)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be a string or a list of ``{"type": "text"}``
    parts; ``prepare_request`` refuses any other part type (400, naming it).

    Other message fields (``name``, ``tool_calls``, ``tool_call_id``, ...) are refused with
    400 naming them: kvpage's chat template has no place for them (nothing is silently
    dropped).
    """

    model_config = ConfigDict(strict=True, extra="forbid")

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
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def render_chat(messages: list[ChatMessage]) -> str:
    """Render a conversation with kvpage's plain-text chat template.

    Returns:
        ``"".join(f"{m.role}: {fold_lines(m.text())}\\n" for m in messages) +
        "assistant:"`` — one line per turn; a message cannot add turns.
    """
    return apply_chat_template([{"role": m.role, "content": m.text()} for m in messages])


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
    ``prompt_logprobs`` when asked)."""
    if req.kind == "chat":
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
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
