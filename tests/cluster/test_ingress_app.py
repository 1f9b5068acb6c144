"""The ingress app (the server's FastAPI app over replica groups) without Ray: fake
deployment handles stand in for the replicas, the router core is the real one.

Checks what the HTTP client sees: a stream whose replica dies after its first token
ends with an error event and ``[DONE]``; a replica dying before the first output is
retried on the other one; a refusal never reaches a replica; the canary admin route
validates its body and changes the split; KV events pulled by the pump reach the index
and /metrics.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from kvpage.cluster.config import ClusterConfig
from kvpage.cluster.core import CORES
from kvpage.cluster.ingress import Ingress
from kvpage.engine.params import CompletionOutput, RequestOutput
from kvpage.routing.events import BlockStored, KVEventBatch, KVSnapshot


class _Resp:
    """A DeploymentResponse stand-in: awaitable, cancellable."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        async def get() -> Any:
            await asyncio.sleep(0)
            return self.value

        return get().__await__()

    def cancel(self) -> None:
        pass


class _Gen:
    def __init__(self, items: list[Any], delay_s: float = 0.0) -> None:
        self.items = items
        self.delay_s = delay_s  # before the first item (a slower replica)

    def __aiter__(self) -> _Gen:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(self.delay_s)
        self.delay_s = 0.0
        if not self.items:
            raise StopAsyncIteration
        x = self.items.pop(0)
        if isinstance(x, BaseException):
            raise x
        return x

    def cancel(self) -> None:
        self.items = []


def _out(rid: str, ids: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=[1, 2],
        num_cached_tokens=0,
        outputs=[
            CompletionOutput(0, list(ids), "ab" if finished else "", "length" if finished else None)
        ],
        finished=finished,
        arrival_time=0.0,
    )


class _Group:
    """One group's handle; ``behaviour[replica]`` decides what its generate does."""

    def __init__(self, name: str, info: dict[str, Any], replicas: list[str]) -> None:
        self.name, self.info_v, self.replicas = name, info, replicas
        self.behaviour: dict[str, str] = {r: "ok" for r in replicas}
        self.generated: list[str] = []
        self.priorities: list[int] = []
        self.delay_s = 0.0
        self.seq = 0

    @property
    def core(self) -> Any:
        return CORES[f"kvpage/{self.name}"]

    def options(self, **kw: Any) -> _Group:
        return self

    @property
    def info(self) -> Any:
        return _Method(lambda route: self.info_v)

    @property
    def kv_events(self) -> Any:
        def ev(route: dict[str, Any]) -> dict[str, Any]:
            rid = route["target"]
            self.seq += 1
            b = KVEventBatch(rid, 1, 0.0, (BlockStored((b"\x01" * 32,)),), "ep")
            return {
                "replica_id": rid,
                "batches": [b.to_dict()] if self.seq <= len(self.replicas) else [],
                "load": {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0},
                "metrics": {"kvpage:prompt_tokens_total": 7.0, "kvpage:num_requests_running": 0},
            }

        return _Method(ev)

    @property
    def kv_snapshot(self) -> Any:
        # as a publisher's: what it holds now, with the seq of its last drained batch
        return _Method(
            lambda route: KVSnapshot(route["target"], 1, frozenset({b"\x01" * 32}), "ep").to_dict()
        )

    @property
    def generate(self) -> Any:
        group = self

        class _G:
            def remote(
                self, rid: str, prompt: Any, params: Any, route: dict[str, Any], priority: int = 0
            ) -> _Gen:
                group.priorities.append(priority)
                cands = [r for r in group.replicas if r not in route["exclude"]] or group.replicas
                choice = group.core.choose(rid, route, cands)
                group.core.routed(rid, choice)
                group.generated.append(choice)
                how = group.behaviour[choice]
                if how == "die_before":
                    return _Gen([RuntimeError("ActorDiedError: killed")])
                if how == "die_after":
                    return _Gen([_out(rid, [5], False), RuntimeError("ActorDiedError: killed")])
                return _Gen([_out(rid, [5], False), _out(rid, [5, 6], True)], group.delay_s)

        return _G()


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, route: Any = None) -> _Resp:
        return _Resp(self.fn(route))


