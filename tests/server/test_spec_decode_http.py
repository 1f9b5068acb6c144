"""The server with speculative decoding: greedy completions equal those of a server
without it, sampled ones are served, penalties are refused by name (400), and /metrics
carries the spec_decode counters."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.xdist_group("server_spec_decode")

M = "stories260K"
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "draft_policy": "fixed",
}
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"


def _post(server, **body):
    return httpx.post(server.base_url + "/v1/completions", json={"model": M, **body}, timeout=60)


def test_spec_server(serve):
    plain = serve()
    spec = serve(engine={"speculative_config": SPEC})
    body = dict(prompt=PROMPT, max_tokens=40, temperature=0, stop=[" mat."])
    a, b = _post(plain, **body), _post(spec, **body)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    r = _post(spec, prompt=PROMPT, max_tokens=5, temperature=0.7, seed=3)
    assert r.status_code == 200, r.text
    r = _post(spec, prompt=PROMPT, max_tokens=5, temperature=0.7, presence_penalty=0.5)
    assert r.status_code == 400 and "presence_penalty" in r.text, r.text
    text = httpx.get(spec.base_url + "/metrics", timeout=30).text
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        samples = [s for s in fam[f"kvpage:spec_decode_{n}"].samples if s.name.endswith("_total")]
        assert samples and samples[0].value >= 0
    drafts = [
        s for s in fam["kvpage:spec_decode_num_draft_tokens"].samples if s.name.endswith("_total")
    ]
    assert drafts[0].value > 0
