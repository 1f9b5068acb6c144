"""Tool calling building blocks: the JSON schemas that enforce ``tool_choice`` and the
parsers that find tool calls in generated text.

The server (``kvpage.server.validation``, ``kvpage.server.protocol.tool_reply``) uses
them on ``/v1/chat/completions`` (docs/serving.md, "Tool calling"); rendering the tools
into the prompt is the chat template's job, not done here:

* :func:`check_tools` validates OpenAI ``tools`` (``[{"type": "function", "function":
  {"name", "description", "parameters", "strict"}}]``);
* :func:`tool_choice_constraint` gives the ``StructuredOutputsParams`` keyword arguments
  that force a call: ``"required"`` -> a JSON array of one or more ``{"name",
  "parameters"}`` objects, each valid for one of the tools (vLLM's rule); a named
  function -> its ``parameters`` schema; ``"none"`` / ``"auto"`` -> None;
* :func:`calls_from_constrained` turns such a constrained output into OpenAI
  ``tool_calls``;
* :data:`TOOL_PARSERS` (``--tool-call-parser`` names, as vLLM's): ``hermes`` (Hermes /
  Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text outside
  them is the message content) and ``llama3_json`` (Llama 3.x: the whole reply, after an
  optional ``<|python_tag|>``, is ``{"name": ..., "parameters"|"arguments": {...}}``, several
  joined by ``;``). A parser returns ``(content, tool_calls)``; text that is not a
  well-formed call stays content (never dropped).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from kvpage.errors import RequestRejected

__all__ = [
    "TOOL_PARSERS",
    "calls_from_constrained",
    "check_tools",
    "parse_hermes",
    "parse_llama3_json",
    "releasable",
    "tool_choice_constraint",
]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function-name rule


def _bad(name: str, expected: str, got: object) -> RequestRejected:
    return RequestRejected(
        f"{name}: expected {expected}, got {got!r}"[:300], reason="invalid_tools"
    )


def check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """Validate OpenAI ``tools``; returns ``{name: parameters schema}`` (in order).

    Raises:
        RequestRejected: reason ``"invalid_tools"``, naming ``tools[i]...``.
    """
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "a non-empty list of function tools", tools)
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"{where}.type", "'function'", t.get("type") if isinstance(t, dict) else t)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "an object", fn)
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise _bad(f"{where}.function.{extra[0]}", "no such field", fn[extra[0]])
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", "1-64 characters of [A-Za-z0-9_-]", name)
        if name in out:
            raise _bad(f"{where}.function.name", "a name used once", name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "a JSON schema object", params)
        out[name] = params
    return out


def tool_choice_constraint(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool = True
) -> dict[str, Any] | None:
    """The ``StructuredOutputsParams`` keyword arguments that enforce ``tool_choice``.

    Args:
        tools: the request's ``tools`` (validated with :func:`check_tools`).
        tool_choice: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function",
            "function": {"name": ...}}``.
        parallel_tool_calls: OpenAI's field; False caps ``"required"`` at one call.

    Returns:
        ``{"json": schema}`` for ``"required"`` and a named function, None otherwise.

    Raises:
        RequestRejected: reason ``"invalid_tools"``: a malformed choice or an unknown name.
    """
    schemas = check_tools(tools)
    if tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        one = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"],
            }
            for n, p in schemas.items()
        ]
        item = one[0] if len(one) == 1 else {"anyOf": one}
        arr: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
        if not parallel_tool_calls:
            arr["maxItems"] = 1
        return {"json": arr}
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(fn, dict)
    ):
        raise _bad(
            "tool_choice",
            "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            tool_choice,
        )
    name = fn.get("name")
    if name not in schemas:
        raise _bad("tool_choice.function.name", f"one of {sorted(schemas)}", name)
    return {"json": schemas[name]}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def calls_from_constrained(text: str, tool_choice: Any) -> list[dict[str, Any]]:
    """The OpenAI ``tool_calls`` of an output generated under
    :func:`tool_choice_constraint` (``"required"``: the JSON array; a named function:
    the arguments object).

    Raises:
        ValueError: the text is not the constrained JSON (it was cut by ``max_tokens``).
    """
    value = json.loads(text)
    if tool_choice == "required":
        return [_call(c["name"], c["parameters"]) for c in value]
    return [_call(tool_choice["function"]["name"], value)]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes / Qwen calls: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks.

    Returns:
        ``(content, tool_calls)``: the text outside well-formed blocks (stripped) and the
        calls in order; a block whose body is not ``{"name": str, "arguments": ...}``
        stays in the content.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            continue
        kept.append(text[pos : m.start()])
        calls.append(_call(obj["name"], obj.get("arguments", {})))
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def parse_llama3_json(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Llama 3.x JSON calls: the reply (after an optional ``<|python_tag|>``) is one or
    more ``{"name": ..., "parameters" | "arguments": {...}}`` objects joined by ``;``.

    Returns:
        ``("", tool_calls)`` when the whole reply is such calls, else ``(text, [])``.
    """
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].lstrip()
    if not body.startswith("{"):
        return text, []
    dec = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    i = 0
    while i < len(body):
        try:
            obj, end = dec.raw_decode(body, i)
        except ValueError:
            return text, []
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return text, []
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append(_call(obj["name"], args))
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return text, []
        i = len(body) - len(rest[1:].lstrip())
    return "", calls


def releasable(parser: str, text: str) -> int:
    """How many leading characters of a reply still being generated are content for
    sure (may be streamed before the reply is parsed): for ``hermes``, the text before a
    ``<tool_call>`` tag (and before a trailing partial tag and trailing whitespace); for
    ``llama3_json``, all of it unless the reply starts like a call (``{`` or
    ``<|python_tag|>``), then nothing. Never decreases as ``text`` grows."""
    if parser == "hermes":
        tag = "<tool_call>"
        i = text.find(tag)
        if i < 0:
            i = len(text)
            for k in range(min(len(tag) - 1, len(text)), 0, -1):
                if text.endswith(tag[:k]):
                    i = len(text) - k
                    break
        return len(text[:i].rstrip())
    body = text.lstrip()
    tag = "<|python_tag|>"
    if not body or body.startswith("{") or body.startswith(tag) or tag.startswith(body):
        return 0
    return len(text)


#: ``--tool-call-parser`` name -> parser (vLLM's names)
TOOL_PARSERS: dict[str, Callable[[str], tuple[str, list[dict[str, Any]]]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}
