"""Request validation: a parsed OpenAI request -> a :class:`GenerationRequest`.

Everything here is pure (no state is touched), so a refused request leaves the pool,
the buckets and the metrics exactly as they were (apart from the rejection counter the
caller increments).
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple, cast

from kvpage.cache.retention import KVRetention
from kvpage.engine.chat import message_text, text_part_problem
from kvpage.engine.tool_calls import check_tools
from kvpage.errors import GOT_REPR_MAX, RequestRejected, SpecError, got_repr
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server.fields import check_extra_fields
from kvpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    new_request_id,
    render_chat,
)
from kvpage.server.request_models import CompletionPrompt
from kvpage.server.structured_fields import STRUCTURED_FIELDS, structured_outputs_of

__all__ = ["check_retention", "max_token_bytes", "min_prompt_tokens", "prepare_request"]

#: largest seed of any choice (choice i samples with seed + i): a signed 64-bit int, the
#: range the engine's SamplingParams accepts and every torch.Generator takes
_MAX_SEED = 2**63 - 1


def max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """Most UTF-8 bytes of text one token of ``tokenizer`` can cover, if knowable.

    Known for tokenizers that list their vocabulary as ``pieces`` (bytes or str, e.g.
    ``Llama2cTokenizer``): a token's text is its piece (control and byte-fallback pieces
    such as ``"<0x0A>"`` are longer than the bytes they stand for, which only loosens the
    bound). None otherwise (no pre-check is made).
    """
    pieces = getattr(tokenizer, "pieces", None)
    if not isinstance(pieces, (list, tuple)) or not pieces:
        return None
    if not all(isinstance(p, (bytes, str)) for p in pieces):
        return None
    return max(1, max(len(p if isinstance(p, bytes) else p.encode("utf-8")) for p in pieces))


def min_prompt_tokens(text: str, max_bytes_per_token: int) -> int:
    """A proven lower bound on ``len(tokenizer.encode(text, bos=True))``.

    The text is UTF-8 encoded (with one leading space, as SentencePiece-style tokenizers
    add it); every token covers at most ``max_bytes_per_token`` of those bytes, so at
    least ``ceil(bytes / max_bytes_per_token)`` tokens are needed, plus BOS. Costs O(len)
    and no tokenization, so over-long prompts are refused before the (slow) encode.
    """
    if not text:
        return 1
    n = 1 + len(text.encode("utf-8", errors="surrogatepass"))
    return 1 + math.ceil(n / max_bytes_per_token)


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def check_duplicate_keys(raw: bytes) -> None:
    """400 when a JSON object of ``raw`` (already known to be valid JSON) holds a key
    twice: RFC 8259 leaves the meaning to the parser (pydantic keeps the last, others
    the first), so ``"max_tokens": 100000, "max_tokens": 1`` would mean what the
    client did not check. Costs one more parse of the body (run it off the loop).

    Raises:
        APIError: 400 ``duplicate_key``, ``param`` the key (quoted bounded).
    """
    try:
        json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as d:
        raise APIError(
            400,
            f"body: expected each key once per JSON object, got {got_repr(d.key)} twice",
            param=d.key[:GOT_REPR_MAX],
            code="duplicate_key",
            reason="invalid_request",
        ) from None
    except (ValueError, RecursionError):  # pydantic accepted it: its reading stands
        return


def check_text_fits(text: str, bound: int | None, max_model_len: int, param: str) -> None:
    if bound is None:
        return
    lo = min_prompt_tokens(text, bound)
    if lo >= max_model_len:
        raise APIError(
            400,
            f"{param}: expected fewer than {max_model_len} tokens (max model length), got a "
            f"text that cannot fit: an estimate, not a count (not tokenized: its "
            f"{len(text)} characters need at least {lo} tokens at {bound} bytes per token "
            f"at most)",
            code="context_length_exceeded",
            param=param,
            reason="prompt_too_long",
        )


def prepare_request(
    kind: str,
    body: CompletionRequest | ChatCompletionRequest,
    tenant: str | None,
    *,
    model_name: str,
    tokenizer: Tokenizer,
    max_model_len: int,
    max_bytes_per_token: int | None = None,
    allow_unknown_fields: bool = False,
    retention_limits: tuple[int, float] = (3, 3600.0),
    chat_template: str | None = None,
    sampling_defaults: dict[str, Any] | None = None,
    tool_call_parser: str | None = None,
) -> GenerationRequest:
    """Validate a parsed request and tokenize its prompt.

    Args:
        kind: ``"completion"`` or ``"chat"``.
        body: the parsed request.
        tenant: the tenant's name (the server passes the authenticated tenant, see
            :func:`kvpage.server.security.request_tenant`); when None, ``user``, else
            ``"anonymous"``.
        model_name: the served model id.
        tokenizer: ``encode(text, bos=True) -> list[int]``, ``vocab_size``.
        max_model_len: longest sequence (prompt + output) in tokens.
        max_bytes_per_token: :func:`max_token_bytes` of ``tokenizer``; when given, text
            that provably cannot fit ``max_model_len`` is refused before encoding.
        allow_unknown_fields: ignore fields outside the OpenAI/vLLM schemas instead of
            refusing them (see :mod:`kvpage.server.fields`).
        retention_limits: ``(max priority, max ttl_s)`` a ``kv_retention`` policy may
            ask for (``AdmissionConfig.kv_retention_max_priority`` / ``_max_ttl_s``).
        chat_template: the server's default Jinja chat template (``--chat-template``),
            or None (the model's, else kvpage's plain one).
        sampling_defaults: the model's generation_config.json defaults
            (``LLMEngine.default_sampling_params``: temperature, top_p, top_k, min_p,
            repetition_penalty, max_tokens) for the fields the request leaves unset
            (or sends as null); None = kvpage's / OpenAI's defaults.
        tool_call_parser: the server's parser when ``enable_auto_tool_choice`` is on
            (chat ``tool_choice: "auto"`` is then allowed), else None (refused).

    Returns:
        The request with token ids and ``max_tokens`` resolved (completions default 16;
        chat defaults to the room left in the context).

    Raises:
        APIError: 404 unknown model, 400 anything else invalid. No state is touched.
    """
    stops = _check_body(kind, body, model_name, tokenizer, allow_unknown_fields)
    prompt = _prompt_of(body, tokenizer, chat_template, max_bytes_per_token, max_model_len)
    defaults = sampling_defaults or {}
    max_tokens = _resolve_max_tokens(
        kind, body, len(prompt.ids), prompt.max_name, prompt.max_tokens, defaults, max_model_len
    )
    options = _request_options(body, retention_limits, tool_call_parser)
    who = tenant or body.user or "anonymous"
    return _generation_request(
        kind, body, who, model_name, prompt, max_tokens, stops, defaults, options
    )


class _Prompt(NamedTuple):
    """A request's tokenized prompt and its requested output length."""

    template_source: str | None  # the chat template that rendered it (chat), else None
    ids: list[int]
    max_name: str  # the field that sets the output length (errors name it)
    max_tokens: int | None  # its value, None when unset


