"""Integration: 2 engine replicas of the bundled model on a real (in-process) Ray Serve.

One test, in the default run (about a minute on 2 cores, most of it Ray starting): the
official ``openai`` client against ``kvpage serve --replicas 2`` (``launch.start``, the
code path of the CLI), plain and streaming greedy output equal to ``LLM.generate``, bad
input refused at the ingress without reaching a replica, a repeated long prompt routed
to the replica that holds its blocks (``kv_precise`` fed by KV events), the replica
serving a stream killed with ``ray.kill`` after its first tokens (the stream ends with
an OpenAI-shaped error event naming the replica; a request waiting unstarted on that
replica is retried once on the other and answered; the router drops the dead
replica's view), the next requests still answered, a replacement replica started by
Ray Serve, and at the end Ray shut down with none of its processes left.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.xdist_group("ray_serve"), pytest.mark.timeout(600)]

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]
LONG = " ".join(["One day a girl named Lily found a shiny red ball in the garden."] * 4)
#: a stream long enough (about 2 s of decoding on 2 cores) to be killed in the middle
STREAM_TOKENS = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _replicas(text: str) -> set[str]:
    """Replica ids whose engine metrics the ingress exports now."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["replica"]
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvpage:num_requests_running" and "replica" in s.labels
    }


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {what} within {timeout_s}s")
        time.sleep(0.25)


