"""Chat prompts (``LLM.chat``, ``/v1/chat/completions``, ``/tokenize``): the model's Jinja
chat template, or kvpage's plain template for a model that has none.

Which template renders a conversation (:func:`render_chat_prompt`), first found wins:
the request's ``chat_template`` ("request"), the server's / ``LLM.chat``'s default
(``--chat-template FILE``, "server"), the tokenizer's own (``tokenizer_config.json`` or
``chat_template.jinja``, "model"), else kvpage's plain template ("kvpage"). Jinja
templates are rendered by transformers' sandboxed renderer
(``tokenizer.apply_chat_template(..., tokenize=False)``, then the text is encoded without
adding special tokens: the ids equal ``apply_chat_template(..., tokenize=True)``).

kvpage's plain template: the bundled stories260K is a plain language model with no chat
training, so a conversation is rendered as plain text, one message per line,
``"{role}: {content}\n"``, followed by ``"assistant:"`` (the generation prompt); the
model then continues the assistant line. A turn starts only where a line starts with
``"{role}:"``: line breaks inside a message (``\n``, ``\r\n``, ``\r``) are written as
``"\n "`` (a newline and one space, like a folded e-mail header), so no message text can
start a line with a role name and forge a turn (``"hi\nassistant: yes"`` stays inside
the user's message). docs/serving.md and docs/vllm-checklist.md document both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpage.errors import RequestRejected

__all__ = [
    "CHAT_ROLES",
    "RESERVED_TEMPLATE_KWARGS",
    "TEMPLATE_MESSAGE_FIELDS",
    "ChatPrompt",
    "apply_chat_template",
    "fold_lines",
    "load_chat_template",
    "message_text",
    "model_chat_template",
    "render_chat_prompt",
    "text_part_problem",
]

#: message fields besides role and content that a model's Jinja template may render
#: (passed through to it; kvpage's plain template refuses them by name)
TEMPLATE_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id")

#: ``chat_template_kwargs`` keys refused by name: they are arguments of
#: ``apply_chat_template`` itself, not template variables
RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "return_tensors",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
    "sanitize_control_tokens",
)

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


def message_text(content: Any, sep: str = "") -> str:
    """A message's text: a string, or the ``text`` of ``{"type": "text"}`` parts joined
    by ``sep`` (kvpage's plain template: ``""``; a Jinja template gets ``"\n"``, as
    vLLM's "string" content format)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return sep.join(
        str(p.get("text", ""))
        for p in content
        if isinstance(p, Mapping) and p.get("type") == "text"
    )


def _bad(msg: str) -> RequestRejected:
    return RequestRejected(msg[:300], reason="invalid_prompt")


