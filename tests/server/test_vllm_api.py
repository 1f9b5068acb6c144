"""The vLLM-compatible request surface against a real uvicorn with the official openai
client (issue 15): every implemented field agrees with ``LLM.generate`` token for token
and logprob for logprob; every known-but-unimplemented or unknown field is refused with
its name; the utility routes answer."""

from __future__ import annotations

import httpx
import openai
import pytest
from srv_helpers import ENGINE

from kvpage.engine import LLM, SamplingParams
from kvpage.server.fields import CHAT_NOT_IMPLEMENTED, COMPLETION_NOT_IMPLEMENTED

pytestmark = pytest.mark.xdist_group("server_vllm_api")

M = "stories260K"
PROMPT = "Once upon a time, there was a little girl named"


@pytest.fixture(scope="module")
def server(serve):
    return serve()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=M, **ENGINE)


def _lp(entries, ids):
    return [e[t].logprob for e, t in zip(entries, ids)]


def test_every_sampling_field_matches_llm_generate(client, llm):
    tok = llm.get_tokenizer()
    fields = dict(
        min_tokens=4,
        repetition_penalty=1.3,
        min_p=0.02,
        top_k=40,
        prompt_logprobs=2,
        ignore_eos=True,
    )
    r = client.completions.create(
        model=M,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0.9,
        top_p=0.95,
        seed=5,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logprobs=3,
        extra_body=fields,
    )
    params = SamplingParams(
        max_tokens=10,
        temperature=0.9,
        top_p=0.95,
        seed=5,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logprobs=3,
        **fields,
    )
    (ref,) = llm.generate([PROMPT], params, use_tqdm=False)
    c, rc = r.choices[0], ref.outputs[0]
    assert c.text == rc.text
    assert c.logprobs.tokens == [tok.decode([t]) for t in rc.token_ids]  # token for token
    assert c.logprobs.token_logprobs == pytest.approx(_lp(rc.logprobs, rc.token_ids), abs=1e-6)
    assert all(len(d) >= 3 for d in c.logprobs.top_logprobs)
    plp = c.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ref.prompt_token_ids)
    for got, want, t in zip(plp[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:]):
        assert got[str(t)]["logprob"] == pytest.approx(want[t].logprob, abs=1e-6)
    assert c.model_extra["stop_reason"] is None and c.finish_reason == "length"


def test_chat_logprobs_match_llm_chat(client, llm):
    msgs = [{"role": "user", "content": "Tell me about a cat"}]
    r = client.chat.completions.create(
        model=M, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    (ref,) = llm.chat(
        msgs, SamplingParams(max_tokens=6, temperature=0.0, logprobs=2), use_tqdm=False
    )
    rc = ref.outputs[0]
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == rc.text
    assert [x.logprob for x in content] == pytest.approx(_lp(rc.logprobs, rc.token_ids), abs=1e-6)
    assert all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob for x in content)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=M, messages=msgs, max_tokens=2, top_logprobs=2)
    assert ei.value.body["param"] == "top_logprobs"


def test_streamed_logprobs_equal_non_streamed(client):
    kw = dict(model=M, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    whole = client.completions.create(**kw).choices[0]
    lps: list[float] = []
    text = ""
    for ch in client.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs:
            lps += ch.choices[0].logprobs.token_logprobs
        text += ch.choices[0].text if ch.choices else ""
    assert text == whole.text and lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-9)


def test_echo_stop_token_ids_and_include_stop_str(client, llm):
    base = client.completions.create(model=M, prompt=PROMPT, max_tokens=8, temperature=0)
    r = client.completions.create(
        model=M, prompt=PROMPT, max_tokens=8, temperature=0, echo=True, logprobs=0
    )
    n_prompt = r.usage.prompt_tokens
    assert r.choices[0].text == PROMPT + base.choices[0].text
    assert r.choices[0].logprobs.token_logprobs[0] is None
    assert r.choices[0].logprobs.tokens[0] == llm.get_tokenizer().decode([1])  # BOS, decoded
    assert len(r.choices[0].logprobs.tokens) == n_prompt + 8
    (ref,) = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    third = ref.outputs[0].token_ids[2]
    r = client.completions.create(
        model=M, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [third]}
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    assert r.choices[0].model_extra["stop_reason"] == third
    word = base.choices[0].text.split()[1]
    for include in (False, True):
        r = client.completions.create(
            model=M,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stop=[word],
            extra_body={"include_stop_str_in_output": include},
        )
        assert r.choices[0].text.endswith(word) == include
        assert r.choices[0].model_extra["stop_reason"] == word