def _session_processes(session: str) -> list[str]:
    """Live processes whose command line names this Ray session (not other users')."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if session in cmd and state != "Z" and int(d.name) != os.getpid():
            found.append(f"{d.name}: {cmd[:120]}")
    return found


def test_two_replicas_on_ray_serve() -> None:
    import ray

    from kvpage import LLM, SamplingParams
    from kvpage.cluster import launch
    from kvpage.cluster.config import ClusterConfig

    cfg = ClusterConfig.model_validate(
        {
            "server": {"port": _free_port(), "log_level": "warning"},
            "router": {"policy": "kv_precise", "kv_event_poll_s": 0.1},
            # max_num_seqs=1: a request routed to a busy replica waits there unstarted
            "groups": {"default": {"replicas": 2, "num_cpus": 0.5, "engine": {"max_num_seqs": 1}}},
            "ingress_num_cpus": 0.25,
        }
    )
    llm = LLM(model="stories260K")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    want_then = llm.generate([LONG + " Then"], SamplingParams(temperature=0.0, max_tokens=8))
    want_then = want_then[0].outputs[0].text
    session = ""
    try:
        url = launch.start(cfg, ray_init_kwargs={"logging_level": "warning"})
        session = Path(ray._private.worker._global_node.get_session_dir_path()).name
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)

        # plain and streaming greedy completions equal the engine's own
        for prompt, text in zip(PROMPTS, want):
            r = client.completions.create(
                model="stories260K", prompt=prompt, max_tokens=12, temperature=0
            )
            assert r.choices[0].text == text
            chunks = client.completions.create(
                model="stories260K", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text

        metrics = lambda: httpx.get(url + "/metrics", timeout=60).text  # noqa: E731
        before = metrics()
        routed = _metric(before, "kvpage:router_decisions_total")
        assert routed == 2 * len(PROMPTS)
        # every replica's engine metrics, labelled by group and replica
        assert _metric(before, "kvpage:prompt_tokens_total", group="default") > 0

        # bad input: the single server's refusal, answered at the ingress
        bad = httpx.post(
            url + "/v1/completions",
            json={"model": "stories260K", "prompt": "hi", "max_tokens": -1},
            timeout=60,
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "max_tokens: expected >= 1, got -1"
        after = metrics()
        assert _metric(after, "kvpage:router_decisions_total") == routed
        assert _metric(after, "kvpage:group_requests_total") == routed

        # a long prompt, then again: the second goes where its blocks are
        first = client.completions.create(
            model="stories260K", prompt=LONG, max_tokens=4, temperature=0
        )
        assert first.usage.prompt_tokens >= 64
        _wait(
            lambda: _metric(metrics(), "kvpage:router_index_blocks") >= 4,
            60,
            "the router's index to hold the long prompt's blocks",
        )
        second = client.completions.create(
            model="stories260K", prompt=LONG, max_tokens=4, temperature=0
        )
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= 4 * 16, cached
        m = metrics()
        assert _metric(m, "kvpage:router_actual_hit_blocks_total") >= 4
        assert _metric(m, "kvpage:router_predicted_hit_blocks_total") >= 4

        # kill the replica serving a stream after its first tokens (max_num_seqs=1, so
        # a second request routed there waits, not started): the stream ends with an
        # OpenAI-shaped error event, the waiting request is retried on the other replica
        # and answered, the router drops the dead replica's view at once
        def per_replica(name: str) -> dict[str, float]:
            from prometheus_client.parser import text_string_to_metric_families

            out: dict[str, float] = {}
            for fam in text_string_to_metric_families(metrics()):
                for smp in fam.samples:
                    if smp.name == name and "replica" in smp.labels:
                        out[smp.labels["replica"]] = smp.value
            return out

        dec0 = per_replica("kvpage:router_decisions_total")
        stream = client.completions.create(
            model="stories260K",
            prompt=LONG,
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        head = next(chunks)
        assert head.choices and head.choices[0].finish_reason is None
        dec1 = per_replica("kvpage:router_decisions_total")
        (dead,) = [r for r, v in dec1.items() if v > dec0.get(r, 0.0)]
        _wait(
            lambda: per_replica("kvpage:router_index_blocks").get(dead, 0) >= 4,
            30,
            "the stream's prompt blocks in the router's view of its replica",
        )
        retries0 = _metric(metrics(), "kvpage:router_retries_total")
        waiting: dict[str, object] = {}

        def send_waiting() -> None:
            try:
                waiting["r"] = client.completions.create(
                    model="stories260K", prompt=LONG + " Then", max_tokens=8, temperature=0
                )
            except Exception as exc:  # reported by the assertion below
                waiting["r"] = exc

        sender = threading.Thread(target=send_waiting, daemon=True)
        sender.start()
        _wait(
            lambda: per_replica("kvpage:router_decisions_total").get(dead, 0) > dec1[dead],
            30,
            "the second request routed to the replica holding its prefix",
        )
        (actor,) = [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].endswith("#" + dead)
        ]
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
        rest = []
        with pytest.raises(openai.APIError) as err:
            for c in chunks:
                rest.append(c)
        # not a silent truncation: no chunk claimed a normal finish, the stream was cut
        # short of STREAM_TOKENS, and the error names the failed replica
        assert all(c.choices[0].finish_reason is None for c in rest if c.choices)
        assert len(rest) + 1 < STREAM_TOKENS
        assert f"replica {dead} of group default failed" in str(err.value), str(err.value)
        sender.join(120)
        got = waiting.get("r")
        assert not isinstance(got, Exception) and got is not None, got
        assert got.choices[0].text == want_then  # type: ignore[attr-defined]
        m = metrics()
        assert _metric(m, "kvpage:router_retries_total") == retries0 + 1
        assert _metric(m, "kvpage:router_replicas_removed_total") >= 1
        assert dead not in per_replica("kvpage:router_index_blocks")
        for i in range(6):
            r = client.completions.create(
                model="stories260K", prompt=PROMPTS[i % 3], max_tokens=12, temperature=0
            )
            assert r.choices[0].text == want[i % 3]
        _wait(
            lambda: _metric(metrics(), "kvpage:router_replicas_removed_total") >= 1,
            120,
            "the dead replica's index view to be dropped",
        )
        # Ray Serve replaces the dead replica (a new actor, a new replica id) and the
        # ingress's pump reports two live replicas again
        _wait(
            lambda: len(_replicas(metrics())) == 2 and dead not in _replicas(metrics()),
            180,
            "a replacement replica",
        )
        r = client.completions.create(
            model="stories260K", prompt=PROMPTS[0], max_tokens=12, temperature=0
        )
        assert r.choices[0].text == want[0]
    finally:
        launch.stop()
    assert not ray.is_initialized()
    assert session
    _wait(lambda: not _session_processes(session), 60, "every Ray process to exit")
