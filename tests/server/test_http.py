"""The server against real clients: openai (streaming and not) and httpx."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from srv_helpers import ENGINE, metrics_dict, wait_idle

from kvpage.engine import LLM, SamplingParams

pytestmark = pytest.mark.xdist_group("server_http")

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day"]


@pytest.fixture(scope="module")
def server(serve):
    return serve()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="test-key", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """Greedy texts from the offline API with the same engine configuration."""
    llm = LLM(model="stories260K", **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)} | {
        ("len", p): len(o.prompt_token_ids) for p, o in zip(PROMPTS, outs)
    }


def test_completion_greedy_equals_llm_generate(client, reference):
    for p in PROMPTS[:2]:
        r = client.completions.create(model="stories260K", prompt=p, max_tokens=12, temperature=0)
        assert r.choices[0].text == reference[p]
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12
        assert r.usage.prompt_tokens == reference[("len", p)]


def test_completion_streaming_equals_llm_generate(client, reference):
    p = PROMPTS[2]
    stream = client.completions.create(
        model="stories260K", prompt=p, max_tokens=12, temperature=0, stream=True
    )
    parts, finishes = [], []
    for ch in stream:
        parts.append(ch.choices[0].text)
        finishes.append(ch.choices[0].finish_reason)
    assert "".join(parts) == reference[p]
    assert len(parts) >= 2  # really streamed
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_concurrent_requests_share_the_batch(server, reference):
    """Several clients at once: each greedy text equals its offline reference."""

    def one(p):
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": "stories260K", "prompt": p, "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        return r.status_code, r.json()["choices"][0]["text"]

    def multi_seq_steps():
        m = metrics_dict(httpx.get(server.base_url + "/metrics").text)
        le1 = m['kvpage:step_running_sequences_bucket{le="1.0"}']
        return m["kvpage:step_running_sequences_count"] - le1

    before = multi_seq_steps()
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, PROMPTS * 2))
    assert got == [(200, reference[p]) for p in PROMPTS * 2]
    assert multi_seq_steps() > before  # steps that ran several requests together


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    r = client.chat.completions.create(
        model="stories260K", messages=msgs, max_tokens=8, temperature=0
    )
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and len(text) > 0
    assert r.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="stories260K",
        messages=msgs,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 8


def test_n_seed_and_sampling_params(client):
    kw = dict(
        model="stories260K",
        prompt="Once upon a time",
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        n=3,
        seed=1234,
        user="alice",
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert a.usage.completion_tokens == 30
    assert len({c.text for c in a.choices}) > 1  # independent samples


def test_stop_string(client, reference):
    p = PROMPTS[0]
    full = reference[p]
    stop = full[6:10]  # a piece of the greedy continuation
    assert stop and stop not in full[:6]
    r = client.completions.create(
        model="stories260K", prompt=p, max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    s = client.completions.create(
        model="stories260K", prompt=p, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_health_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories260K"]
    assert client.models.retrieve("stories260K").id == "stories260K"
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("gpt-4")
    assert ei.value.response.json()["error"]["code"] == "model_not_found"
    h = httpx.get(server.base_url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "kvpage:kv_cache_usage_perc",
        "kvpage:num_requests_running",
        "kvpage:num_requests_waiting",
        "kvpage:prefix_cache_queries_total",
        "kvpage:prefix_cache_hits_total",
        "kvpage:num_preemptions_total",
        "kvpage:block_allocation_failures_total",
        "kvpage:evictions_total",
        "kvpage:prompt_tokens_total",
        "kvpage:generation_tokens_total",
        "kvpage:requests_rejected_total",
        "kvpage:time_to_first_token_seconds_bucket",
        "kvpage:time_per_output_token_seconds_bucket",
        "kvpage:e2e_request_latency_seconds_bucket",
        "kvpage:prefill_tokens_per_second_bucket",
        "kvpage:decode_tokens_per_second_bucket",
        'kvpage:server_queue_length{queue="engine"}',
        "kvpage:server_active_sequences",
        "kvpage:prefix_cache_hit_ratio",
        'kvpage:kv_memory_utilization{kind="actual"}',
        "kvpage:degraded",
        "kvpage:step_running_sequences_bucket",
        "kvpage:step_waiting_requests_bucket",
        "kvpage:cache_config_info{",
    ):
        assert name in text, name
    backend = server.app.state.serving.engine.backend_name  # what "auto" picked on CPU
    assert backend in ("native-cpu", "torch")  # torch only where no C compiler builds it
    assert 'block_size="16"' in text and 'num_blocks="65"' in text
    assert f'backend="{backend}"' in text
    m = metrics_dict(text)
    spec = server.app.state.serving.engine.cache_spec
    assert m['kvpage:kv_cache_memory_bytes{kind="total"}'] == spec.total_bytes > 0


BAD = [
    ("{not json", 400, None),
    ('{"model": "gpt-4", "prompt": "hi"}', 404, "model"),
    ('{"model": "stories260K", "prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    ('{"model": "stories260K", "prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    ('{"model": "stories260K", "prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ('{"model": "stories260K", "prompt": "hi", "n": 0}', 400, "n"),
    ('{"model": "stories260K"}', 400, "prompt"),
    ('{"model": "stories260K", "prompt": []}', 400, "prompt"),
    ('{"model": "stories260K", "prompt": [1, 99999]}', 400, "prompt"),
    ('{"model": "stories260K", "prompt": ["a", [1, 99999]]}', 400, "prompt"),
    ('{"model": "stories260K", "prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    ('{"model": "stories260K", "prompt": "hi", "guided_json": {"type": "x"}}', 400, "guided_json"),
    ('{"model": "stories260K", "prompt": "hi", "no_such_field": 1}', 400, "no_such_field"),
    ('{"model": "stories260K", "prompt": "hi", "max_tokens": 600}', 400, "max_tokens"),
    ("[1, 2]", 400, None),
    ('{"model": "stories260K", "prompt": [1, "2"]}', 400, "prompt"),
    ('{"model": "stories260K", "prompt": ""}', 400, "prompt"),
    ('{"model": "stories260K", "prompt": "hi", "stop": ""}', 400, "stop"),
    (
        '{"model": "stories260K", "prompt": "hi", "stream_options": {"include_usage": "x"}}',
        400,
        "stream_options.include_usage",
    ),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and ": expected " in err["message"]


def test_prompt_too_long_and_chat_errors(server, client):
    long_prompt = list(range(1, 100)) * 6  # 594 tokens > max model length 512
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="stories260K", prompt=long_prompt, max_tokens=4)
    assert ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": "stories260K", "messages": "hello"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    for messages, param, expect in [
        ([], "messages", "messages: expected at least 1 item, got 0"),
        ([{"role": "user"}], "messages.0.content", "messages.0.content: expected a value"),
    ]:
        r = httpx.post(
            server.base_url + "/v1/chat/completions",
            json={"model": "stories260K", "messages": messages},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert r.json()["error"]["message"].startswith(expect)
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={
            "model": "stories260K",
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 0,
        },
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = httpx.get(server.base_url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.base_url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_docs_error_table_matches_the_codes():
    """Finding 8: docs said unknown routes answer model_not_found; the code said "404"."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    row = next(line for line in doc.splitlines() if "unknown route" in line)
    assert "`not_found`" in row and "`method_not_allowed`" in row
    assert "model_not_found" not in row