def _offsets_agree(text: str, lp) -> None:
    """OpenAI's ``text_offset``: ``text[text_offset[i]:]`` starts with ``tokens[i]``."""
    assert len(lp.tokens) == len(lp.text_offset)
    for i, (tok, off) in enumerate(zip(lp.tokens, lp.text_offset)):
        assert text[off : off + len(tok)] == tok, (tok, off, text)
        if lp.top_logprobs[i] is not None:  # the chosen token is among its top entries
            assert lp.top_logprobs[i][tok] == lp.token_logprobs[i]
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("prompt", [PROMPT, " Two spaces  here", "Lily"])
def test_echo_text_offset_points_into_text(client, prompt):
    # the first prompt word's single-token text carries the SentencePiece dummy-prefix
    # space that the echoed prompt lacks; every later offset used to be one too far
    kw = dict(model=M, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    for echo in (True, False):
        r = client.completions.create(echo=echo, **kw)
        _offsets_agree(r.choices[0].text, r.choices[0].logprobs)
        text, tokens, offsets = "", [], []
        for ch in client.completions.create(echo=echo, stream=True, **kw):
            if not ch.choices:
                continue
            c = ch.choices[0]
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
        assert text == r.choices[0].text
        assert (tokens, offsets) == (
            r.choices[0].logprobs.tokens,
            r.choices[0].logprobs.text_offset,
        )


def test_several_prompts_and_cached_tokens(client, llm):
    prompts = [PROMPT, "The dog ran"]
    r = client.completions.create(model=M, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    refs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    assert r.usage.completion_tokens == 20
    long = PROMPT + " Lily. She liked to play with her toys in the garden every day."
    client.completions.create(model=M, prompt=long, max_tokens=2, temperature=0)
    again = client.completions.create(model=M, prompt=long, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # one full block at least


@pytest.mark.parametrize("name", sorted(COMPLETION_NOT_IMPLEMENTED))
def test_completion_fields_not_implemented_are_refused_by_name(client, name):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(
            model=M, prompt="hi", max_tokens=2, extra_body={name: "refuse-me"}
        )
    assert ei.value.body["param"] == name and name in ei.value.body["message"]


@pytest.mark.parametrize(
    "name", sorted(set(CHAT_NOT_IMPLEMENTED) - set(COMPLETION_NOT_IMPLEMENTED))
)
def test_chat_fields_not_implemented_are_refused_by_name(client, name):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=M,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={name: "refuse-me"},
        )
    assert ei.value.body["param"] == name and name in ei.value.body["message"]


def test_unknown_fields_refused_unless_allowed(client, serve):
    for call in (
        lambda c: c.completions.create(model=M, prompt="hi", max_tokens=2, extra_body={"zzz": 1}),
        lambda c: c.chat.completions.create(
            model=M,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"zzz": 1},
        ),
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            call(client)
        assert (
            ei.value.body["param"] == "zzz" and "--allow-unknown-fields" in ei.value.body["message"]
        )
    lax = serve(allow_unknown_fields=True)
    c2 = openai.OpenAI(base_url=lax.base_url + "/v1", api_key="k", max_retries=0)
    r = c2.completions.create(model=M, prompt="hi", max_tokens=2, extra_body={"zzz": 1})
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError):  # known-but-unimplemented: still refused
        c2.completions.create(model=M, prompt="hi", max_tokens=2, extra_body={"best_of": 3})
    # values that ask for nothing are accepted
    r = client.completions.create(
        model=M, prompt="hi", max_tokens=2, extra_body={"best_of": 1, "guided_json": None}
    )
    assert r.usage.completion_tokens == 2


def test_utility_routes(server, llm):
    base = server.base_url
    r = httpx.post(base + "/tokenize", json={"model": M, "prompt": PROMPT}, timeout=30)
    ids = llm.get_tokenizer().encode(PROMPT, bos=True)
    assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    assert r.json()["max_model_len"] == 512
    r = httpx.post(base + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    assert r.json()["tokens"] == ids[1:]
    r = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == llm.get_tokenizer().encode("user: hi\nassistant:", bos=True)
    r = httpx.post(base + "/detokenize", json={"model": M, "tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == PROMPT
    for path, body, param in (
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [99999]}, "tokens"),
        ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
    ):
        r = httpx.post(base + path, json=body, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param
    from kvpage import __version__

    assert httpx.get(base + "/version").json() == {"version": __version__}
    assert httpx.get(base + "/ping").status_code == 200
    assert httpx.post(base + "/ping").status_code == 200


def test_several_prompts_streamed_equal_non_streamed(client, server):
    prompts = ["Once upon a time", "Lily", "The dog"]
    kw = dict(model=M, prompt=prompts, max_tokens=6, temperature=0, n=2)
    whole = client.completions.create(**kw)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert set(finishes) == set(range(6)) and usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 36
    # a refused prompt refuses the whole request (and releases the others)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=M, prompt=["hi", [1, 99999]], max_tokens=2, stream=True)
    assert ei.value.body["param"] == "prompt"
    # leaving mid-stream aborts every prompt (the fixture checks the pool is clean)
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={
            "model": M,
            "prompt": ["a", "b"],
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        },
        timeout=60,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break


def test_chat_message_fields_outside_the_template_are_refused(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "hi", "name": "bob"}], max_tokens=2
        )
    assert ei.value.body["param"] == "messages[0].name"  # kvpage's plain template
    assert "chat template" in ei.value.body["message"]
