"""/metrics as a vLLM dashboard reads it (issue 15), parsed with prometheus_client's own
parser: model_name labels, request_success_total{finished_reason}, the per-request phase
histograms, and every kvpage name of the documented vLLM mapping exists."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.xdist_group("server_vllm_metrics")

M = "stories260K"


@pytest.fixture(scope="module")
def server(serve):
    return serve()


def _families(server) -> dict:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _post(server, **body):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": M, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_engine_metrics_carry_model_name_and_request_metrics_count(server):
    _post(server, prompt="Once upon a time", max_tokens=5, ignore_eos=True, n=2)
    r = _post(server, prompt="Once upon a time", max_tokens=30, temperature=0, stop=[" the"])
    fam = _families(server)
    engine = [
        n for n in fam if n.startswith("kvpage:") and fam[n].documentation.startswith("engine")
    ]
    assert "kvpage:kv_cache_usage_perc" in engine and "kvpage:num_preemptions" in engine
    for n in engine:
        assert all(s.labels.get("model_name") == M for s in fam[n].samples), n
    success = {
        s.labels["finished_reason"]: s.value
        for s in fam["kvpage:request_success"].samples
        if s.name.endswith("_total")
    }
    stop_choices = 1 if r["choices"][0]["finish_reason"] == "stop" else 0
    assert success["length"] == 2 + (1 - stop_choices)
    assert success.get("stop", 0.0) == stop_choices
    for phase in ("queue", "prefill", "decode", "inference"):
        f = fam[f"kvpage:request_{phase}_time_seconds"]
        count = [s for s in f.samples if s.name.endswith("_count")]
        assert len(count) == 1 and count[0].labels == {"model_name": M}
        assert count[0].value == 2, phase  # one per request


def test_documented_vllm_mapping_names_exist(server):
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = text.split("<!-- vllm-metric-map")[1].split("<!-- /vllm-metric-map -->")[0]
    names = set()
    for line in table.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and "kvpage:" in cells[2]:
            names.update(re.findall(r"`(kvpage:[a-z0-9_:]+)", cells[2]))
    assert len(names) >= 16
    fam = _families(server)
    present = set(fam) | {n + "_total" for n in fam} | {n + "_info" for n in fam}
    missing = sorted(n for n in names if n not in present)
    assert not missing