class _Options(NamedTuple):
    """A request's checked retention policy and structured-output constraint."""

    retention: dict[str, Any] | None
    structured: dict[str, Any] | None  # StructuredOutputsParams kwargs
    tool_choice: Any  # the request's tool_choice (JSON: a string or an object)


def _prompt_of(
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: Tokenizer,
    chat_template: str | None,
    max_bytes_per_token: int | None,
    max_model_len: int,
) -> _Prompt:
    """Render (chat) and tokenize the prompt: see :func:`_chat_prompt`, :func:`_prompt_ids`."""
    if isinstance(body, ChatCompletionRequest):
        return _Prompt(
            *_chat_prompt(body, tokenizer, chat_template, max_bytes_per_token, max_model_len)
        )
    ids = _prompt_ids(body.prompt, tokenizer, max_bytes_per_token, max_model_len)
    return _Prompt(None, ids, "max_tokens", body.max_tokens)


def _request_options(
    body: CompletionRequest | ChatCompletionRequest,
    retention_limits: tuple[int, float],
    tool_call_parser: str | None,
) -> _Options:
    """Check the seed, the ``kv_retention`` policy and the structured-output fields, in
    that order.

    Raises:
        APIError: 400 the first that is invalid.
    """
    _check_seed(body)
    retention = check_retention(body.kv_retention, retention_limits)
    return _Options(retention, *_structured_outputs(body, tool_call_parser))


