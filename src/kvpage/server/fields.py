"""The request-field allow-list: which OpenAI / vLLM request fields kvpage implements,
which it knows but refuses, and what counts as unknown.

Every top-level field of a ``/v1/completions`` or ``/v1/chat/completions`` body is one of:

* implemented: a field of :class:`kvpage.server.protocol.CompletionRequest` /
  :class:`~kvpage.server.protocol.ChatCompletionRequest` (validated, then honoured);
* known but not implemented: a field of OpenAI's or vLLM's schema for that endpoint
  (listed below, from the OpenAI API reference and vLLM's
  ``vllm/entrypoints/openai/protocol.py``). It is accepted only with a value that
  asks for nothing (its default: null, false, an empty list or map, ...), and refused
  with 400 naming it otherwise;
* unknown: anything else. Refused with 400 naming it, unless the server runs with
  ``--allow-unknown-fields`` (then ignored, as many OpenAI-compatible servers do).

So a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from typing import Any

from kvpage.errors import got_repr

__all__ = [
    "CHAT_NOT_IMPLEMENTED",
    "COMPLETION_NOT_IMPLEMENTED",
    "check_extra_fields",
]

_NULL: tuple[Any, ...] = (None,)
_FALSE: tuple[Any, ...] = (None, False)
_EMPTY: tuple[Any, ...] = (None, [], {})

#: fields both endpoints share that kvpage does not implement -> values that ask for
#: nothing (accepted and ignored); any other value is refused
_COMMON: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "logit_bias": _EMPTY,
    "use_beam_search": _FALSE,
    "length_penalty": (None, 1, 1.0),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": _NULL,
    "allowed_token_ids": _NULL,
    "bad_words": _EMPTY,
    "structural_tag": _NULL,
    "request_id": _NULL,
    "logits_processors": _EMPTY,
    "return_tokens_as_token_ids": _FALSE,
    "return_token_ids": _FALSE,
    "kv_transfer_params": _NULL,
    "vllm_xargs": _NULL,
    "prompt_embeds": _NULL,
    "mm_processor_kwargs": _NULL,
    "seed_per_choice": _NULL,
}

#: ``/v1/completions`` fields kvpage knows and does not implement (see module docstring)
COMPLETION_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    **_COMMON,
    "suffix": (None, ""),
    "add_special_tokens": (None, True),
}

#: ``/v1/chat/completions`` fields kvpage knows and does not implement
CHAT_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    **_COMMON,
    "echo": _FALSE,
    "functions": _EMPTY,
    "function_call": (None, "none"),
    "audio": _NULL,
    "modalities": (None, ["text"]),
    "prediction": _NULL,
    "reasoning_effort": _NULL,
    "web_search_options": _NULL,
    "verbosity": _NULL,
    "metadata": _EMPTY,
    "store": _FALSE,
    "service_tier": (None, "auto", "default"),
    "prompt_cache_key": _NULL,
    "safety_identifier": _NULL,
    "add_special_tokens": (None, False),
    "documents": _NULL,
}


def _asks_nothing(value: Any, noops: tuple[Any, ...]) -> bool:
    # bool is an int subclass: True == 1 would pass for ``best_of: 1``, so compare types
    return any(type(value) is type(v) and value == v for v in noops) or (
        value is None and None in noops
    )


def check_extra_fields(
    kind: str, extra: dict[str, Any], *, allow_unknown: bool
) -> tuple[str, str] | None:
    """The first extra field a request may not carry, as ``(name, message)``.

    Args:
        kind: ``"completion"`` or ``"chat"``.
        extra: the body's fields that are not implemented fields of the request model.
        allow_unknown: ignore fields outside both schemas (``--allow-unknown-fields``).

    Returns:
        None when every field is acceptable, else the field's name and the 400 message.
    """
    table = CHAT_NOT_IMPLEMENTED if kind == "chat" else COMPLETION_NOT_IMPLEMENTED
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    for name in sorted(extra):
        value = extra[name]
        noops = table.get(name)
        if noops is not None:
            if not _asks_nothing(value, noops):
                shown = ", ".join("null" if v is None else repr(v) for v in noops)
                return name, (
                    f"{name}: expected unset or one of {shown} (not implemented by kvpage), "
                    f"got {got_repr(value)}"[:300]
                )
        elif not allow_unknown:
            return name, (
                f"{name}: expected no such field (unknown to the OpenAI and vLLM schemas of "
                f"{endpoint}; start the server with --allow-unknown-fields to ignore "
                f"unknown fields), got {got_repr(value)}"[:300]
            )
    return None
