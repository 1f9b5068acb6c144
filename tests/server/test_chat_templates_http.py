"""/v1/chat/completions, /tokenize and /v1/models on offline HF folders
(``kvpage.testing.hf_folders``): the model's Jinja chat template and BOS as transformers
renders them, the generation_config.json EOS ids and defaults, the chat-template request
fields and ``--chat-template``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from kvpage.server.protocol import APIError, ChatCompletionRequest, CompletionRequest  # noqa: E402
from kvpage.server.validation import prepare_request  # noqa: E402
from kvpage.testing.hf_folders import (  # noqa: E402
    QWEN_GENERATION_CONFIG,
    TOOL_MESSAGES,
    make_chat_folder,
)

MSGS = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello cat"}]
SMALL = {"num_blocks": 64, "block_size": 16, "max_model_len": 128, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_http")
    probe = make_chat_folder(root / "probe", "qwen")
    hf = transformers.AutoTokenizer.from_pretrained(str(probe))
    plain = hf.convert_tokens_to_ids("Ġcat")
    return {
        "probe": probe,
        # emits a token that is not an EOS: runs to max_tokens
        "plain": make_chat_folder(root / "plain", "qwen", emit=plain),
        # emits <|endoftext|>: an EOS of config.json / generation_config.json only
        "stop": make_chat_folder(
            root / "stop", "qwen", emit=hf.convert_tokens_to_ids("<|endoftext|>")
        ),
        "llama": make_chat_folder(root / "llama", "llama"),
    }


def _hf(folder: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _chat(base: str, model: str, **body: Any) -> httpx.Response:
    return httpx.post(
        base + "/v1/chat/completions",
        json={"model": model, "messages": MSGS, **body},
        timeout=60,
    )


def test_chat_prompt_ids_defaults_and_fields(serve: Any, folders: dict[str, Path]) -> None:
    folder = folders["plain"]
    model = str(folder)
    hf = _hf(folder)
    srv = serve(engine={"model": model, **SMALL})
    base = srv.base_url
    want = list(
        hf.apply_chat_template(MSGS, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    r = _chat(base, model, prompt_logprobs=0, max_tokens=2, temperature=0)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvpage-chat-template"] == "model"
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(want)
    # prompt_logprobs entries are keyed by the prompt's own ids (the first has none)
    got_ids = [int(next(iter(e))) for e in body["prompt_logprobs"][1:]]
    assert got_ids == want[1:]
    tk = httpx.post(base + "/tokenize", json={"messages": MSGS}, timeout=30).json()
    assert tk["tokens"] == want
    text = "Once upon a time"
    assert httpx.post(base + "/tokenize", json={"prompt": text}).json()["tokens"] == hf.encode(text)
    # unset max_tokens: generation_config.json's max_new_tokens (7); explicit wins
    assert _chat(base, model).json()["usage"]["completion_tokens"] == 7
    assert _chat(base, model, max_tokens=3).json()["usage"]["completion_tokens"] == 3
    c = httpx.post(base + "/v1/completions", json={"model": model, "prompt": text}, timeout=60)
    assert c.json()["usage"]["completion_tokens"] == 7  # not OpenAI's 16
    card = httpx.get(base + "/v1/models").json()["data"][0]
    assert card["chat_template"] == "model"
    assert card["generation_defaults"] == {
        ("max_tokens" if k == "max_new_tokens" else k): v for k, v in QWEN_GENERATION_CONFIG.items()
    }
    # the request's own template and the template variables
    tmpl = "{% for m in messages %}{{ m['role'] }}|{{ m['content'] }};{% endfor %}"
    r = _chat(base, model, chat_template=tmpl, max_tokens=1)
    assert r.headers["x-kvpage-chat-template"] == "request"
    assert r.json()["usage"]["prompt_tokens"] == len(hf.encode("system|be nice;user|hello cat;"))
    kw = {"enable_thinking": False}
    r = _chat(base, model, chat_template_kwargs=kw, max_tokens=1)
    n = len(
        hf.apply_chat_template(MSGS, add_generation_prompt=True, **kw, return_dict=True)[
            "input_ids"
        ]
    )
    assert r.json()["usage"]["prompt_tokens"] == n > len(want)  # "<think></think>" added
    r = _chat(base, model, add_generation_prompt=False, max_tokens=1)
    assert r.json()["usage"]["prompt_tokens"] == len(
        hf.apply_chat_template(MSGS, return_dict=True)["input_ids"]
    )
    # message fields the template renders pass through
    tool_msgs = copy.deepcopy(TOOL_MESSAGES)
    r = httpx.post(base + "/tokenize", json={"messages": tool_msgs}, timeout=30)
    assert r.status_code == 200, r.text
    assert "Paris" in hf.decode(r.json()["tokens"]) and "bob" in hf.decode(r.json()["tokens"])
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"model": model, "messages": tool_msgs, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    # tools reach the template as its ``tools`` variable (transformers' apply_chat_template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    tmpl = "{% for t in tools %}tool {{ t.function.name }};{% endfor %}{{ messages[-1].content }}"
    r = _chat(base, model, tools=tools, tool_choice="required", chat_template=tmpl, max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(hf.encode("tool get_weather;hello cat"))
    r = _chat(base, model, tools=tools, tool_choice="none", chat_template=tmpl, max_tokens=2)
    assert r.status_code == 200, r.text
    # "none": the template still sees the tools (vLLM's default); the reply is plain text
    assert r.json()["usage"]["prompt_tokens"] == len(hf.encode("tool get_weather;hello cat"))
    assert r.json()["choices"][0]["message"].get("tool_calls") in (None, [])
    # "auto" needs a server started with a tool-call parser; malformed tools name the field
    r = _chat(base, model, tools=tools)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = _chat(base, model, tools=[{"type": "function", "function": {}}], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0]")
    r = _chat(base, model, continue_final_message=True)
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]
    r = _chat(base, model, chat_template="{{ raise_exception('no') }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_eos_of_generation_config_stops_over_http(serve: Any, folders: dict[str, Path]) -> None:
    model = str(folders["stop"])
    srv = serve(engine={"model": model, **SMALL})
    r = _chat(srv.base_url, model, max_tokens=5, temperature=0)
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 1
    r = _chat(srv.base_url, model, max_tokens=5, temperature=0, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == 5


def test_generation_config_none_and_llama_bos(serve: Any, folders: dict[str, Path]) -> None:
    model = str(folders["llama"])
    hf = _hf(folders["llama"])
    srv = serve(engine={"model": model, "generation_config": "none", **SMALL})
    tk = httpx.post(srv.base_url + "/tokenize", json={"messages": MSGS}).json()["tokens"]
    want = list(hf.apply_chat_template(MSGS, return_dict=True)["input_ids"])
    assert tk == want and want.count(hf.bos_token_id) == 1  # the template's BOS only
    assert httpx.post(srv.base_url + "/tokenize", json={"prompt": "the cat"}).json()["tokens"][
        0
    ] == (hf.bos_token_id)
    assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["generation_defaults"] == {}


def test_server_chat_template_file_for_the_bundled_model(serve: Any, tmp_path: Path) -> None:
    plain = serve()
    r = httpx.post(
        plain.base_url + "/v1/chat/completions",
        json={"model": "stories260K", "messages": MSGS, "max_tokens": 1},
        timeout=60,
    )
    assert r.headers["x-kvpage-chat-template"] == "kvpage"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}. {% endfor %}")
    srv = serve(chat_template=str(f))
    tk = httpx.post(srv.base_url + "/tokenize", json={"messages": MSGS}).json()["tokens"]
    from kvpage.models import load_model

    tok = load_model("stories260K").tokenizer
    assert tk == tok.encode("be nice. hello cat. ", bos=False)
    r = httpx.post(
        srv.base_url + "/v1/chat/completions",
        json={"model": "stories260K", "messages": MSGS, "max_tokens": 1},
        timeout=60,
    )
    assert r.headers["x-kvpage-chat-template"] == "server"
    assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["chat_template"] == "server"


def test_unset_vs_explicit_sampling_fields(folders: dict[str, Path]) -> None:
    from kvpage.models.tokenizer import HFTokenizer

    tok = HFTokenizer.from_pretrained(folders["probe"])
    defaults = {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "min_p": 0.1,
        "max_tokens": 7,
    }

    def prep(kind: str, **body: Any) -> Any:
        cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        extra = {"messages": MSGS} if kind == "chat" else {"prompt": "the cat"}
        req = cls.model_validate({"model": "m", **extra, **body})
        return prepare_request(
            kind,
            req,
            None,
            model_name="m",
            tokenizer=tok,
            max_model_len=128,
            sampling_defaults=defaults,
        )

    for kind in ("chat", "completion"):
        r = prep(kind)
        assert (r.temperature, r.top_p, r.top_k, r.repetition_penalty, r.min_p, r.max_tokens) == (
            0.7,
            0.8,
            20,
            1.05,
            0.1,
            7,
        )
        # explicit values win, even when they equal kvpage's own defaults; null = unset
        r = prep(
            kind,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            repetition_penalty=1.0,
            min_p=0.0,
            max_tokens=9,
        )
        assert (r.temperature, r.top_p, r.top_k, r.repetition_penalty, r.min_p, r.max_tokens) == (
            1.0,
            1.0,
            -1,
            1.0,
            0.0,
            9,
        )
        assert prep(kind, temperature=None).temperature == 0.7
    assert prep("chat", max_completion_tokens=4).max_tokens == 4
    # without defaults: OpenAI's / kvpage's own
    req = CompletionRequest.model_validate({"model": "m", "prompt": "the cat"})
    r = prepare_request("completion", req, None, model_name="m", tokenizer=tok, max_model_len=128)
    assert (r.temperature, r.top_k, r.max_tokens) == (1.0, -1, 16)
    bad = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MSGS, "chat_template_kwargs": {"tokenize": True}}
    )
    with pytest.raises(APIError) as e:
        prepare_request("chat", bad, None, model_name="m", tokenizer=tok, max_model_len=128)
    assert e.value.param == "chat_template_kwargs.tokenize"


@pytest.mark.slow  # spawns an engine process (~19 s: torch + transformers import)
@pytest.mark.xdist_group("server_engine_process")
def test_engine_process_carries_template_and_defaults(folders: dict[str, Path]) -> None:
    from kvpage.server.app import create_app
    from kvpage.server.config import ServerConfig
    from kvpage.server.runner import BackgroundServer

    model = str(folders["stop"])
    cfg = ServerConfig.model_validate(
        {"engine": {"model": model, **SMALL}, "log_level": "warning", "engine_process": True}
    )
    srv = BackgroundServer(create_app(cfg)).start()
    try:
        r = _chat(srv.base_url, model, temperature=0)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpage-chat-template"] == "model"
        assert r.json()["choices"][0]["finish_reason"] == "stop"  # generation_config EOS
        card = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
        assert card["generation_defaults"]["max_tokens"] == 7
    finally:
        srv.stop()


def test_cli_flags_and_load_chat_template(tmp_path: Path) -> None:
    import argparse

    from kvpage.engine.chat import load_chat_template
    from kvpage.errors import SpecError
    from kvpage.server.cli import add_serve_parser, check_engine_config, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    args = parser.parse_args(["serve", "--chat-template", str(f), "--generation-config", "none"])
    cfg = config_from_args(args)
    assert cfg.chat_template == str(f) and cfg.engine.generation_config == "none"
    check_engine_config(cfg)
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"  # Jinja text as is (vLLM)
    for bad, match in (
        (str(tmp_path / "missing.jinja"), "readable template file"),
        ("{% for %}", "valid Jinja"),
    ):
        with pytest.raises(SpecError, match=match):
            check_engine_config(
                config_from_args(parser.parse_args(["serve", "--chat-template", bad]))
            )
    with pytest.raises(SpecError, match="generation_config"):
        check_engine_config(
            config_from_args(
                parser.parse_args(["serve", "--generation-config", str(tmp_path / "no")])
            )
        )