def _check_body(
    kind: str,
    body: CompletionRequest | ChatCompletionRequest,
    model_name: str,
    tokenizer: Tokenizer,
    allow_unknown_fields: bool,
) -> list[str]:
    """The checks that need no tokenizing, in the order their errors take precedence;
    return the request's stop strings.

    Raises:
        APIError: 404 unknown model, 400 an unsupported field or an invalid value.
    """
    bad = check_extra_fields(kind, body.model_extra or {}, allow_unknown=allow_unknown_fields)
    if bad is not None:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_field")
    if (
        isinstance(body, ChatCompletionRequest)
        and body.top_logprobs is not None
        and not body.logprobs
    ):
        raise APIError(
            400,
            f"top_logprobs: expected unset unless logprobs is true, got {got_repr(body.top_logprobs)}",
            param="top_logprobs",
        )
    if body.stop_token_ids is not None and any(
        not 0 <= t < int(tokenizer.vocab_size) for t in body.stop_token_ids
    ):
        raise APIError(
            400,
            f"stop_token_ids: expected ids in [0, {tokenizer.vocab_size}), "
            f"got {got_repr(body.stop_token_ids)}"[:300],
            param="stop_token_ids",
        )
    if body.stream_options is not None and not body.stream:
        raise APIError(  # as OpenAI and vLLM: the options would do nothing
            400,
            "stream_options: expected unset unless stream is true, got "
            f"{body.stream_options.model_dump()!r}",
            param="stream_options",
        )
    stops = body.stop_strings()
    if any(not x for x in stops):
        raise APIError(
            400,
            f"stop: expected a non-empty string or a list of them, got {got_repr(body.stop)}",
            param="stop",
        )
    if body.model != model_name:
        raise APIError(
            404,
            f"model: expected {model_name!r}, got {got_repr(body.model)}",
            code="model_not_found",
            param="model",
            reason="unknown_model",
        )
    return stops


def _chat_prompt(
    body: ChatCompletionRequest,
    tokenizer: Tokenizer,
    chat_template: str | None,
    max_bytes_per_token: int | None,
    max_model_len: int,
) -> tuple[str | None, list[int], str, int | None]:
    """Render and tokenize a chat request's messages (its tools too); return
    ``(template source, prompt token ids, max-tokens field name, its value or None)``.

    Raises:
        APIError: 400 conflicting max_tokens / max_completion_tokens, invalid content
            parts, text that cannot fit, invalid tools, or a template that fails.
    """
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise APIError(
            400,
            "max_completion_tokens: expected the same value as max_tokens when both "
            f"are given (max_tokens is its older name), got {got_repr(body.max_completion_tokens)} "
            f"and max_tokens {got_repr(body.max_tokens)}",
            param="max_completion_tokens",
        )
    _check_text_parts(body)
    # bounded work: messages whose text alone provably cannot fit are refused before
    # the template renders (a template only adds text)
    all_text = "".join(message_text(m.content) for m in body.messages)
    check_text_fits(all_text, max_bytes_per_token, max_model_len, "messages")
    try:
        if body.tools is not None:
            check_tools(body.tools)  # before the template renders them
        chat = render_chat(
            body.messages,
            tokenizer,
            default_chat_template=chat_template,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,  # shown with every tool_choice, "none" too (as vLLM)
        )
    except RequestRejected as e:
        param = str(e).split(":", 1)[0].strip()
        raise APIError(400, str(e), param=param, reason="invalid_request") from None
    max_name = "max_completion_tokens" if body.max_tokens is None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    return chat.template, chat.prompt_token_ids, max_name, max_tokens


def _resolve_max_tokens(
    kind: str,
    body: CompletionRequest | ChatCompletionRequest,
    n_prompt: int,
    max_name: str,
    max_tokens: int | None,
    defaults: dict[str, Any],
    max_model_len: int,
) -> int:
    """``max_tokens`` of a prompt of ``n_prompt`` tokens: the request's, else the
    generation config's (within the room left), else 16 (completions) or the room left
    (chat); checked against ``min_tokens`` and ``max_model_len``.

    Raises:
        APIError: 400 (``context_length_exceeded`` when it cannot fit).
    """
    if max_tokens is None and "max_tokens" in defaults:
        # unset: the generation config's max_new_tokens, within the room left (vLLM's
        # get_max_tokens takes the smaller too)
        max_tokens = min(int(defaults["max_tokens"]), max_model_len - n_prompt)
    elif max_tokens is None and kind == "completion":
        max_tokens = 16  # OpenAI's default (chat: the room left, below)
    if n_prompt >= max_model_len:
        raise APIError(
            400,
            f"prompt: expected fewer than {max_model_len} tokens (max model length), "
            f"got {n_prompt}",
            code="context_length_exceeded",
            param="prompt" if kind == "completion" else "messages",
            reason="prompt_too_long",
        )
    if max_tokens is None:
        max_tokens = max_model_len - n_prompt
    if max_tokens < 1:
        raise APIError(
            400, f"{max_name}: expected >= 1, got {got_repr(max_tokens)}", param=max_name
        )
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens: expected <= {max_name} ({max_tokens}), got {got_repr(body.min_tokens)}",
            param="min_tokens",
        )
    if n_prompt + max_tokens > max_model_len:
        raise APIError(
            400,
            f"{max_name}: expected prompt ({n_prompt}) + {max_name} <= {max_model_len} "
            f"(max model length), got {got_repr(n_prompt + max_tokens)}",
            code="context_length_exceeded",
            param=max_name,
            reason="prompt_too_long",
        )
    return max_tokens


