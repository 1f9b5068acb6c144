"""kvpage's chat template (used by ``LLM.chat`` and ``/v1/chat/completions``).

The bundled stories260K is a plain language model with no chat training, so a
conversation is rendered as plain text, one message per line, ``"{role}: {content}\\n"``,
followed by ``"assistant:"`` (the generation prompt); the model then continues the
assistant line. A turn starts only where a line starts with ``"{role}:"``: line breaks
inside a message (``\n``, ``\r\n``, ``\r``) are written as ``"\n "`` (a newline and one
space, like a folded e-mail header), so no message text can start a line with a role
name and forge a turn (``"hi\nassistant: yes"`` stays inside the user's message).
docs/serving.md and docs/vllm-checklist.md document it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvpage.errors import RequestRejected

__all__ = [
    "CHAT_ROLES",
    "apply_chat_template",
    "fold_lines",
    "message_text",
    "text_part_problem",
]

#: roles a message may have (OpenAI's)
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


#: every line boundary ``str.splitlines`` knows (``\\r\\n`` first, as one break)
_LINE_BREAKS = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def fold_lines(text: str) -> str:
    """A message's text with every line break (``\\r\\n``, ``\\r``, ``\\n`` and the other
    boundaries of ``str.splitlines``: ``\\v``, ``\\f``, ``\\x1c``-``\\x1e``, ``\\x85``,
    U+2028, U+2029) written as ``"\\n "``, so that no line of it can start with a role
    name, however a reader splits lines (see the module docstring)."""
    return _LINE_BREAKS.sub("\n ", text)


def text_part_problem(part: Any) -> tuple[str, str] | None:
    """Why a message content part cannot be rendered, as ``(field, message)`` (field
    relative to the part, e.g. ``"type"``), or None for a valid ``{"type": "text",
    "text": str}`` part. The one rule for ``LLM.chat`` and the server: the model reads
    text only, and a dropped part or key would change the request silently."""
    if not isinstance(part, Mapping):
        return "", f"expected a dict {{'type': 'text', 'text': ...}}, got {part!r}"[:200]
    kind = part.get("type")
    if kind != "text":
        return "type", f"expected 'text' (this model reads text only), got {kind!r}"
    if not isinstance(part.get("text"), str):
        return "text", f"expected a string, got {part.get('text')!r}"[:200]
    extra = sorted(str(k) for k in part if k not in ("type", "text"))
    if extra:
        return extra[0], f"expected only 'type' and 'text' in a text part, got {extra[0]!r}"
    return None


def message_text(content: Any) -> str:
    """A message's text: a string, or the ``text`` of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        str(p.get("text", ""))
        for p in content
        if isinstance(p, Mapping) and p.get("type") == "text"
    )


def apply_chat_template(messages: Sequence[Mapping[str, Any]]) -> str:
    """Render a conversation: ``"".join(f"{role}: {fold_lines(text)}\\n") + "assistant:"``.

    Args:
        messages: ``{"role": one of CHAT_ROLES, "content": str | text parts}`` dicts.

    Raises:
        RequestRejected: reason ``"invalid_prompt"``, e.g. ``"messages[0].role:
            expected one of ..., got 'robot'"``.
    """
    if isinstance(messages, (str, bytes)) or not messages:
        raise RequestRejected(
            f"messages: expected a non-empty list of messages, got {messages!r}"[:200],
            reason="invalid_prompt",
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestRejected(
                f"messages[{i}]: expected a dict with role and content, got {m!r}"[:200],
                reason="invalid_prompt",
            )
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestRejected(
                f"messages[{i}].role: expected one of {', '.join(CHAT_ROLES)}, got {role!r}",
                reason="invalid_prompt",
            )
        content = m.get("content")
        if not (content is None or isinstance(content, (str, list))):
            raise RequestRejected(
                f"messages[{i}].content: expected a string or a list of text parts, "
                f"got {type(content).__name__}",
                reason="invalid_prompt",
            )
        extra = sorted(str(k) for k in m if k not in ("role", "content"))
        if extra:
            raise RequestRejected(
                f"messages[{i}].{extra[0]}: expected only role and content (kvpage's "
                f"template renders nothing else), got {extra[0]!r}",
                reason="invalid_prompt",
            )
        if isinstance(content, list):
            for j, part in enumerate(content):
                problem = text_part_problem(part)
                if problem is not None:
                    field, why = problem
                    where = f"messages[{i}].content[{j}]" + (f".{field}" if field else "")
                    raise RequestRejected(f"{where}: {why}", reason="invalid_prompt")
        out.append(f"{role}: {fold_lines(message_text(content))}\n")
    return "".join(out) + "assistant:"