@pytest.fixture(scope="module")
def info() -> dict[str, Any]:
    from kvpage.engine import LLMEngine

    e = LLMEngine.from_config(model="stories260K")
    return {
        "tokenizer": e.tokenizer,
        "block_size": 16,
        "num_blocks": int(e.cache_spec.num_blocks),
        "kv_dtype": "auto",
        "total_bytes": 1.0,
        "max_model_len": int(e.scheduler.max_model_len),
        "backend_name": "fake",
        "hash_seed": 0,
    }


def _run(
    info: dict[str, Any],
    body: Any,
    server: dict[str, Any] | None = None,
    canary_info: dict[str, Any] | None = None,
) -> None:
    async def main() -> None:
        cfg = ClusterConfig.model_validate(
            {
                "server": server or {},
                "router": {"policy": "round_robin", "kv_event_poll_s": 0.05},
                "groups": {
                    "default": {"replicas": 2},
                    "canary": {"replicas": 1, "traffic_fraction": 0.0},
                },
            }
        )
        groups = {
            "default": _Group("default", info, ["a", "b"]),
            "canary": _Group("canary", canary_info or info, ["c"]),
        }
        ing = Ingress(cfg, **groups)
        app = await ing.__serve_build_asgi_app__()
        assert ing.state is not None and ing.pump is not None
        for g in groups.values():
            g.core.set_replicas(g.replicas)
        ing.state.loop.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            try:
                await body(c, ing, groups)
            finally:
                await ing.pump.stop()

    asyncio.run(main())


REQ = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4}


