"""Integration (slow): a canary group at 0.2 on a real in-process Ray Serve, judged from
``/metrics`` and rolled back to 0 with streams in flight.

The canary gets a deliberately slower configuration (``max_num_batched_tokens: 2``: a
prompt's prefill takes one engine step per 2 tokens, about 30x the default's steps for
the prompt below) and its own block size (8). Checked: every request-level series
parses with ``prometheus_client``'s parser and carries ``group``/``replica``; the
canary's TTFT (the documented PromQL's p99 and the mean) is above the default's; each
group has its own pool-info series; the ``X-KVPage-Group`` header names the group;
``/admin/config`` shows each group's resolved engine; streams running on the canary
while the share goes to 0 all finish normally (0 failures), later requests all go to
the default group.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_serve"), pytest.mark.timeout(900)]

PROMPT = " ".join(["One day a girl named Lily found a shiny red ball."] * 4)
MODEL = "stories260K"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _compare(text: str) -> dict[str, dict[str, float]]:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ingress_app_tests", Path(__file__).with_name("test_ingress_app.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.check_promql_against(text)  # type: ignore[no-any-return]


def _families(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_canary_metrics_differ_and_rollback_with_streams_in_flight() -> None:
    from kvpage.cluster import launch
    from kvpage.cluster.config import ClusterConfig

    cfg = ClusterConfig.model_validate(
        {
            "server": {"port": _free_port(), "log_level": "warning"},
            "router": {"policy": "round_robin", "kv_event_poll_s": 0.2},
            "groups": {
                "default": {"replicas": 1, "num_cpus": 0.5},
                "canary": {
                    "replicas": 1,
                    "num_cpus": 0.5,
                    "traffic_fraction": 0.2,
                    "engine": {"block_size": 8, "max_num_batched_tokens": 2},
                },
            },
            "ingress_num_cpus": 0.25,
        }
    )
    failures: list[str] = []
    try:
        url = launch.start(cfg, ray_init_kwargs={"logging_level": "warning"})
        c = httpx.Client(base_url=url, timeout=120)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}

        def one(_i: int) -> str:
            r = c.post("/v1/completions", json=body)
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:200]}")
                return "failed"
            return str(r.headers.get("x-kvpage-group"))

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            served = list(pool.map(one, range(40)))
        assert not failures, failures
        assert set(served) == {"default", "canary"}, served
        assert 2 <= served.count("canary") <= 20, served.count("canary")

        m = c.get("/metrics").text
        fams = _families(m)  # parses
        for name in (
            "kvpage:time_to_first_token_seconds",
            "kvpage:e2e_request_latency_seconds",
            "kvpage:request_prefill_time_seconds",
            "kvpage:request_success",
            "kvpage:server_requests",
        ):
            samples = [s for s in fams[name].samples if s.value > 0]
            assert {s.labels["group"] for s in samples} == {"default", "canary"}, name
            assert all(s.labels["replica"] not in ("", "none") for s in samples), name
        cmp = _compare(m)
        assert cmp["canary"]["p99_ttft_s"] > cmp["default"]["p99_ttft_s"], cmp
        sums: dict[str, dict[str, float]] = {"default": {}, "canary": {}}
        for x in fams["kvpage:time_to_first_token_seconds"].samples:
            kind = x.name.rsplit("_", 1)[1]
            if kind in ("sum", "count") and x.labels.get("group") in sums:
                d = sums[x.labels["group"]]
                d[kind] = d.get(kind, 0.0) + x.value
        mean = {g: v["sum"] / v["count"] for g, v in sums.items()}
        assert mean["canary"] > mean["default"], mean
        assert cmp["canary"]["error_rate"] == cmp["default"]["error_rate"] == 0.0
        pools = {
            s.labels["group"]: s.labels
            for f in fams.values()
            for s in f.samples
            if s.name == "kvpage:cache_config_info"
        }
        assert (pools["default"]["block_size"], pools["canary"]["block_size"]) == ("16", "8")

        admin = c.get("/admin/config").json()["config"]
        assert admin["groups"]["canary"]["engine"]["block_size"] == 8
        assert admin["groups"]["canary"]["engine"]["num_blocks"] == int(
            pools["canary"]["num_blocks"]
        )
        assert admin["groups"]["default"]["engine"]["backend"] == pools["default"]["backend"]
        assert admin["groups"]["canary"]["traffic_fraction"] == 0.2

        # every new request on the canary, streams started there, then roll back to 0
        assert c.post("/admin/canary", json={"traffic_fraction": 1.0}).status_code == 200
        stream_body = {**body, "max_tokens": 150, "stream": True, "ignore_eos": True}

        def stream(_i: int) -> tuple[str, str | None, int]:
            with c.stream("POST", "/v1/completions", json=stream_body) as r:
                group = str(r.headers.get("x-kvpage-group"))
                finish, n = None, 0
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        failures.append(str(ev["error"]))
                    for ch in ev.get("choices", []):
                        n += 1
                        finish = ch.get("finish_reason") or finish
                return group, finish, r.status_code

        def canary_running() -> float:
            fam = _families(c.get("/metrics").text).get("kvpage:num_requests_running")
            return sum(
                x.value for x in (fam.samples if fam else []) if x.labels.get("group") == "canary"
            )

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, i) for i in range(3)]
            # the rollback lands while they run (150 tokens each take seconds)
            deadline = time.monotonic() + 60
            while canary_running() < 1:
                assert time.monotonic() < deadline, "expected the streams running on the canary"
                time.sleep(0.1)
            assert c.post("/admin/canary", json={"traffic_fraction": 0}).status_code == 200
            after = list(pool.map(one, range(8)))
            got = [f.result() for f in streams]
        assert not failures, failures
        assert [g for g, _, _ in got] == ["canary"] * 3
        assert all(fin == "length" and st == 200 for _, fin, st in got), got
        assert after == ["default"] * 8, after
    finally:
        launch.stop()
