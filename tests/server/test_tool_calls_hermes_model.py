"""Tool calling on a model whose tokenizer folder has a Hermes-style chat template (a
tiny random-weight Qwen2 folder built offline, ``kvpage.testing.hf_folders``), with the
official openai client against a real uvicorn: the template shows the tools to the
model (prompt ids equal transformers' ``apply_chat_template(tools=...)``), forced
choices return ``tool_calls`` that validate against the function's parameters, the
Hermes parser reads a call the model emits under ``auto`` (forced with a constrained
draft) and returns plain text when there is none, and a tool result goes back as a
``role: "tool"`` message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
MSGS = [{"role": "user", "content": "add one"}]
SMALL = {"num_blocks": 256, "block_size": 16, "max_model_len": 1024}
DRAFT = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def hermes(serve: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, openai.OpenAI]:
    from kvpage.testing.hf_folders import HERMES_TEMPLATE, make_chat_folder

    folder = make_chat_folder(
        tmp_path_factory.mktemp("hermes") / "m",
        "qwen",
        chat_template=HERMES_TEMPLATE,
        max_position_embeddings=1024,
        generation_config=False,
    )
    srv = serve(
        engine={"model": str(folder), **SMALL},
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    return folder, openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k", max_retries=0)


def _hf_prompt_len(folder: Path, messages: list[dict[str, Any]]) -> int:
    """transformers' prompt length, with each call's JSON ``arguments`` given to the
    template as an object (what kvpage and vLLM pass)."""
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    messages = json.loads(json.dumps(messages))
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    out = hf.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, return_dict=True
    )
    return len(out["input_ids"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_on_a_hermes_template(hermes: Any, choice: Any) -> None:
    folder, client = hermes
    r = client.chat.completions.create(
        model=str(folder),
        messages=MSGS,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        parallel_tool_calls=False,
        n=2,
        seed=3,
        max_tokens=200,
    )
    assert r.usage is not None and r.usage.prompt_tokens == _hf_prompt_len(folder, MSGS)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls or []
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_auto_parses_the_models_hermes_call_and_takes_the_tool_result(hermes: Any) -> None:
    folder, client = hermes
    kw: dict[str, Any] = {"model": str(folder), "tools": TOOLS, "max_tokens": 60, "seed": 1}
    r = client.chat.completions.create(messages=MSGS, extra_body={"guided_regex": DRAFT}, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    (call,) = ch.message.tool_calls or []
    assert call.function.name == "add"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, ADD)
    # no call in the reply: plain text
    r = client.chat.completions.create(
        messages=MSGS, extra_body={"guided_regex": "[a-z ]{5,20}"}, **kw
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    # the tool's result goes back; the template renders the call and the response
    turn = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": call.function.model_dump()}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + 1)},
    ]
    r = client.chat.completions.create(messages=turn, **{**kw, "max_tokens": 4})  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == _hf_prompt_len(folder, turn)
