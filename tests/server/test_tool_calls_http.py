"""Forced tool calls on /v1/chat/completions with the official openai client against a
real uvicorn: ``tool_choice: "required"`` and a named function always return
``tool_calls`` whose arguments validate against the function's parameters (streamed as
a ``delta.tool_calls`` too), finish reason "tool_calls"; "none" answers text; "auto" and
malformed tools are refused by name."""

from __future__ import annotations

import json

import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

M = "stories260K"
MSG = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def client(serve):  # type: ignore[no-untyped-def]
    srv = serve()
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k", max_retries=0)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice_returns_valid_tool_calls(client: openai.OpenAI, choice) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(
        model=M,
        messages=MSG,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        parallel_tool_calls=False,
        n=3,
        seed=5,
        max_tokens=300,
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and c.message.tool_calls
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    stream = client.chat.completions.create(
        model=M,
        messages=MSG,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        parallel_tool_calls=False,
        seed=6,
        max_tokens=300,
        stream=True,
    )
    calls, finish, content = [], None, ""
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    fn = calls[0].function
    jsonschema.validate(json.loads(fn.arguments), SCHEMAS[fn.name])


def test_tool_choice_none_answers_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=M,
        messages=MSG,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=5,  # type: ignore[arg-type]
    )
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": TOOLS}, "tool_choice"),  # "auto" is the default with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "a b"}}],
                "tool_choice": "required",
            },
            "tools[0].function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "zz"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_refused_by_name(client: openai.OpenAI, extra, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=M, messages=MSG, max_tokens=4, extra_body=extra)
    body = ei.value.body
    assert isinstance(body, dict) and body["param"] == param, body


HERMES_DRAFT = r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [0-9]\}\}</tool_call>'


def test_auto_parses_hermes_calls_and_returns_text_without_one(serve) -> None:  # type: ignore[no-untyped-def]
    srv = serve(enable_auto_tool_choice=True, tool_call_parser="hermes")
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k", max_retries=0)
    kw = {"model": M, "messages": MSG, "tools": TOOLS, "max_tokens": 80, "seed": 1}
    # the model is made to emit a Hermes call with a constrained draft (a regex)
    r = c.chat.completions.create(**kw, extra_body={"guided_regex": HERMES_DRAFT})  # type: ignore[arg-type]
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure."
    (call,) = ch.message.tool_calls or []
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    stream = c.chat.completions.create(
        **kw,  # type: ignore[arg-type]
        stream=True,
        extra_body={"guided_regex": HERMES_DRAFT},
    )
    calls, content, finish = [], "", None
    for chunk in stream:
        for x in chunk.choices:
            calls += x.delta.tool_calls or []
            content += x.delta.content or ""
            finish = x.finish_reason or finish
    assert (finish, content, [t.function.name for t in calls]) == ("tool_calls", "Sure.", ["add"])
    # no call in the reply: plain text, streamed as it comes (not held to the end)
    no_call = {"guided_regex": "[a-z ]{10,30}"}
    r = c.chat.completions.create(**kw, extra_body=no_call)  # type: ignore[arg-type]
    ch = r.choices[0]
    assert ch.message.tool_calls is None and ch.finish_reason == "stop"
    assert ch.message.content and "<tool_call>" not in ch.message.content
    parts = [
        x.delta.content
        for chunk in c.chat.completions.create(**kw, stream=True, extra_body=no_call)  # type: ignore[arg-type]
        for x in chunk.choices
        if x.delta.content
    ]
    assert "".join(parts) == ch.message.content and len(parts) > 1


def test_auto_tool_choice_needs_a_parser() -> None:
    from pydantic import ValidationError

    from kvpage.server.config import ServerConfig

    with pytest.raises(ValidationError, match="tool_call_parser"):
        ServerConfig.model_validate({"enable_auto_tool_choice": True})
