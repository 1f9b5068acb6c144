"""Tool-call building blocks (kvpage.engine.tool_calls): the Hermes and Llama-3 JSON
parsers, tools validation, and tool_choice "required" / named enforced by a JSON schema
on the bundled model (every output parses into calls whose arguments validate)."""

from __future__ import annotations

import json

import pytest

from kvpage.engine import LLM, SamplingParams
from kvpage.engine.tool_calls import (
    TOOL_PARSERS,
    calls_from_constrained,
    check_tools,
    parse_hermes,
    parse_llama3_json,
    tool_choice_constraint,
)
from kvpage.errors import RequestRejected

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "x", "parameters": ADD}},
]


def _args(call: dict) -> object:  # type: ignore[type-arg]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    return json.loads(call["function"]["arguments"])


def test_hermes_parser() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    content, calls = parse_hermes(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert _args(calls[0]) == {"city": "Oslo"} and _args(calls[1]) == {"a": 1}
    assert content == "Let me check.\n\n<tool_call>not json</tool_call>"
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert TOOL_PARSERS["hermes"] is parse_hermes


def test_llama3_json_parser() -> None:
    content, calls = parse_llama3_json('<|python_tag|>{"name": "add", "parameters": {"a": 2}}')
    assert content == "" and _args(calls[0]) == {"a": 2}
    content, calls = parse_llama3_json(
        '{"name": "add", "arguments": {"a": 1}}; {"name": "get_weather", "parameters": {}}'
    )
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    for plain in ("Hello there", '{"name": 3}', '{"name": "add"} trailing', '{"name": "a"'):
        assert parse_llama3_json(plain) == (plain, [])
    assert TOOL_PARSERS["llama3_json"] is parse_llama3_json


def test_bad_tools_refused_by_name() -> None:
    cases = [
        ([], "tools: expected a non-empty list"),
        ([{"type": "code"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "a", "x": 1}}], "tools[0].function.x"),
        (TOOLS + [TOOLS[0]], "tools[2].function.name: expected a name used once"),
    ]
    for tools, msg in cases:
        with pytest.raises(RequestRejected, match=msg.replace("[", r"\[").replace("]", r"\]")):
            check_tools(tools)
    with pytest.raises(RequestRejected, match="tool_choice.function.name"):
        tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert tool_choice_constraint(TOOLS, "auto") is None
    assert tool_choice_constraint(TOOLS, "none") is None


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_choice_enforced_by_schema(choice: object) -> None:
    llm = LLM("stories260K")
    so = tool_choice_constraint(TOOLS, choice, parallel_tool_calls=False)
    assert so is not None
    so["disable_any_whitespace"] = True
    sp = SamplingParams(n=4, seed=2, max_tokens=300, structured_outputs=so)
    (out,) = llm.generate(["The weather today"], sp, use_tqdm=False)
    by_name = {"get_weather": WEATHER, "add": ADD}
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        calls = calls_from_constrained(c.text, choice)
        assert len(calls) == 1
        for call in calls:
            name = call["function"]["name"]
            if isinstance(choice, dict):
                assert name == "get_weather"
            jsonschema.validate(_args(call), by_name[name])


def test_releasable_streams_only_surely_content() -> None:
    from kvpage.engine.tool_calls import releasable

    text = "Sure. <tool_call>" + '{"name": "add", "arguments": {}}</tool_call> ok'
    seen = [releasable("hermes", text[:k]) for k in range(len(text) + 1)]
    assert seen == sorted(seen) and max(seen) == len("Sure.")
    assert releasable("hermes", "Hi <tool_") == 2 and releasable("hermes", "plain") == 5
    assert releasable("llama3_json", ' {"name"') == 0
    assert releasable("llama3_json", "<|python") == 0
    assert releasable("llama3_json", "Hello") == 5