def test_bad_requests_leave_pool_and_metrics_consistent(server):
    before = wait_idle(server.base_url)
    for body, _, _ in BAD:
        httpx.post(
            server.base_url + "/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
    after = wait_idle(server.base_url)
    for k in (
        "kvpage:prompt_tokens_total",
        "kvpage:generation_tokens_total",
        "kvpage:prefix_cache_queries_total",
    ):
        assert after[k] == before[k], k  # nothing reached the engine

    def rejected(m):
        pre = "kvpage:server_requests_rejected_total{"
        return {k: v for k, v in m.items() if k.startswith(pre)}

    delta = {k: v - rejected(before).get(k, 0.0) for k, v in rejected(after).items()}
    assert sum(delta.values()) == len(BAD)  # every bad request counted once, by reason
    assert delta['kvpage:server_requests_rejected_total{reason="unknown_model"}'] == 1
    assert delta['kvpage:server_requests_rejected_total{reason="empty_prompt"}'] == 2
    assert after['kvpage:kv_memory_utilization{kind="projected"}'] == 0.0


def test_disconnect_mid_stream_frees_blocks_at_once(server):
    base = wait_idle(server.base_url)
    body = {
        "model": "stories260K",
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", server.base_url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        m = metrics_dict(httpx.get(server.base_url + "/metrics").text)
        assert m["kvpage:kv_cache_usage_perc"] > 0.0  # the request holds blocks
    m = wait_idle(server.base_url, timeout_s=30)
    generated = m["kvpage:generation_tokens_total"] - base["kvpage:generation_tokens_total"]
    assert generated < 400, "the request ran to completion instead of being aborted"
    c = 'kvpage:request_cancellations_total{cause="client_disconnect"}'
    assert m[c] - base.get(c, 0.0) == 1


def test_disconnect_while_waiting_non_streamed_aborts(server, monkeypatch):
    """A non-streamed client that gives up (read timeout) aborts its request. Each engine
    step is slowed to >= 5 ms, so 400 tokens take >= 2 s whatever the machine's speed:
    the request cannot finish within the client's 0.5 s (it did on a fast, idle run)."""
    base = wait_idle(server.base_url)
    runner = server.app.state.serving.engine.runner
    real_execute = runner.execute

    def slow_execute(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.005)
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)
    body = {
        "model": "stories260K",
        "prompt": "One day",
        "max_tokens": 400,
        "n": 16,  # 6,400 tokens: seconds of work even for the one-thread engine
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(
            server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3)
        )
    m = wait_idle(server.base_url, timeout_s=10)
    generated = m["kvpage:generation_tokens_total"] - base["kvpage:generation_tokens_total"]
    assert generated < 16 * 400, "the request ran to completion instead of being aborted"
    c = 'kvpage:request_cancellations_total{cause="client_disconnect"}'
    assert m[c] - base.get(c, 0.0) == 1


def test_engine_refusal_and_step_failure(serve):
    """A request the pool can never hold gets a 400 before it reaches the engine (the
    server validates against the pool's limit, ``Scheduler.max_servable_len``); an engine
    step that raises fails its requests with 500, frees their blocks, and the server keeps
    serving."""
    small = serve(engine={"num_blocks": 17})  # 16 usable blocks = 256 tokens
    url = small.base_url + "/v1/completions"
    body = {"model": "stories260K", "prompt": list(range(3, 203)), "max_tokens": 100}
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "<= 257" in err["message"]
    m = wait_idle(small.base_url)
    assert m['kvpage:server_requests_rejected_total{reason="prompt_too_long"}'] == 1
    assert m["kvpage:requests_rejected_total"] == 0  # the engine never saw it

    engine = small.app.state.serving.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = flaky_step
    try:
        r = httpx.post(
            url,
            json={"model": "stories260K", "prompt": "Once", "max_tokens": 20, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
        m = wait_idle(small.base_url)
        assert m["kvpage:engine_step_errors_total"] == 1
        ok = httpx.post(
            url, json={"model": "stories260K", "prompt": "Once", "max_tokens": 4}, timeout=30
        )
        assert ok.status_code == 200
    finally:
        del engine.step


def test_prefix_cache_hits_show_in_metrics(server):
    base = wait_idle(server.base_url)
    prompt = list(range(5, 70))  # 65 tokens: 4 full blocks of 16
    for _ in range(2):
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": "stories260K", "prompt": prompt, "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200
    m = wait_idle(server.base_url)
    hits = m["kvpage:prefix_cache_hits_total"] - base["kvpage:prefix_cache_hits_total"]
    assert hits == 64  # the second request reuses the 4 committed blocks
    assert 0 < m["kvpage:prefix_cache_hit_ratio"] <= 1


def test_n_gt_1_under_preemption_matches_llm_generate(serve):
    """n=16 x 100 tokens on the 64-block pool forces preemption (recompute) and choices
    finishing on different steps; every choice's text, streamed or not, must equal the
    offline API's (finding: choices finished before their siblings came back as "")."""
    body = {
        "model": "stories260K",
        "prompt": "hi",
        "max_tokens": 100,
        "n": 16,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 7,
    }
    llm = LLM(model="stories260K", **ENGINE)
    (ref,) = llm.generate(
        ["hi"], SamplingParams(max_tokens=100, n=16, ignore_eos=True, temperature=1.0, seed=7)
    )
    assert ref.num_preemptions > 0  # the scenario really preempts
    want = {c.index: c.text for c in ref.outputs}
    assert all(want.values())

    server = serve(degradation={"enabled": False})  # no max_tokens cap after the failures
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = {c["index"]: c["text"] for c in r.json()["choices"]}
    assert got == want
    assert r.json()["usage"]["completion_tokens"] == 1600

    parts: dict[int, str] = {}
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body | {"stream": True}, timeout=120
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    parts[ch["index"]] = parts.get(ch["index"], "") + ch["text"]
    assert parts == want


def _rejected_and_400(m):
    return (
        sum(v for k, v in m.items() if k.startswith("kvpage:server_requests_rejected_total{")),
        m.get('kvpage:server_requests_total{endpoint="completions",status="400"}', 0.0),
    )


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64, 99999999999999999999999])
def test_bad_seed_is_a_400_for_that_request_only(server, seed):
    """Finding: seed -1 -> 500 (uncounted); a huge seed failed every in-flight request."""
    base = wait_idle(server.base_url)
    url = server.base_url + "/v1/completions"
    ok_body = {"model": "stories260K", "prompt": "Once", "max_tokens": 40, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        others = [ex.submit(httpx.post, url, json=ok_body, timeout=60) for _ in range(3)]
        bad = httpx.post(url, json=ok_body | {"seed": seed, "temperature": 1.0}, timeout=60)
        oks = [f.result() for f in others]
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "seed"
    assert bad.json()["error"]["message"].startswith("seed: expected ")
    assert [r.status_code for r in oks] == [200] * 3
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in oks)
    m = wait_idle(server.base_url)
    r0, b0 = _rejected_and_400(base)
    r1, b1 = _rejected_and_400(m)
    assert (r1 - r0, b1 - b0) == (1, 1)
    assert m.get("kvpage:engine_step_errors_total", 0.0) == base.get(
        "kvpage:engine_step_errors_total", 0.0
    )


def test_seed_plus_n_must_fit_signed_64_bits(server):
    url = server.base_url + "/v1/completions"
    body = {"model": "stories260K", "prompt": "Once", "max_tokens": 2, "temperature": 1.0}
    r = httpx.post(url, json=body | {"seed": 2**63 - 1, "n": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = httpx.post(url, json=body | {"seed": 2**63 - 2, "n": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_request_rejected_from_the_engine_maps_to_400_with_param(server, monkeypatch):
    """Any RequestRejected the engine raises at add time is a counted 400 naming the
    field, not a 500; the server keeps serving."""
    from kvpage.errors import RequestRejected

    engine = server.app.state.serving.engine

    def refuse(*a, **k):
        raise RequestRejected("top_k: expected -1 or an int >= 1, got 0", reason="invalid_x")

    base = wait_idle(server.base_url)
    monkeypatch.setattr(engine, "add_request", refuse)
    url = server.base_url + "/v1/completions"
    body = {"model": "stories260K", "prompt": "Once", "max_tokens": 2}
    for stream in (False, True):
        r = httpx.post(url, json=body | {"stream": stream}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "top_k" and err["code"] == "engine_rejected"
    monkeypatch.undo()
    m = wait_idle(server.base_url)
    assert m['kvpage:server_requests_rejected_total{reason="invalid_x"}'] == 2
    assert _rejected_and_400(m)[1] - _rejected_and_400(base)[1] == 2
    assert httpx.post(url, json=body, timeout=30).status_code == 200


def test_tokenization_does_not_block_the_event_loop(server, monkeypatch):
    """Finding: encode ran on the event loop, so a long prompt stalled /health. Here the
    encode blocks until released; /health must answer meanwhile (it could not if encode
    ran on the loop), then the request completes normally."""
    import threading

    state = server.app.state.serving
    real_encode = state.tokenizer.encode
    entered, release = threading.Event(), threading.Event()

    def blocking_encode(text, bos=True):
        entered.set()
        release.wait(30)
        return real_encode(text, bos=bos)

    monkeypatch.setattr(state.tokenizer, "encode", blocking_encode)
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 3}
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, server.base_url + "/v1/completions", json=body, timeout=60)
        try:
            assert entered.wait(30)
            h = httpx.get(server.base_url + "/health", timeout=10)
            assert h.status_code == 200 and not fut.done()
        finally:
            release.set()
        r = fut.result()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_huge_text_prompt_is_refused_without_tokenizing(server):
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "stories260K", "prompt": "Once upon a time " * 1000, "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "an estimate, not a count" in err["message"]  # not read as the token count


def test_unexpected_errors_are_counted_500s(server, monkeypatch):
    """Finding 2: an unexpected exception answered 500 but was not counted in
    kvpage:server_requests_total{status="500"}."""
    import kvpage.server.generate_route as route_mod

    def boom(*a, **k):
        raise RuntimeError("injected")

    key = 'kvpage:server_requests_total{endpoint="completions",status="500"}'
    before = metrics_dict(httpx.get(server.base_url + "/metrics").text).get(key, 0.0)
    monkeypatch.setattr(route_mod, "prepare_request", boom)
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "stories260K", "prompt": "Once", "max_tokens": 2},
        timeout=30,
    )
    monkeypatch.undo()
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    after = metrics_dict(httpx.get(server.base_url + "/metrics").text)[key]
    assert after - before == 1


def test_stream_options_without_stream_is_refused(server):
    """As OpenAI and vLLM: stream_options would do nothing on a non-streamed request, so it
    is a 400 naming it, not silently accepted (fresh-user finding)."""
    for path, extra in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {"model": "stories260K", "max_tokens": 1, "stream_options": {"include_usage": True}}
        r = httpx.post(server.base_url + path, json={**body, **extra}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "stream_options"
