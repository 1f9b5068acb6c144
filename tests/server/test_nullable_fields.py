"""OpenAI's nullable request fields: an explicit ``null`` means the default, and the two
names of the chat length cap cannot disagree silently (fresh-user findings F2, F3)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from kvpage.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvpage.server.validation import prepare_request


class _Tok:
    vocab_size = 259

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([1] if bos else []) + [b + 3 for b in text.encode()]


_COMPLETION_NULLABLE = ["temperature", "top_p", "n", "stream", "echo", "top_k", "ignore_eos",
                        "logprobs", "max_tokens", "seed", "stop", "include_stop_str_in_output"]  # fmt: skip
_CHAT_NULLABLE = ["temperature", "top_p", "n", "stream", "logprobs", "top_logprobs",
                  "max_tokens", "max_completion_tokens"]  # fmt: skip


@pytest.mark.parametrize("field", _COMPLETION_NULLABLE)
def test_completion_null_is_the_default(field: str) -> None:
    base = {"model": "m", "prompt": "Once", "max_tokens": 2}
    got = CompletionRequest.model_validate_json(json.dumps({**base, field: None}))
    want = CompletionRequest.model_validate_json(
        json.dumps({k: v for k, v in base.items() if k != field})
    )
    assert got.model_dump() == want.model_dump()


@pytest.mark.parametrize("field", _CHAT_NULLABLE)
def test_chat_null_is_the_default(field: str) -> None:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    got = ChatCompletionRequest.model_validate_json(json.dumps({**base, field: None}))
    assert (
        got.model_dump() == ChatCompletionRequest.model_validate_json(json.dumps(base)).model_dump()
    )


@pytest.mark.parametrize("field", ["model", "prompt"])
def test_required_fields_stay_required(field: str) -> None:
    body = {"model": "m", "prompt": "Once", field: None}
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json(json.dumps(body))


def test_wrong_types_still_refused() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "temperature": "1"}')


def _chat_cap(**caps: int) -> int:
    body = ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **caps})
    )
    prepared = prepare_request(
        "chat", body, None, model_name="m", tokenizer=_Tok(), max_model_len=4096
    )
    return int(prepared.max_tokens)


def test_max_completion_tokens_and_max_tokens() -> None:
    assert _chat_cap(max_completion_tokens=3) == 3
    assert _chat_cap(max_tokens=5) == 5
    assert _chat_cap(max_tokens=4, max_completion_tokens=4) == 4
    with pytest.raises(APIError) as e:
        _chat_cap(max_tokens=5, max_completion_tokens=3)
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"
    assert "got 3 and max_tokens 5" in e.value.message
