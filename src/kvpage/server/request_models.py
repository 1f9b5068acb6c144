"""The request models of the OpenAI endpoints (``/v1/completions``,
``/v1/chat/completions``) and kvpage's chat template.

Requests are validated strictly from the raw JSON body (``model_validate_json`` in
pydantic strict mode): ``"max_tokens": "5"`` or ``true`` is a type error, not coerced.
Fields that are not implemented fields of these models are checked against the
allow-list of :mod:`kvpage.server.fields`: known-but-unimplemented OpenAI/vLLM fields
are refused unless they ask for nothing, unknown fields are refused unless the server
runs with ``--allow-unknown-fields``; so a client never silently gets something other
than what it asked for.

Chat templates (documented in docs/serving.md; :mod:`kvpage.engine.chat`): a model
with a Jinja ``chat_template`` is rendered with it by transformers' sandboxed renderer
(request fields ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message`` as vLLM has them; server default ``--chat-template``); a
model without one (the bundled stories260K) gets kvpage's plain template, one message
per line, ``"{role}: {content}\n"``, then ``"assistant:"``, in which line breaks inside a
message are written as ``"\n "`` so no message can forge a turn. The response header
``x-kvpage-chat-template`` says which template rendered the prompt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvpage.engine.chat import ChatPrompt, render_chat_prompt
from kvpage.engine.params import MAX_LOGPROBS
from kvpage.models.tokenizer_base import Tokenizer

#: most characters of the ``user`` field (OpenAI does not say; 256 is ample for an id)
USER_MAX_CHARS = 256

__all__ = [
    "MAX_LOGPROBS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionPrompt",
    "CompletionRequest",
    "StreamOptions",
    "render_chat",
]


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
    #: an end-user label (OpenAI's); bounded like every client-chosen label
    user: str | None = Field(None, max_length=USER_MAX_CHARS)
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
    # structured outputs (checked and converted by kvpage.server.structured_fields)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit ``null`` for an optional field means its default (``"temperature":
        null`` = 1.0), as OpenAI's API marks these fields nullable and clients such as
        LiteLLM and LangChain send them; required fields stay required."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {
                k: v
                for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required())
            }
        return data

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


#: ``prompt`` of a completion body: a string, token ids, or several of either
CompletionPrompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of
    several of those (each runs as its own request, see ``kvpage.server.responses``).
    ``max_tokens`` defaults to 16 (OpenAI's default)."""

    prompt: CompletionPrompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be a string or a list of ``{"type": "text"}``
    parts; ``prepare_request`` refuses any other part type (400, naming it).

    ``name``, ``tool_calls`` and ``tool_call_id`` are passed to the model's Jinja chat
    template (which renders them or not, as the model was trained); kvpage's plain
    template refuses them with 400 naming them. Any other message field is refused.
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None  # required; null only for "assistant"
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content_present(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("a string or a list of text parts (null only for role assistant)")
        return v

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it (null fields omitted, as
        transformers' ``apply_chat_template`` drops them too)."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``)
    defaults to the room left in the context (max model length minus prompt)."""

    messages: list[ChatMessage] = Field(min_length=1)
    #: vLLM's chat-template fields (semantics: ``kvpage.engine.chat.render_chat_prompt``)
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    #: OpenAI tools (``kvpage.engine.tool_calls.check_tools``); ``tool_choice``
    #: "required" or a named function is enforced by a JSON schema
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def render_chat(
    messages: list[ChatMessage],
    tokenizer: Tokenizer,
    *,
    default_chat_template: str | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> ChatPrompt:
    """Render and tokenize a conversation (``kvpage.engine.chat.render_chat_prompt``:
    the request's template, else the server's ``--chat-template``, else the model's,
    else kvpage's plain one).

    Raises:
        RequestRejected: malformed messages or a template that fails to render.
    """
    return render_chat_prompt(
        tokenizer,
        [m.as_dict() for m in messages],
        chat_template=chat_template,
        default_chat_template=default_chat_template,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
    )