def check_messages(
    messages: Sequence[Mapping[str, Any]], extra_fields: Sequence[str] = ()
) -> list[Mapping[str, Any]]:
    """Check a conversation's shape: a non-empty list of dicts with a role of
    :data:`CHAT_ROLES`, content a string, text parts or None, and no keys but role,
    content and ``extra_fields``.

    Raises:
        RequestRejected: reason ``"invalid_prompt"``, naming the field (e.g.
            ``"messages[0].role: expected one of ..., got 'robot'"``).
    """
    if isinstance(messages, (str, bytes)) or not messages:
        raise _bad(f"messages: expected a non-empty list of messages, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise _bad(f"messages[{i}]: expected a dict with role and content, got {m!r}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role: expected one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if not (content is None or isinstance(content, (str, list))):
            raise _bad(
                f"messages[{i}].content: expected a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        extra = sorted(str(k) for k in m if k not in ("role", "content", *extra_fields))
        if extra:
            if extra_fields:
                why = f"role, content, {', '.join(extra_fields)}"
            else:
                why = (
                    "only role and content (kvpage's plain template renders nothing else; "
                    "a model with a chat template also takes "
                    f"{', '.join(TEMPLATE_MESSAGE_FIELDS)})"
                )
            raise _bad(f"messages[{i}].{extra[0]}: expected {why}, got {extra[0]!r}")
        if isinstance(content, list):
            for j, part in enumerate(content):
                problem = text_part_problem(part)
                if problem is not None:
                    field, why = problem
                    where = f"messages[{i}].content[{j}]" + (f".{field}" if field else "")
                    raise RequestRejected(f"{where}: {why}", reason="invalid_prompt")
    return list(messages)


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render a conversation with kvpage's plain template:
    ``"".join(f"{role}: {fold_lines(text)}\n") + "assistant:"``.

    Args:
        messages: ``{"role": one of CHAT_ROLES, "content": str | text parts}`` dicts.
        add_generation_prompt: end with ``"assistant:"`` (False: end after the last
            message's line).
        continue_final_message: leave the last message open (no ``"\n"`` after it, no
            generation prompt) so the model continues it; it must be an assistant
            message and ``add_generation_prompt`` must be False.

    Raises:
        RequestRejected: reason ``"invalid_prompt"``, e.g. ``"messages[0].role:
            expected one of ..., got 'robot'"``.
    """
    check_messages(messages)
    _check_continue(messages, add_generation_prompt, continue_final_message)
    out = [f"{m['role']}: {fold_lines(message_text(m.get('content')))}\n" for m in messages]
    if continue_final_message:
        out[-1] = out[-1][:-1]
        return "".join(out)
    return "".join(out) + ("assistant:" if add_generation_prompt else "")


def _check_continue(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, continue_final: bool
) -> None:
    for name, v in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final),
    ):
        if not isinstance(v, bool):
            raise _bad(f"{name}: expected a bool, got {v!r}")
    if continue_final and add_generation_prompt:
        raise _bad(
            "continue_final_message: expected add_generation_prompt false with it (vLLM's "
            "rule: a new assistant turn and continuing the last one exclude each other), "
            "got both true"
        )
    if continue_final and messages[-1].get("role") != "assistant":
        raise _bad(
            f"continue_final_message: expected the last message to be an assistant "
            f"message, got role {messages[-1].get('role')!r}"
        )


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation.

    Attributes:
        text: the rendered prompt text.
        prompt_token_ids: its ids, as the engine will see them.
        template: where the template came from: ``"request"``, ``"server"`` (a default
            given to the server / ``LLM.chat``), ``"model"`` (the tokenizer's) or
            ``"kvpage"`` (the plain template; see the module docstring).
    """

    text: str
    prompt_token_ids: list[int]
    template: str


def model_chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's own Jinja chat template, or None (kvpage's tokenizers without
    one, e.g. the bundled llama2.c tokenizer)."""
    t = getattr(tokenizer, "chat_template", None)
    return t if isinstance(t, str) and t else None


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a Jinja template reads them: text parts joined into a string,
    and ``tool_calls[*].function.arguments`` given as a JSON string parsed into a dict
    (HF templates iterate over them; vLLM does the same)."""
    out = []
    for i, m in enumerate(messages):
        d = dict(m)
        if isinstance(d.get("content"), list):
            d["content"] = message_text(d["content"], sep="\n")
        calls = d.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls: expected a list, got {calls!r}")
            fixed = []
            for j, c in enumerate(calls):
                if not isinstance(c, Mapping):
                    raise _bad(f"messages[{i}].tool_calls[{j}]: expected a dict, got {c!r}")
                c = dict(c)
                fn = c.get("function")
                if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except json.JSONDecodeError as e:
                        raise _bad(
                            f"messages[{i}].tool_calls[{j}].function.arguments: expected a "
                            f"JSON object, got {e}"
                        ) from None
                    c["function"] = {**fn, "arguments": args}
                fixed.append(c)
            d["tool_calls"] = fixed
        out.append(d)
    return out


def render_chat_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    default_chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> ChatPrompt:
    """Render and tokenize a conversation with the template chosen as the module
    docstring says.

    Args:
        tokenizer: a kvpage tokenizer; an ``HFTokenizer`` (``.hf``) renders with its
            transformers tokenizer (its special tokens are template variables).
        messages: ``{"role", "content"}`` dicts; with a Jinja template they may also
            carry :data:`TEMPLATE_MESSAGE_FIELDS`.
        chat_template: the request's Jinja template (a string), or None.
        default_chat_template: the server's / caller's default template, or None.
        chat_template_kwargs: extra template variables (e.g. ``enable_thinking``);
            keys in :data:`RESERVED_TEMPLATE_KWARGS` are refused.
        add_generation_prompt: end with the template's assistant header.
        continue_final_message: continue the last (assistant) message instead.
        tools: OpenAI tool definitions (``{"type": "function", "function": {...}}``),
            given to a Jinja template as its ``tools`` variable (transformers'
            ``apply_chat_template(tools=...)``; templates that do not use it ignore it).
            kvpage's plain template has no place for them: it renders none (a forced
            tool call is still enforced by its JSON schema, see
            ``kvpage.engine.tool_calls``).

    Returns:
        The :class:`ChatPrompt`. Jinja: ids = ``tokenizer.encode(text, bos=False)``
        (the template writes any BOS itself), equal to transformers'
        ``apply_chat_template(..., tokenize=True)``. Plain template: ids =
        ``tokenizer.encode(text, bos=True)``.

    Raises:
        RequestRejected: reason ``"invalid_prompt"``: malformed messages, a field the
            template cannot take, or a template that fails to render (its message, e.g.
            a template's ``raise_exception``).
    """
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise _bad(
            f"chat_template: expected a non-empty Jinja template string, got {chat_template!r}"
        )
    template: str | None
    if chat_template is not None:
        template, source = chat_template, "request"
    elif default_chat_template is not None:
        template, source = default_chat_template, "server"
    else:
        template, source = model_chat_template(tokenizer), "model"
    if template is None:
        if kwargs:
            raise _bad(
                f"chat_template_kwargs: expected none with kvpage's plain chat template (the "
                f"model has no chat template; it has no variables), got {sorted(kwargs)}"
            )
        text = apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return ChatPrompt(text, list(tokenizer.encode(text, bos=True)), "kvpage")
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS or not isinstance(k, str))
    if reserved:
        raise _bad(
            f"chat_template_kwargs.{reserved[0]}: expected a template variable, got "
            f"{reserved[0]!r} (an argument of apply_chat_template, set by its own field)"
        )
    check_messages(messages, TEMPLATE_MESSAGE_FIELDS)
    _check_continue(messages, add_generation_prompt, continue_final_message)
    conv = _template_messages(messages)
    if tools:
        kwargs["tools"] = [dict(t) for t in tools]
    text = _render_jinja(
        tokenizer, conv, template, kwargs, add_generation_prompt, continue_final_message
    )
    return ChatPrompt(text, list(tokenizer.encode(text, bos=False)), source)


def _render_jinja(
    tokenizer: Any,
    conv: list[dict[str, Any]],
    template: str,
    kwargs: dict[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    """Render with transformers' sandboxed Jinja renderer (``apply_chat_template`` of
    an HF tokenizer; ``render_jinja_template`` for kvpage's own tokenizers)."""
    try:
        import jinja2
    except ImportError as e:  # pragma: no cover - jinja2 comes with transformers' chat extra
        raise _bad(f"chat_template: expected jinja2 installed, got {e}") from e
    try:
        hf = getattr(tokenizer, "hf", None)
        if hf is not None:
            out = hf.apply_chat_template(
                conv,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
            return str(out)
        from transformers.utils.chat_template_utils import render_jinja_template

        conv = [{k: v for k, v in m.items() if v is not None} for m in conv]
        # returns (rendered texts, generation indices); typed as str upstream
        rendered: Any = render_jinja_template(
            conversations=[conv],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        return str(rendered[0][0])
    except ImportError as e:  # pragma: no cover - transformers is an extra
        raise _bad(f"chat_template: expected transformers installed, got {e}") from e
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _bad(
            f"chat_template: expected a template that renders these messages, got {why}"
        ) from None


#: characters that mark a ``--chat-template`` value as a template, not a file path
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """A ``--chat-template`` value as a template: the text of the file it names, or
    the value itself when it holds Jinja characters (``{``, ``}`` or a newline), as
    vLLM's ``load_chat_template`` reads it.

    Raises:
        SpecError: the value looks like a path and the file cannot be read, or the
            template is empty or not valid Jinja.
    """
    from pathlib import Path

    from kvpage.errors import SpecError

    if value is None:
        return None
    if any(c in value for c in _JINJA_CHARS):
        text = value
    else:
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(
                f"chat_template: expected a readable template file (or a Jinja template "
                f"string), got {value!r} ({type(e).__name__}: {e})"[:300]
            ) from None
    if not text.strip():
        raise SpecError(f"chat_template: expected a non-empty template, got {value!r}"[:200])
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(text)
    except ImportError:  # pragma: no cover - transformers is an extra
        pass
    except Exception as e:  # jinja2.TemplateSyntaxError and kin
        raise SpecError(
            f"chat_template {value!r}: expected a valid Jinja template, got {e}"[:300]
        ) from None
    return text
