"""Structured outputs over HTTP with the official openai client against a real uvicorn:
``response_format`` json_schema for Hypothesis-generated schemas (objects, arrays,
enums, nesting, required, bounded numbers, strings with patterns) validated with
``jsonschema`` across n > 1 and streaming; a mixed batch with unconstrained requests;
json_object; regex, choice and grammar through ``structured_outputs`` and vLLM's
``guided_*`` fields on both endpoints; bad constraints refused with 400 naming the
field and quoting xgrammar."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

M = "stories260K"
PROMPT = "Once upon a time"
MSG = [{"role": "user", "content": "Tell me about a cat."}]


@pytest.fixture(scope="module")
def server(serve):  # type: ignore[no-untyped-def]
    return serve()


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0)


# ---- schemas: every one has a finite language (bounded strings, arrays, numbers) -----
_NAMES = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
_LEAVES = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 500),
    ),
    st.builds(
        lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
        st.integers(-10, 10),
        st.integers(1, 100),
    ),
    st.just({"type": "boolean"}),
    st.builds(
        lambda vs: {"enum": vs},
        st.lists(st.text(alphabet="xyz ", min_size=1, max_size=4), min_size=1, max_size=3),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.sampled_from(
        [
            {"type": "string", "pattern": "^[a-z]{1,6}$"},
            {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
        ]
    ),
)


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
        req = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        return {"type": "object", "properties": props, "required": req}

    return st.builds(
        build,
        st.dictionaries(_NAMES, children, min_size=1, max_size=3),
        st.data(),
    )


def _array(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda it, n: {"type": "array", "items": it, "maxItems": n}, children, st.integers(0, 3)
    )


SCHEMAS = st.recursive(_LEAVES, lambda ch: st.one_of(_object(ch), _array(ch)), max_leaves=5).filter(
    lambda s: s.get("type") in ("object", "array")
)


def _check_schema(client: openai.OpenAI, schema: dict[str, Any]) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    r = client.completions.create(
        model=M, prompt=PROMPT, max_tokens=400, n=2, seed=11, extra_body={"response_format": rf}
    )
    for c in r.choices:
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    stream = client.chat.completions.create(
        model=M, messages=MSG, max_tokens=400, seed=12, stream=True, response_format=rf
    )
    text, finish = "", None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS)
def test_json_schema_outputs_validate(client: openai.OpenAI, schema: dict[str, Any]) -> None:
    _check_schema(client, schema)


@pytest.mark.slow
@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS)
def test_json_schema_outputs_validate_50(client: openai.OpenAI, schema: dict[str, Any]) -> None:
    _check_schema(client, schema)


ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "status": {"enum": ["paid", "open"]},
        "items": {
            "type": "array",
            "maxItems": 2,
            "items": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
    },
    "required": ["id", "status", "items"],
}


def test_mixed_batch_with_unconstrained_requests(client: openai.OpenAI) -> None:
    def plain() -> str:
        r = client.completions.create(model=M, prompt=PROMPT, max_tokens=30, temperature=0)
        return r.choices[0].text

    rf = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}

    def constrained(seed: int) -> str:
        r = client.chat.completions.create(
            model=M, messages=MSG, max_tokens=300, seed=seed, response_format=rf
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content or ""

    alone = plain()
    with ThreadPoolExecutor(6) as ex:
        cons = [ex.submit(constrained, s) for s in range(4)]
        plains = [ex.submit(plain) for _ in range(2)]
        for f in cons:
            jsonschema.validate(json.loads(f.result()), ORDER)
        assert [f.result() for f in plains] == [alone, alone]


def test_json_object_regex_choice_grammar(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=M, messages=MSG, max_tokens=120, seed=3, response_format={"type": "json_object"}
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content or ""), dict)
    else:
        assert (c.message.content or "").lstrip().startswith("{")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"guided_regex": r"[0-9]{2}-[a-z]{3}"}, r"[0-9]{2}-[a-z]{3}"),
        ({"structured_outputs": {"regex": r"(ab|cd){2}"}}, r"(ab|cd){2}"),
        ({"guided_choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
        ({"guided_grammar": 'root ::= "<" [0-9] [0-9]? ">"'}, r"<[0-9]{1,2}>"),
        ({"guided_json": {"enum": [1, 2, 3]}, "guided_decoding_backend": "xgrammar"}, r"[123]"),
    ]
    for extra, pattern in cases:
        r1 = client.completions.create(
            model=M, prompt=PROMPT, max_tokens=40, n=2, seed=4, extra_body=extra
        )
        r2 = client.chat.completions.create(
            model=M, messages=MSG, max_tokens=40, stream=False, extra_body=extra
        )
        texts = [c.text for c in r1.choices] + [r2.choices[0].message.content or ""]
        for t in texts:
            assert re.fullmatch(pattern, t), (extra, t)


BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "zz"}}}},
        "response_format.json_schema.schema",
        "Unsupported type",
    ),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"guided_json": "{not json"}, "guided_json", "expected a JSON schema"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar", "nope"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured-output"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", ""),
    ({"guided_whitespace_pattern": " *", "guided_regex": "a"}, "guided_whitespace_pattern", ""),
    (
        {"structured_outputs": {"regex": "a", "structural_tag": "x"}},
        "structured_outputs.structural_tag",
        "not implemented",
    ),
]


@pytest.mark.parametrize("extra,param,quote", BAD)
def test_bad_constraints_get_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str, quote: str
) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=M, prompt=PROMPT, max_tokens=4, extra_body=extra)
    body = ei.value.body
    assert isinstance(body, dict)
    assert body["param"] == param, body
    assert body["message"].startswith(param + ":") and quote in body["message"], body
    assert len(body["message"]) <= 400