def _events(text: str) -> list[Any]:
    return [
        json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def test_stream_ends_with_an_error_event_when_its_replica_dies(info: dict[str, Any]) -> None:
    async def body(c: httpx.AsyncClient, ing: Ingress, groups: dict[str, _Group]) -> None:
        d = groups["default"]
        d.behaviour = {"a": "die_after", "b": "die_after"}
        r = await c.post("/v1/completions", json={**REQ, "stream": True})
        assert r.status_code == 200
        ev = _events(r.text)
        assert ev[-1] == "[DONE]"
        err = ev[-2]["error"]
        assert "replica a of group default failed" in err["message"]
        assert err["type"] == "server_error"
        assert len(d.generated) == 1  # not re-run after a token was produced
        # plain request: nothing reached the client, so it is retried once on the other
        # replica (which dies too: 500 naming it)
        r = await c.post("/v1/completions", json=REQ)
        assert r.status_code == 500 and "replica a of group default" in r.json()["error"]["message"]
        assert d.generated == ["a", "b", "a"]

    _run(info, body)


def test_plain_request_is_retried_when_its_replica_dies_mid_run(info: dict[str, Any]) -> None:
    """Issue 23: a non-streamed request in flight on a killed replica got a 500 although
    the client had received nothing."""

    async def body(c: httpx.AsyncClient, ing: Ingress, groups: dict[str, _Group]) -> None:
        d = groups["default"]
        d.behaviour = {"a": "die_after", "b": "ok"}
        r = await c.post("/v1/completions", json=REQ)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "ab"  # b's run, from its first token
        assert r.json()["usage"]["completion_tokens"] == 2
        assert d.generated == ["a", "b"]
        m = (await c.get("/metrics")).text
        assert 'kvpage:router_retries_total{group="default"} 1.0' in m

    _run(info, body)


def test_retry_before_first_output_and_refusals_stay_at_the_ingress(info: dict[str, Any]) -> None:
    async def body(c: httpx.AsyncClient, ing: Ingress, groups: dict[str, _Group]) -> None:
        d = groups["default"]
        d.behaviour = {"a": "die_before", "b": "ok"}
        r = await c.post("/v1/completions", json=REQ)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
        assert d.generated == ["a", "b"]
        for bad in (
            {**REQ, "max_tokens": -1},
            {**REQ, "model": "nope"},
            {**REQ, "temperature": "hot"},
            {**REQ, "no_such_field": 1},
        ):
            r = await c.post("/v1/completions", json=bad)
            assert 400 <= r.status_code < 500 and "error" in r.json()
        assert d.generated == ["a", "b"]  # no refused request reached a replica
        m = (await c.get("/metrics")).text
        assert 'kvpage:router_retries_total{group="default"} 1.0' in m

    _run(info, body)


def test_canary_admin_route_and_kv_events_on_metrics(info: dict[str, Any]) -> None:
    async def body(c: httpx.AsyncClient, ing: Ingress, groups: dict[str, _Group]) -> None:
        assert (await c.get("/admin/canary")).json()["traffic_fraction"] == 0.0
        for bad in ({"traffic_fraction": 2}, {"traffic_fraction": "x"}, {"fraction": 0.1}, [1]):
            r = await c.post("/admin/canary", json=bad)
            assert r.status_code == 400 and "traffic_fraction" in r.json()["error"]["message"]
        r = await c.post(  # the last value would win silently: refused, naming the key
            "/admin/canary",
            content=b'{"traffic_fraction": 0.5, "traffic_fraction": 1}',
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_key", r.text
        r = await c.post("/admin/canary", json={"traffic_fraction": 1.0})
        assert r.json()["traffic_fraction"] == 1.0
        await c.post("/v1/completions", json=REQ)
        assert groups["canary"].generated == ["c"]
        await c.post("/admin/canary", json={"traffic_fraction": 0})  # roll back
        await c.post("/v1/completions", json=REQ)
        assert groups["canary"].generated == ["c"] and len(groups["default"].generated) == 1
        for _ in range(100):  # the pump pulls every 0.05 s
            m = (await c.get("/metrics")).text
            if 'kvpage:router_index_blocks{group="default",replica="a"} 1.0' in m:
                break
            await asyncio.sleep(0.05)
        assert 'kvpage:router_index_blocks{group="default",replica="a"} 1.0' in m
        assert 'kvpage:router_resyncs_total{group="default",replica="a"}' in m
        assert (
            'kvpage:prompt_tokens_total{group="canary",model_name="stories260K",replica="c"} 7.0'
            in m
        )
        assert 'kvpage:group_requests_total{group="canary"} 1.0' in m
        assert "kvpage:canary_traffic_fraction 0.0" in m

    _run(info, body)


def test_api_keys_at_the_ingress_and_operator_only_admin(info: dict[str, Any]) -> None:
    async def body(c: httpx.AsyncClient, ing: Ingress, groups: dict[str, _Group]) -> None:
        r = await c.post("/v1/completions", json=REQ)
        assert r.status_code == 401
        r = await c.post("/v1/completions", json=REQ, headers={"Authorization": "Bearer sk-x"})
        assert r.status_code == 401
        assert groups["default"].generated == []  # refused before any replica
        user = {"Authorization": "Bearer sk-user"}
        op = {"Authorization": "Bearer sk-op"}
        r = await c.post("/v1/completions", json=REQ, headers=user)
        assert r.status_code == 200 and len(groups["default"].generated) == 1
        for h, status, code in (
            ({}, 401, "invalid_api_key"),
            ({"Authorization": "Bearer sk-x"}, 401, "invalid_api_key"),
            (user, 403, "operator_key_required"),  # a tenant key is not an operator key
        ):
            for r in (
                await c.post("/admin/canary", json={"traffic_fraction": 0.5}, headers=h),
                await c.get("/admin/canary", headers=h),
            ):
                assert r.status_code == status and r.json()["error"]["code"] == code
        r = await c.get("/admin/canary", headers=user)
        assert r.json()["error"]["message"] == (
            "Authorization: expected an operator's key for /admin/canary, got a tenant's key"
        )
        # a tenant is never told the topology (operator keys exist)
        r = await c.post("/v1/completions", json=REQ, headers=user)
        assert r.status_code == 200 and "x-kvpage-group" not in r.headers
        m = await c.get("/metrics", headers=user)  # the same answer as /metrics gives
        assert m.status_code == 403 and m.json()["error"]["code"] == "operator_key_required"
        assert ing.selector.canary_fraction == 0.0
        r = await c.post("/admin/canary", json={"traffic_fraction": 0.5}, headers=op)
        assert r.status_code == 200 and ing.selector.canary_fraction == 0.5

    _run(
        info,
        body,
        server={"security": {"api_keys": ["sk-user"], "metrics_api_keys": ["sk-op"]}},
    )


def _samples(text: str, name: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def _by_group(text: str, name: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in _samples(text, name):
        if all(s.labels.get(k) == v for k, v in labels.items()):
            g = s.labels.get("group", "")
            out[g] = out.get(g, 0.0) + s.value
    return out


def documented_promql() -> str:
    """The canary-vs-default PromQL block of docs/serving.md."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    return text.split("<!-- canary-promql -->")[1].split("<!-- /canary-promql -->")[0]


def check_promql_against(metrics_text: str) -> dict[str, dict[str, float]]:
    """Every series the documented PromQL selects exists in ``metrics_text`` with a
    ``group`` label; returns, per group, the p99 TTFT as ``histogram_quantile``
    computes it from the cumulative buckets and the error rate of the documented
    formula (counters since start instead of a 5m rate)."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(metrics_text)}
    used = set(re.findall(r"(kvpage:[a-z0-9_:]+)\{", documented_promql()))
    assert used, "no series in the documented PromQL"
    for name in used:
        base = re.sub(r"_(bucket|total)$", "", name)
        assert base in fams, name
        samples = [x for x in fams[base].samples if x.name == name]
        # a labelled counter has no series before its first increment (no error yet)
        assert samples or name == "kvpage:request_errors_total", name
        assert all("group" in x.labels for x in samples), name
    out: dict[str, dict[str, float]] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for x in fams["kvpage:time_to_first_token_seconds"].samples:
        if x.name.endswith("_bucket"):
            buckets.setdefault(x.labels["group"], []).append((float(x.labels["le"]), x.value))
    for g, bs in buckets.items():
        merged: dict[float, float] = {}
        for le, v in bs:  # sum by (group, le): over replicas
            merged[le] = merged.get(le, 0.0) + v
        cum = sorted(merged.items())
        total = cum[-1][1]
        p99 = float("nan")
        if total > 0:
            rank, lo, prev = 0.99 * total, 0.0, 0.0
            for le, v in cum:
                if v >= rank:
                    p99 = le if le == float("inf") else lo + (le - lo) * (rank - prev) / (v - prev)
                    break
                lo, prev = le, v
        err = _by_group(metrics_text, "kvpage:request_errors_total").get(g, 0.0)
        ok = _by_group(metrics_text, "kvpage:request_success_total").get(g, 0.0)
        out[g] = {"p99_ttft_s": p99, "error_rate": err / (err + ok) if err + ok else 0.0}
    return out


def test_request_metrics_pool_info_and_header_per_group(info: dict[str, Any]) -> None:
    """Every request-level series carries group and replica; a slower canary shows in its
    own TTFT buckets; the canary's failures in its own error series; one pool-info
    series per group with the group's own block size; the group header (no keys)."""
    engine = {"model": "stories260K", "num_blocks": info["num_blocks"], "backend": "fake"}
    info = {**info, "engine_config": engine}
    canary_info = {
        **info,
        "block_size": 8,
        "num_blocks": 64,
        "engine_config": {**engine, "block_size": 8, "num_blocks": 64},
    }

    async def body(c: httpx.AsyncClient, ing: Ingress, groups: dict[str, _Group]) -> None:
        groups["canary"].delay_s = 0.3  # a deliberately slower canary
        r = await c.post("/v1/completions", json=REQ)
        assert r.status_code == 200 and r.headers["x-kvpage-group"] == "default"
        assert r.headers["x-kvpage-replica"] in {"a", "b"}
        ing.set_canary(1.0)
        for stream in (False, True):
            r = await c.post("/v1/completions", json={**REQ, "stream": stream})
            assert r.status_code == 200 and r.headers["x-kvpage-group"] == "canary"
            assert r.headers["x-kvpage-replica"] == "c"
        groups["canary"].behaviour = {"c": "die_before"}  # retried once, then 503
        r = await c.post("/v1/completions", json=REQ)
        assert r.status_code == 503
        ing.set_canary(0.0)
        r = await c.post("/v1/completions", json={**REQ, "max_tokens": -1})
        assert r.status_code == 400  # refused at the ingress: group "none"
        m = (await c.get("/metrics")).text
        ttft = "kvpage:time_to_first_token_seconds"
        assert _by_group(m, ttft + "_count") == {"default": 1.0, "canary": 2.0}
        # the canary's first tokens all took >= 0.3 s: none in the 0.25 s bucket
        assert _by_group(m, ttft + "_bucket", le="0.25")["canary"] == 0.0
        for s in _samples(m, ttft + "_count"):
            assert s.labels["replica"] in ({"a", "b"} if s.labels["group"] == "default" else {"c"})
        e2e = "kvpage:e2e_request_latency_seconds_count"
        assert _by_group(m, e2e) == {"default": 1.0, "canary": 2.0}
        assert _by_group(m, "kvpage:request_success_total") == {"default": 1.0, "canary": 2.0}
        assert _by_group(m, "kvpage:request_errors_total") == {"canary": 1.0}
        (err,) = _samples(m, "kvpage:request_errors_total")
        assert err.labels["reason"] == "replica_unavailable" and err.labels["replica"] == "c"
        assert _by_group(m, "kvpage:server_requests_total", status="200") == {
            "default": 1.0,
            "canary": 2.0,
        }
        assert _by_group(m, "kvpage:server_requests_total", status="503") == {"canary": 1.0}
        assert _by_group(m, "kvpage:server_requests_total", status="400") == {"none": 1.0}
        pools = {s.labels["group"]: s.labels for s in _samples(m, "kvpage:cache_config_info")}
        assert set(pools) == {"default", "canary"}
        assert (pools["default"]["block_size"], pools["canary"]["block_size"]) == ("16", "8")
        assert pools["canary"]["num_blocks"] == "64" and pools["default"]["replicas"] == "2"
        # the documented canary comparison, read from the same text
        cmp = check_promql_against(m)
        assert cmp["canary"]["p99_ttft_s"] > 0.25  # the slower canary shows
        assert cmp["canary"]["error_rate"] == 1 / 3 and cmp["default"]["error_rate"] == 0.0
        # /admin/config: the running deployment, the canary share in effect now
        conf = (await c.get("/admin/config")).json()
        assert conf["config"]["groups"]["canary"]["traffic_fraction"] == 0.0
        assert conf["config"]["groups"]["canary"]["engine"]["block_size"] == 8
        assert conf["config"]["groups"]["default"]["engine"]["num_blocks"] == info["num_blocks"]
        assert conf["machines"]["ingress"]["kvpage"]
        blocks = _by_group(m, "kvpage:group_kv_cache_blocks")
        assert blocks == {"default": 2.0 * info["num_blocks"], "canary": 64.0}

    _run(info, body, canary_info=canary_info)
