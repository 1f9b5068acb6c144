"""Tokenizer fidelity, chat templates and generation_config.json on offline HF folders
(``kvpage.testing.hf_folders``): prompt ids of ``LLM.generate`` / ``LLM.chat`` equal
transformers' ``encode`` / ``apply_chat_template``, generation stops at every EOS id of
the union, and the sampling defaults follow the file."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from kvpage.engine import LLM, SamplingParams  # noqa: E402
from kvpage.errors import RequestRejected, SpecError  # noqa: E402
from kvpage.testing.hf_folders import (  # noqa: E402
    QWEN_GENERATION_CONFIG,
    TOOL_MESSAGES,
    make_chat_folder,
)

MSGS = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hello cat"},
]
SMALL = {"num_blocks": 64, "block_size": 16, "max_model_len": 128}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {s: make_chat_folder(root / s, s) for s in ("qwen", "llama")}


def _hf(folder: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _chat_ids(hf: Any, msgs: Any, **kw: Any) -> list[int]:
    out = hf.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"])


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_prompt_ids_equal_transformers(folders: dict[str, Path], style: str) -> None:
    folder = folders[style]
    hf = _hf(folder)
    llm = LLM(str(folder), **SMALL)
    text = "Once upon a time the cat sat"
    out = llm.generate(text, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == hf.encode(text)  # add_special_tokens=True semantics
    bos = llm.get_tokenizer().bos_token_id
    if style == "qwen":  # Qwen-style: config.json has a bos_token_id, the tokenizer adds none
        assert (
            bos is None and out.prompt_token_ids[0] != llm.llm_engine.model.config["bos_token_id"]
        )
    else:
        assert out.prompt_token_ids[0] == bos == hf.bos_token_id
    got = llm.chat(MSGS, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    want = _chat_ids(hf, MSGS, add_generation_prompt=True)
    assert got.prompt_token_ids == want
    assert got.prompt == hf.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    if style == "llama":  # the template writes BOS once; encoding adds no second one
        assert want[0] == hf.bos_token_id and want[1] != hf.bos_token_id
    # get_tokenizer() is the transformers tokenizer itself
    tok = llm.get_tokenizer()
    assert isinstance(tok, transformers.PreTrainedTokenizerBase)
    assert tok.decode(tok.encode("the cat"), skip_special_tokens=True) == "the cat"


def test_chat_options_match_apply_chat_template(folders: dict[str, Path]) -> None:
    folder = folders["qwen"]
    hf = _hf(folder)
    llm = LLM(str(folder), **SMALL)
    p = SamplingParams(max_tokens=1, temperature=0)

    def ids(msgs: Any, **kw: Any) -> list[int]:
        return llm.chat(msgs, p, use_tqdm=False, **kw)[0].prompt_token_ids

    assert ids(MSGS, add_generation_prompt=False) == _chat_ids(hf, MSGS)
    kw = {"enable_thinking": False}
    assert ids(MSGS, chat_template_kwargs=kw) == _chat_ids(
        hf, MSGS, add_generation_prompt=True, **kw
    )
    cont = [*MSGS, {"role": "assistant", "content": "Once"}]
    assert ids(cont, add_generation_prompt=False, continue_final_message=True) == _chat_ids(
        hf, cont, continue_final_message=True
    )
    tmpl = "{% for m in messages %}{{ m['role'] }}|{{ m['content'] }};{% endfor %}"
    assert ids(MSGS, chat_template=tmpl) == _chat_ids(hf, MSGS, chat_template=tmpl)
    # message fields the template renders are passed through, not refused
    tool = copy.deepcopy(TOOL_MESSAGES)
    hf_tool = [dict(m) for m in tool]
    hf_tool[1] = {
        **tool[1],
        "tool_calls": [
            {
                **tool[1]["tool_calls"][0],
                "function": {"name": "get", "arguments": {"city": "Paris"}},
            }
        ],  # type: ignore[index]
    }
    got = ids(tool)
    assert got == _chat_ids(hf, hf_tool, add_generation_prompt=True)
    assert "bob" in hf.decode(got) and "Paris" in hf.decode(got) and "c1" in hf.decode(got)
    with pytest.raises(RequestRejected, match="continue_final_message"):
        ids(MSGS, continue_final_message=True)  # with add_generation_prompt=True
    with pytest.raises(RequestRejected, match="chat_template_kwargs.tokenize"):
        ids(MSGS, chat_template_kwargs={"tokenize": True})
    with pytest.raises(RequestRejected, match="chat_template: expected a template that renders"):
        ids(MSGS, chat_template="{{ raise_exception('no system role') }}")


def test_stops_at_every_eos_id_and_defaults(tmp_path: Path) -> None:
    probe = make_chat_folder(tmp_path / "probe", "qwen")
    hf = _hf(probe)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    endoftext = hf.convert_tokens_to_ids("<|endoftext|>")
    gen = transformers.GenerationConfig.from_pretrained(str(probe)).eos_token_id
    assert gen == [im_end, endoftext]
    llm = LLM(str(probe), **SMALL)
    assert llm.llm_engine.tokenizer.eos_token_ids == (im_end, endoftext)
    plain = hf.convert_tokens_to_ids("cat") if "cat" in hf.get_vocab() else 300
    for emit, stops in ((im_end, True), (endoftext, True), (plain, False)):
        folder = make_chat_folder(tmp_path / f"emit{emit}", "qwen", emit=emit)
        llm = LLM(str(folder), **SMALL)
        o = llm.generate("the cat", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
        c = o[0].outputs[0]
        if stops:
            assert c.token_ids == [emit] and c.finish_reason == "stop"
        else:
            assert c.token_ids == [emit] * 5 and c.finish_reason == "length"
        o = llm.generate(
            "the cat", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False
        )
        assert o[0].outputs[0].token_ids == [emit] * 3
    # defaults follow the file: the unset max_tokens is max_new_tokens (7), not 16
    d = llm.get_default_sampling_params()
    for k, v in QWEN_GENERATION_CONFIG.items():
        assert getattr(d, "max_tokens" if k == "max_new_tokens" else k) == v
    assert len(llm.generate("the cat", use_tqdm=False)[0].outputs[0].token_ids) == 7
    assert len(llm.chat(MSGS, use_tqdm=False)[0].outputs[0].token_ids) == 7
    off = LLM(str(folder), generation_config="none", **SMALL)
    assert off.get_default_sampling_params() == SamplingParams()
    assert len(off.generate("the cat", use_tqdm=False)[0].outputs[0].token_ids) == 16
    # ... but its EOS ids still stop (vLLM likewise)
    assert off.llm_engine.tokenizer.eos_token_ids == (im_end, endoftext)
    other = LLM(str(probe), generation_config=str(folder), **SMALL)
    assert other.get_default_sampling_params().max_tokens == 7
    with pytest.raises(SpecError, match="generation_config"):
        LLM(str(folder), generation_config=str(tmp_path / "missing"), **SMALL)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(SpecError, match="generation_config.json"):
        LLM(str(folder), **SMALL)


def test_bundled_model_keeps_its_tokenizer_and_plain_template() -> None:
    llm = LLM("stories260K", num_blocks=32)
    tok = llm.get_tokenizer()
    assert tok.encode("hi", bos=True)[0] == 1  # llama2.c BOS, as before
    assert llm.llm_engine.extra_eos_token_ids == frozenset()  # EOS 2 only (BOS stop is CLI's)
    out = llm.chat(
        [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert out[0].prompt == "user: hi\nassistant:"
    assert out[0].prompt_token_ids == tok.encode("user: hi\nassistant:", bos=True)
    assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(RequestRejected, match="messages\\[0\\].name"):
        llm.chat([{"role": "user", "content": "hi", "name": "bob"}], use_tqdm=False)
    with pytest.raises(RequestRejected, match="chat_template_kwargs"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"x": 1})
    # a Jinja template given for the bundled model is rendered by transformers too
    out = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template="Q: {{ messages[0]['content'] }}\nA:",
    )
    assert out[0].prompt == "Q: hi\nA:" and out[0].prompt_token_ids == tok.encode(
        "Q: hi\nA:", bos=False
    )


def test_template_from_tokenizer_config_json(tmp_path: Path) -> None:
    """The older layout: ``chat_template`` inside tokenizer_config.json, no .jinja file."""
    import json

    from kvpage.testing.hf_folders import CHATML_TEMPLATE

    folder = make_chat_folder(tmp_path / "old", "qwen")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["chat_template"] = CHATML_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    hf = _hf(folder)
    llm = LLM(str(folder), **SMALL)
    got = llm.chat(MSGS, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert got.prompt_token_ids == _chat_ids(hf, MSGS, add_generation_prompt=True)
    assert got.prompt is not None and got.prompt.endswith("<|im_start|>assistant\n")
