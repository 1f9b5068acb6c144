"""The structured-output request fields of ``/v1/completions`` and
``/v1/chat/completions`` -> one ``StructuredOutputsParams`` (its dict form) for the
engine.

Accepted, as vLLM's OpenAI server (``vllm/entrypoints/openai/protocol.py``):

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``
  (a JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}`` (the schema; ``strict`` is accepted, kvpage's schemas are
  always strict);
* ``structured_outputs``: the fields of
  :class:`kvpage.engine.structured.StructuredOutputsParams`;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (and ``guided_decoding_backend`` naming ``"xgrammar"`` or ``"auto"``).

At most one of them may ask for a constraint. Each is checked here with xgrammar
(:func:`kvpage.engine.structured.check_constraint`, no tokenizer needed), so a bad schema,
regex or grammar is a 400 naming the field and quoting xgrammar's message (at most 200
characters) before anything is queued.
"""

from __future__ import annotations

from typing import Any

from kvpage.engine.structured import StructuredOutputsParams, check_constraint
from kvpage.errors import RequestRejected, got_repr
from kvpage.server.protocol import APIError

__all__ = ["STRUCTURED_FIELDS", "structured_outputs_of"]

#: the request fields that may carry a constraint (checked in this order)
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_BACKENDS = ("xgrammar", "auto")


def _err(param: str, message: str) -> APIError:
    return APIError(
        400,
        message[:400],
        param=param,
        code="invalid_structured_outputs",
        reason="invalid_structured_outputs",
    )


def _response_format(value: Any) -> tuple[str, dict[str, Any]] | None:
    """``(field blamed, StructuredOutputsParams kwargs)`` of ``response_format``."""
    p = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _err(p, f"{p}: expected an object with a string type, got {got_repr(value)}")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise _err(f"{p}.{extra[0]}", f"{p}.{extra[0]}: expected no such field, got one")
    if kind == "text":
        return None
    if kind == "json_object":
        return p, {"json_object": True}
    if kind != "json_schema":
        raise _err(
            f"{p}.type",
            f"{p}.type: expected 'text', 'json_object' or 'json_schema', got {got_repr(kind)}",
        )
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise _err(
            f"{p}.json_schema",
            f"{p}.json_schema: expected an object with a schema, got {got_repr(js)}",
        )
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise _err(
            f"{p}.json_schema.{unknown[0]}",
            f"{p}.json_schema.{unknown[0]}: expected no such field (name, schema, strict, "
            "description), got one",
        )
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise _err(
            f"{p}.json_schema.schema",
            f"{p}.json_schema.schema: expected a JSON schema object, got {got_repr(schema)}",
        )
    return f"{p}.json_schema.schema", {"json": schema}


def structured_outputs_of(extra: dict[str, Any]) -> dict[str, Any] | None:
    """The constraint a request's fields ask for, as ``StructuredOutputsParams`` keyword
    arguments (None = unconstrained).

    Args:
        extra: the request body's fields (only :data:`STRUCTURED_FIELDS` and
            ``guided_decoding_backend`` / ``guided_whitespace_pattern`` are read).

    Raises:
        APIError: 400, ``param`` the field at fault: two fields asking for a
            constraint, a malformed field, or a constraint xgrammar refuses (its message
            quoted).
    """
    found = _constraints_asked(extra)
    _check_guided_options(extra)
    if not found:
        return None
    if len(found) > 1:
        names = [f[0] for f in found]
        raise _err(
            names[1],
            f"{names[1]}: expected one structured-output constraint per request, got "
            f"{', '.join(names)}",
        )
    field, blamed, kwargs = found[0]
    _check_constraint(field, blamed, kwargs)
    return kwargs


def _constraints_asked(extra: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(field, field blamed for a bad constraint, StructuredOutputsParams kwargs)`` of
    each field of :data:`STRUCTURED_FIELDS` that asks for a constraint, in that order.

    Raises:
        APIError: 400 a malformed ``response_format`` or ``structured_outputs``.
    """
    found: list[tuple[str, str, dict[str, Any]]] = []
    rf = extra.get("response_format")
    if rf is not None:
        got = _response_format(rf)
        if got is not None:
            found.append(("response_format", got[0], got[1]))
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _err(
                "structured_outputs",
                f"structured_outputs: expected an object, got {got_repr(so)}",
            )
        found.append(("structured_outputs", "", dict(so)))
    for name, kind in _GUIDED.items():
        v = extra.get(name)
        if v is not None:
            found.append((name, name, {kind: v}))
    return found


def _check_guided_options(extra: dict[str, Any]) -> None:
    """Refuse vLLM's ``guided_decoding_backend`` other than xgrammar/auto and any
    ``guided_whitespace_pattern`` (not implemented).

    Raises:
        APIError: 400 naming the field.
    """
    backend = extra.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise _err(
            "guided_decoding_backend",
            "guided_decoding_backend: expected null, 'xgrammar' or 'auto' (kvpage's one "
            f"backend), got {got_repr(backend)}",
        )
    ws = extra.get("guided_whitespace_pattern")
    if ws is not None:
        raise _err(
            "guided_whitespace_pattern",
            f"guided_whitespace_pattern: expected null (not implemented by kvpage), got "
            f"{got_repr(ws)}",
        )


def _check_constraint(field: str, blamed: str, kwargs: dict[str, Any]) -> None:
    """Build ``StructuredOutputsParams(**kwargs)`` and compile it with xgrammar.

    Raises:
        APIError: 400, ``param`` the field at fault (``blamed``, else ``field`` or the
            engine's field renamed to ``field``), xgrammar's message quoted.
    """
    try:
        params = StructuredOutputsParams(**kwargs)
    except TypeError as e:
        raise _err(field, f"{field}: expected StructuredOutputsParams fields, got {e}") from None
    except RequestRejected as e:
        msg = _rename(str(e), field)
        raise _err(msg.partition(":")[0], msg) from None
    try:
        check_constraint(params, blamed or None)
    except RequestRejected as e:
        raise _err(blamed or f"{field}.{params.kind}", _rename(str(e), field)) from None


def _rename(message: str, field: str) -> str:
    """A ``structured_outputs...`` engine message with the HTTP field named instead."""
    if field == "structured_outputs" or not message.startswith("structured_outputs"):
        return message
    head, sep, rest = message.partition(":")
    return f"{field}{sep}{rest}" if sep else message