def _check_seed(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Raises APIError (400) unless every choice's seed (``seed + i``) fits."""
    if body.seed is not None and not 0 <= body.seed <= _MAX_SEED - (body.n - 1):
        # choice i samples with seed + i, which must fit a signed 64-bit seed
        raise APIError(
            400,
            f"seed: expected None or an int in [0, {_MAX_SEED - (body.n - 1)}] "
            f"(seed + n - 1 <= 2**63 - 1), got {got_repr(body.seed)}",
            param="seed",
            reason="invalid_sampling_params",
        )


def _structured_outputs(
    body: CompletionRequest | ChatCompletionRequest, tool_call_parser: str | None
) -> tuple[dict[str, Any] | None, Any]:
    """``(StructuredOutputsParams kwargs or None, tool_choice)`` of the request: its
    response_format / structured_outputs / guided_* fields, or a forced tool choice's
    schema (never both).

    Raises:
        APIError: 400 on an invalid or conflicting constraint.
    """
    structured = structured_outputs_of(
        {
            k: getattr(body, k)
            for k in (*STRUCTURED_FIELDS, "guided_decoding_backend", "guided_whitespace_pattern")
        }
    )
    tool_choice = None
    if isinstance(body, ChatCompletionRequest):
        tool_choice, tool_constraint = _tool_constraint(body, tool_call_parser)
        if tool_constraint is not None:
            if structured is not None:
                raise APIError(
                    400,
                    "tool_choice: expected no response_format / structured_outputs / guided_* "
                    "field with a forced tool choice (its schema is the constraint), got both",
                    param="tool_choice",
                    code="invalid_structured_outputs",
                )
            structured = tool_constraint
    return structured, tool_choice


def _generation_request(
    kind: str,
    body: CompletionRequest | ChatCompletionRequest,
    tenant: str,
    model_name: str,
    prompt: _Prompt,
    max_tokens: int,
    stops: list[str],
    defaults: dict[str, Any],
    options: _Options,
) -> GenerationRequest:
    """The validated request (a new request id; sampling fields resolved by
    :func:`_field`)."""
    return GenerationRequest(
        kind=kind,
        request_id=new_request_id(kind),
        model=model_name,
        prompt_token_ids=prompt.ids,
        max_tokens=max_tokens,
        n=body.n,
        temperature=_field(body, "temperature", defaults),
        top_p=_field(body, "top_p", defaults),
        top_k=_field(body, "top_k", defaults),
        seed=body.seed,
        stop=stops,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=_field(body, "repetition_penalty", defaults, 1.0),
        min_p=_field(body, "min_p", defaults, 0.0),
        min_tokens=body.min_tokens or 0,
        stop_token_ids=list(body.stop_token_ids or ()),
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=body.num_logprobs(),
        prompt_logprobs=body.prompt_logprobs,
        echo=isinstance(body, CompletionRequest) and body.echo,
        stream=body.stream,
        include_usage=body.include_usage(),
        tenant=tenant,
        kv_retention=options.retention,
        chat_template=prompt.template_source,
        structured_outputs=options.structured,
        tool_choice=options.tool_choice,
    )


def _field(body: Any, name: str, defaults: dict[str, Any], fallback: Any = None) -> Any:
    """A sampling field: the request's value when it set one, else the generation
    config's default, else the request model's default (``fallback`` for fields whose
    model default is None)."""
    if name in body.model_fields_set and getattr(body, name) is not None:
        return getattr(body, name)
    if name in defaults:
        return defaults[name]
    v = getattr(body, name)
    return fallback if v is None else v


def _tool_constraint(
    body: ChatCompletionRequest, parser: str | None
) -> tuple[Any, dict[str, Any] | None]:
    """``(tool_choice, StructuredOutputsParams kwargs)`` of a chat request's ``tools`` /
    ``tool_choice``: "required" and a named function are enforced by a JSON schema
    (``kvpage.engine.tool_calls.tool_choice_constraint``); "none" asks for nothing;
    "auto" (OpenAI's default when tools are given) returns ``{"auto": parser}`` (the
    reply is parsed, not constrained) when the server has a parser, else is refused.

    Raises:
        APIError: 400 naming ``tools...`` / ``tool_choice``.
    """
    from kvpage.engine.tool_calls import tool_choice_constraint

    if body.tools is None and body.tool_choice is None:
        return None, None
    if body.tools is None:
        if body.tool_choice == "none":
            return None, None
        raise APIError(
            400,
            f"tool_choice: expected unset or 'none' without tools, got {got_repr(body.tool_choice)}",
            param="tool_choice",
        )
    choice = "auto" if body.tool_choice is None else body.tool_choice
    if choice == "auto" and parser is not None:
        tool_choice_constraint(body.tools, "none")  # validates the tools
        return {"auto": parser}, None
    if choice == "auto":
        raise APIError(
            400,
            "tool_choice: expected 'none', 'required' or a named function ('auto', the "
            "default with tools, needs a server started with --enable-auto-tool-choice "
            "--tool-call-parser NAME), got 'auto'",
            param="tool_choice",
            code="unsupported_field",
        )
    try:
        constraint = tool_choice_constraint(
            body.tools, choice, body.parallel_tool_calls is not False
        )
    except RequestRejected as e:
        msg = str(e)
        raise APIError(400, msg, param=msg.partition(":")[0]) from None
    if constraint is not None:
        try:
            structured_outputs_of({"structured_outputs": constraint})
        except APIError as e:  # a parameters schema xgrammar cannot use
            _, _, why = e.message.partition(":")
            raise APIError(
                400, f"tools:{why}", param="tools", code="invalid_structured_outputs"
            ) from None
    return (None if constraint is None else choice), constraint


def check_retention(raw: dict[str, Any] | None, limits: tuple[int, float]) -> dict[str, Any] | None:
    """Validate the ``kv_retention`` field against the policy schema and the server's
    limits; returns its normalized dict form (None when absent).

    Raises:
        APIError: 400, ``param="kv_retention"``, naming the offending sub-field.
    """
    if raw is None:
        return None
    max_prio, max_ttl = limits
    try:
        policy = KVRetention.from_dict(raw)
    except (SpecError, TypeError) as e:
        raise APIError(
            400, str(e)[:300], param="kv_retention", code="invalid_kv_retention"
        ) from None
    where = [
        (f"kv_retention.ranges[{i}].", r.priority, r.ttl_s) for i, r in enumerate(policy.ranges)
    ]
    where.append(("kv_retention.decode_", policy.decode_priority, policy.decode_ttl_s))
    for name, prio, ttl in where:
        if prio > max_prio:
            raise APIError(
                400,
                f"{name}priority: expected <= {max_prio} (this server's "
                f"kv_retention_max_priority), got {prio}",
                param="kv_retention",
                code="invalid_kv_retention",
            )
        if prio > 1 and (ttl is None or ttl > max_ttl):
            raise APIError(
                400,
                f"{name}ttl_s: expected a number <= {max_ttl} for a raised priority (this "
                f"server's kv_retention_max_ttl_s), got {'null' if ttl is None else ttl}",
                param="kv_retention",
                code="invalid_kv_retention",
            )
    return policy.to_dict()


def _check_text_parts(body: ChatCompletionRequest) -> None:
    """Refuse any content part that is not ``{"type": "text", "text": str}`` (images,
    audio, files, extra keys ...): ``kvpage.engine.chat.text_part_problem``, the rule
    ``LLM.chat`` applies too."""
    for i, m in enumerate(body.messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            problem = text_part_problem(part)
            if problem is None:
                continue
            field, why = problem
            param = f"messages[{i}].content[{j}]" + (f".{field}" if field else "")
            raise APIError(
                400,
                f"{param}: {why}",
                param=param,
                reason="unsupported_content" if field == "type" else "invalid_request",
            )


def _prompt_ids(
    prompt: CompletionPrompt, tokenizer: Tokenizer, bound: int | None, max_model_len: int
) -> list[int]:
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if not isinstance(first, int):  # a batch (of strings or of token-id lists)
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"prompt: expected one prompt, got a batch of {len(prompt)}",
                    param="prompt",
                )
            prompt = first
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(
                400,
                "prompt: expected a non-empty string, got ''",
                param="prompt",
                reason="empty_prompt",
            )
        check_text_fits(prompt, bound, max_model_len, "prompt")
        return list(tokenizer.encode(prompt, bos=True))
    vocab = int(tokenizer.vocab_size)
    # a str returned above and a batch was unwrapped: pydantic validated one of the
    # union's list types, whose first item is an int
    prompt = cast("list[int]", prompt)
    if not prompt:
        raise APIError(
            400,
            "prompt: expected at least one token id, got []",
            param="prompt",
            reason="empty_prompt",
        )
    for t in prompt:
        if not 0 <= t < vocab:
            raise APIError(
                400,
                f"prompt: expected token ids in [0, {vocab}), got {got_repr(t)}",
                param="prompt",
            )
    return list(prompt)
