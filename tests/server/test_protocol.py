"""OpenAI request models, the chat template and request validation (no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    render_chat,
)
from kvpage.server.validation import prepare_request


class _Tok:
    """A byte-level stand-in tokenizer: BOS = 1, token = byte + 3."""

    vocab_size = 259

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([1] if bos else []) + [b + 3 for b in text.encode()]


def _prep(body, kind="completion", key=None, mml=64):
    return prepare_request(kind, body, key, model_name="m", tokenizer=_Tok(), max_model_len=mml)


def test_chat_template_is_plain_text():
    msgs = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}]),
    ]
    chat = render_chat(msgs, _Tok())
    assert chat.text == "system: Be brief.\nuser: Hi\nassistant:" and chat.template == "kvpage"
    assert chat.prompt_token_ids == _Tok().encode(chat.text, bos=True)


@pytest.mark.parametrize(
    "body",
    [
        '{"model": "m", "prompt": "x", "max_tokens": true}',
        '{"model": "m", "prompt": "x", "max_tokens": 2.0}',
        '{"model": "m", "prompt": "x", "n": "2"}',
        '{"model": "m", "prompt": "x", "top_p": 0}',
        '{"model": "m", "prompt": "x", "temperature": 3}',
        '{"model": "m", "prompt": {"a": 1}}',
        '{"model": 5, "prompt": "x"}',
    ],
)
def test_strict_types(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json(body)


def test_prepare_resolves_defaults_cost_and_tenant():
    r = _prep(CompletionRequest.model_validate_json('{"model": "m", "prompt": "abc", "n": 2}'))
    assert r.prompt_token_ids == [1, 100, 101, 102] and r.max_tokens == 16
    assert r.cost == 4 + 2 * 16 and r.tenant == "anonymous"
    r = _prep(
        CompletionRequest.model_validate_json('{"model": "m", "prompt": [[5, 6]], "user": "u"}')
    )
    assert r.prompt_token_ids == [5, 6] and r.tenant == "u"
    assert _prep(CompletionRequest(model="m", prompt="a", user="u"), key="k").tenant == "k"
    chat = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    )
    r = _prep(chat, kind="chat")
    assert r.max_tokens == 64 - len(r.prompt_token_ids)  # room left in the context
    r = _prep(chat.model_copy(update={"max_completion_tokens": 5}), kind="chat")
    assert r.max_tokens == 5


@pytest.mark.parametrize(
    "body,status,param",
    [
        ('{"model": "other", "prompt": "a"}', 404, "model"),
        ('{"model": "m", "prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
        ('{"model": "m", "prompt": "a", "best_of": 2}', 400, "best_of"),
        ('{"model": "m", "prompt": "a", "min_tokens": 20}', 400, "min_tokens"),
        ('{"model": "m", "prompt": "a", "mystery": null}', 400, "mystery"),
        ('{"model": "m", "prompt": [300]}', 400, "prompt"),
        ('{"model": "m", "prompt": [[1], [2]]}', 400, "prompt"),
        ('{"model": "m", "prompt": []}', 400, "prompt"),
        ('{"model": "m", "prompt": "' + "x" * 63 + '"}', 400, "prompt"),
        ('{"model": "m", "prompt": "abc", "max_tokens": 61}', 400, "max_tokens"),
    ],
)
def test_prepare_refusals(body, status, param):
    with pytest.raises(APIError) as ei:
        _prep(CompletionRequest.model_validate_json(body))
    assert ei.value.status == status and ei.value.param == param
    assert ": expected " in ei.value.message


def test_limits_are_inclusive():
    ok = _prep(
        CompletionRequest.model_validate_json('{"model": "m", "prompt": "abc", "max_tokens": 60}')
    )
    assert len(ok.prompt_token_ids) + ok.max_tokens == 64
    ok = _prep(
        CompletionRequest.model_validate_json(
            '{"model": "m", "prompt": "' + "x" * 62 + '", "max_tokens": 1}'
        )
    )
    assert len(ok.prompt_token_ids) == 63


def test_overlong_text_is_refused_before_encoding():
    """Finding: a 12 KB prompt was tokenized (seconds) before being found too long. With
    a known bytes-per-token bound the refusal needs no encode; near the bound it encodes."""
    from kvpage.models.tokenizer import Llama2cTokenizer, bundled_tokenizer_path
    from kvpage.server.validation import max_token_bytes, min_prompt_tokens

    tok = Llama2cTokenizer(bundled_tokenizer_path())
    bound = max_token_bytes(tok)
    assert bound == max(len(p) for p in tok.pieces)
    assert max_token_bytes(_Tok()) is None  # no pieces: no pre-check
    for text in ["", "a", "Once upon a time", "héllo wörld 🙂 ok", "the " * 50, "\u00e9" * 40]:
        assert min_prompt_tokens(text, bound) <= len(tok.encode(text, bos=True)), text

    class _NoEncode(_Tok):
        def encode(self, text: str, bos: bool = True) -> list[int]:
            raise AssertionError("encode must not run for a provably too long text")

    for kind, body in [
        ("completion", CompletionRequest(model="m", prompt="x" * 12_000)),
        (
            "chat",
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "y" * 12_000}]),
        ),
    ]:
        with pytest.raises(APIError) as ei:
            prepare_request(
                kind,
                body,
                None,
                model_name="m",
                tokenizer=_NoEncode(),
                max_model_len=512,
                max_bytes_per_token=bound,
            )
        assert ei.value.code == "context_length_exceeded"
        assert ei.value.param == ("prompt" if kind == "completion" else "messages")
    # within the bound: encoded as usual
    r = prepare_request(
        "completion",
        CompletionRequest(model="m", prompt="x" * 100),
        None,
        model_name="m",
        tokenizer=_Tok(),
        max_model_len=512,
        max_bytes_per_token=bound,
    )
    assert len(r.prompt_token_ids) == 101


@pytest.mark.parametrize(
    "kind,body,param",
    [
        ("completion", '{"model": "m", "prompt": ""}', "prompt"),
        ("completion", '{"model": "m", "prompt": [""]}', "prompt"),
        ("completion", '{"model": "m", "prompt": "a", "stop": ""}', "stop"),
        ("completion", '{"model": "m", "prompt": "a", "stop": ["x", ""]}', "stop"),
        (
            "chat",
            '{"model": "m", "messages": [{"role": "user", "content": "a"}], "stop": ""}',
            "stop",
        ),
        (
            "chat",
            '{"model": "m", "messages": [{"role": "user", "content": "a"}], '
            '"max_completion_tokens": 0}',
            "max_completion_tokens",
        ),
        (
            "chat",
            '{"model": "m", "messages": [{"role": "user", "content": "a"}], '
            '"max_completion_tokens": 100}',
            "max_completion_tokens",
        ),
    ],
)
def test_empty_prompt_and_stop_refused_param_names_exact(kind, body, param):
    """Findings 5-6: "" prompt / "" stop were accepted (LLM/SamplingParams refuse them);
    max_completion_tokens errors were reported as max_tokens."""
    cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
    with pytest.raises(APIError) as ei:
        _prep(cls.model_validate_json(body), kind=kind)
    assert ei.value.status == 400 and ei.value.param == param
    assert ei.value.message.startswith(param + ": expected ")


@pytest.mark.parametrize(
    "body",
    [
        '{"model": "m", "messages": [{"role": "user"}]}',
        '{"model": "m", "messages": [{"role": "user", "content": null}]}',
        '{"model": "m", "messages": [{"role": "user", "content": "a"}], '
        '"stream_options": {"include_usage": "x"}}',
    ],
)
def test_chat_content_required_and_stream_options_typed(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json(body)
    ok = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "assistant", "content": null}, '
        '{"role": "user", "content": "a"}], "stream_options": {"include_usage": true}}'
    )
    assert ok.include_usage()


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('{"model": "m", "prompt": "x", "temperature": NaN}', "temperature: expected a finite"),
        ('{"model": "m", "prompt": "x", "top_p": Infinity}', "top_p: expected a finite"),
        ('{"model": "m", "prompt": "\\ud800 x"}', "a lone UTF-16 surrogate is not"),
    ],
)
def test_nan_and_lone_surrogate_messages_name_the_problem(body, said):
    from kvpage.server.generate_route import _validation_message

    with pytest.raises(ValidationError) as ei:
        CompletionRequest.model_validate_json(body)
    assert said in _validation_message(ei.value)[0]


def test_until_disconnect_leaves_no_step_of_the_source_running_when_cancelled():
    """Cancelling the consumer while the source is mid-``__anext__`` must leave the source
    closable (no "aclose(): asynchronous generator is already running")."""
    import asyncio

    from kvpage.server.sse import _until_disconnect

    class _Req:
        async def is_disconnected(self) -> bool:
            return False

    async def source():
        yield 1
        await asyncio.sleep(3600)  # an engine step that never ends
        yield 2

    async def main() -> None:
        gen = source()
        wrapped = _until_disconnect(gen, _Req(), every_s=0.01)  # type: ignore[arg-type]

        async def consume() -> None:
            async for _ in wrapped:
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)  # the first item is out, the second __anext__ is pending
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wrapped.aclose()
        await gen.aclose()  # raised RuntimeError before the fix

    asyncio.run(main())
