"""The scale-out pieces without Ray: deployment file, CLI, group choice, router core,
the ingress engine loop's retry and failure handling, and that ``import kvpage`` (and
``kvpage --help``) never imports Ray."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import yaml

from kvpage.cache import hash_request_blocks
from kvpage.cluster.cli import cluster_config_from_args
from kvpage.cluster.config import ClusterConfig, dump_cluster_config, load_cluster_config
from kvpage.cluster.core import RouterCore, RouterObserver
from kvpage.cluster.remote import GroupSelector, RemoteEngineLoop, ReplicaGroup
from kvpage.errors import RequestRejected, SpecError
from kvpage.server.auth import scoped_cache_salt, unauthenticated_tenant
from kvpage.server.engine_loop import EngineFailure
from kvpage.server.protocol import APIError


def test_import_kvpage_and_cli_do_not_import_ray() -> None:
    code = (
        "import sys, kvpage, kvpage.cli, kvpage.cluster.cli, kvpage.cluster.config\n"
        "kvpage.cli.build_parser()\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------ deployment file
def test_config_roles_are_checked() -> None:
    with pytest.raises(ValueError, match="default"):
        ClusterConfig(groups={"canary": {"replicas": 1, "traffic_fraction": 0.1}})
    with pytest.raises(ValueError, match="traffic_fraction"):
        ClusterConfig(groups={"default": {}, "canary": {"replicas": 1}})
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        ClusterConfig(groups={"default": {"min_prompt_tokens": 5}})
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        ClusterConfig(groups={"default": {}, "long_context": {"replicas": 1}})
    with pytest.raises(ValueError, match="engine.model"):
        ClusterConfig(
            groups={"default": {}, "canary": {"traffic_fraction": 0.1, "engine": {"model": "x"}}}
        )
    with pytest.raises(ValueError, match="no_such"):
        ClusterConfig.model_validate({"groups": {"default": {"no_such": 1}}})
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"groups": {"default": {}, "blue": {}}})
    # several ingress replicas: refused by name, with the reason
    with pytest.raises(ValueError, match="ingress_replicas: expected 1, got 2: .*one consumer"):
        ClusterConfig(ingress_replicas=2)
    assert ClusterConfig().ingress_replicas == 1


def test_config_dump_load_round_trip(tmp_path: Any) -> None:
    cfg = ClusterConfig.model_validate(
        {
            "router": {"policy": "prefix_approx"},
            "groups": {
                "default": {"replicas": 3, "engine": {"block_size": 8}},
                "long_context": {"replicas": 1, "min_prompt_tokens": 100},
                "canary": {"replicas": 1, "traffic_fraction": 0.25},
            },
        }
    )
    for fmt, suffix in (("yaml", ".yaml"), ("json", ".json")):
        p = tmp_path / f"dep{suffix}"
        p.write_text(dump_cluster_config(cfg, fmt))  # type: ignore[arg-type]
        back = load_cluster_config(p)
        assert back == cfg
    assert cfg.canary_fraction == 0.25 and cfg.long_context_threshold == 100
    assert cfg.num_replicas() == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: {default: {replicas: -1}}\n")
    with pytest.raises(SpecError, match="groups.default.replicas"):
        load_cluster_config(bad)


def _serve_args(argv: list[str]) -> Any:
    import argparse

    from kvpage.cluster.cli import add_serve_parser

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["serve", *argv])


def test_cli_flags_make_the_deployment(tmp_path: Any, capsys: Any) -> None:
    from kvpage.cluster.cli import serve_entry

    args = _serve_args(["--replicas", "3", "--router", "round_robin", "--block-size", "8"])
    cfg = cluster_config_from_args(args)
    assert cfg.groups["default"].replicas == 3
    assert cfg.groups["default"].engine.block_size == 8
    assert cfg.router.policy == "round_robin" and cfg.ray_address is None
    # --dump-config prints the deployment file; it loads back to the same config
    assert serve_entry(_serve_args(["--replicas", "2", "--dump-config"])) == 0
    dumped = yaml.safe_load(capsys.readouterr().out)
    assert dumped["groups"]["default"]["replicas"] == 2
    f = tmp_path / "d.yaml"
    f.write_text(yaml.safe_dump(dumped))
    args = _serve_args(["--deployment", str(f), "--ray-address", "auto", "--port", "9001"])
    cfg = cluster_config_from_args(args)
    assert cfg.ray_address == "auto" and cfg.server.port == 9001
    assert serve_entry(_serve_args(["--replicas", "0"])) == 2
    assert "--replicas: expected >= 1, got 0" in capsys.readouterr().err


def test_resolved_deployment_dump_pins_every_group_and_is_a_fixed_point(
    tmp_path: Any, capsys: Any
) -> None:
    from kvpage.cluster.cli import serve_entry

    f = tmp_path / "d.yaml"
    f.write_text(
        "groups:\n  default: {replicas: 1, engine: {max_num_seqs: 4}}\n"
        "  canary: {replicas: 1, traffic_fraction: 0.2, engine: {block_size: 8, max_num_seqs: 2}}\n"
    )
    assert serve_entry(_serve_args(["--deployment", str(f), "--dump-config", "--resolved"])) == 0
    first = capsys.readouterr().out
    data = yaml.safe_load(first)
    d, c = data["groups"]["default"]["engine"], data["groups"]["canary"]["engine"]
    assert (d["num_blocks"], c["num_blocks"]) == (4 * 512 // 16 + 1, 2 * 512 // 8 + 1)
    assert d["backend"] != "auto" and c["max_model_len"] == 512 and c["num_threads"] == 1
    assert data["server"]["resolved_on"]["kvpage"]
    g = tmp_path / "r.yaml"
    g.write_text(first)
    assert serve_entry(_serve_args(["--deployment", str(g), "--dump-config", "--resolved"])) == 0
    assert capsys.readouterr().out == first


def test_cli_router_name_refused_by_argparse() -> None:
    with pytest.raises(SystemExit):
        _serve_args(["--router", "least_loaded"])


# ------------------------------------------------------------------ group choice
def test_group_selector() -> None:
    s = GroupSelector(frozenset({"default", "long_context", "canary"}), 100, 0.0, seed=1)
    assert s.select(100) == "long_context" and s.select(99) == "default"
    assert {s.select(10) for _ in range(200)} == {"default"}
    s.canary_fraction = 1.0
    assert {s.select(10) for _ in range(50)} == {"canary"}
    assert s.select(500) == "long_context"  # long prompts never go to the canary
    s.canary_fraction = 0.25
    n = sum(s.select(10) == "canary" for _ in range(4000))
    assert 800 < n < 1200  # seeded draw: 25 % +- 5 points (binomial sd ~0.7 point)
    s.canary_fraction = 0.0  # rollback
    assert {s.select(10) for _ in range(200)} == {"default"}
    only = GroupSelector(frozenset({"default"}), None, 0.5)
    assert only.select(10_000) == "default"


# ------------------------------------------------------------------ router core
class _Obs(RouterObserver):
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def decision(self, group: str, replica_id: str, predicted_blocks: int) -> None:
        self.log.append(("decision", replica_id, predicted_blocks))

    def resync(self, group: str, replica_id: str) -> None:
        self.log.append(("resync", replica_id))

    def removed(self, group: str, replica_id: str) -> None:
        self.log.append(("removed", replica_id))


def _batch(rid: str, seq: int, epoch: str, stored: list[bytes]) -> dict[str, Any]:
    from kvpage.routing.events import BlockStored, KVEventBatch

    return KVEventBatch(rid, seq, 0.0, (BlockStored(tuple(stored)),), epoch).to_dict()


def _snap(rid: str, seq: int, epoch: str, held: list[bytes]) -> dict[str, Any]:
    from kvpage.routing.events import KVSnapshot

    return KVSnapshot(rid, seq, frozenset(held), epoch).to_dict()


def test_router_core_uses_the_engine_keys_with_the_scoped_salt() -> None:
    obs = _Obs()
    core = RouterCore("default", "kv_precise", block_size=4, observer=obs)
    core.set_replicas(["a", "b"])
    tenant = unauthenticated_tenant("key-1", None)
    salt = scoped_cache_salt("tenant", tenant, None)  # the server's own function
    prompt = list(range(1, 18))
    keys = hash_request_blocks(prompt, 4, cache_salt=salt)
    # replica b holds the first 3 blocks of exactly this tenant's keys
    assert core.apply_report({"replica_id": "b", "batches": []}) is False  # never synced
    core.resync(_snap("b", 0, "e", keys[:3]))
    core.resync(_snap("a", 0, "e", []))
    route = {"prompt_token_ids": prompt, "cache_salt": salt}
    assert core.choose("r1", route, ["a", "b"]) == "b"
    core.routed("r1", "b")
    assert ("decision", "b", 3) in obs.log
    # another tenant's salt: no hit anywhere (keys differ)
    other = scoped_cache_salt("tenant", unauthenticated_tenant("key-2", None), None)
    core.choose("r2", {"prompt_token_ids": prompt, "cache_salt": other}, ["a", "b"])
    core.routed("r2", "a")
    assert ("decision", "a", 0) in obs.log
    assert core.finished("r1") is not None and core.in_flight["b"] == 0


def test_router_core_gap_resync_and_dead_replica() -> None:
    obs = _Obs()
    core = RouterCore("g", "kv_precise", block_size=4, observer=obs)
    core.set_replicas(["a"])
    core.resync(_snap("a", 0, "e1", []))
    h = [bytes([i]) * 32 for i in range(4)]
    assert core.apply_report({"replica_id": "a", "batches": [_batch("a", 1, "e1", h[:1])]})
    assert core.index.num_blocks("a") == 1
    # seq 3 after 1: a gap -> resync needed, the stale view is not used silently
    assert not core.apply_report({"replica_id": "a", "batches": [_batch("a", 3, "e1", h[1:2])]})
    core.resync(_snap("a", 3, "e1", h[:2]))
    assert core.index.num_blocks("a") == 2
    # a restarted replica (new epoch) -> resync
    assert not core.apply_report({"replica_id": "a", "batches": [_batch("a", 1, "e2", h[:1])]})
    # the replica dies: its view goes at once, reports arriving later are ignored
    core.set_replicas([])
    assert "a" not in core.index and ("removed", "a") in obs.log
    assert core.apply_report({"replica_id": "a", "batches": [_batch("a", 4, "e1", h)]})
    assert "a" not in core.index


# ------------------------------------------------------------------ ingress engine loop
class _Out:
    def __init__(self, n: int, finished: bool) -> None:
        self.finished = finished
        self.num_cached_tokens = 8
        self.arrival_time = 100.0
        self.first_scheduled_time = 100.5
        self.first_token_time = None
        self.finish_time = None
        self.outputs: list[Any] = []
        self.n = n


class _Stream:
    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        x = self.items.pop(0)
        if isinstance(x, BaseException):
            raise x
        return x

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """A deployment handle whose replicas follow a script: replica id -> items."""

    def __init__(self, core: RouterCore, script: dict[str, list[Any]]) -> None:
        self.core, self.script, self.calls = core, script, []
        self.generate = self

    def options(self, **kw: Any) -> _Handle:
        return self

    def remote(
        self, rid: str, prompt: Any, params: Any, route: dict[str, Any], priority: int = 0
    ) -> _Stream:
        ids = [r for r in sorted(self.script) if r not in route["exclude"]]
        choice = self.core.choose(rid, route, ids)
        self.core.routed(rid, choice)
        self.calls.append((choice, list(route["exclude"])))
        return _Stream(self.script[choice])


class _LoopObs:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *a: self.events.append((name, *a))


def _loop(script: dict[str, list[Any]]) -> tuple[RemoteEngineLoop, _Handle, _LoopObs]:
    core = RouterCore("default", "round_robin", block_size=4)
    core.set_replicas(script)
    h = _Handle(core, script)
    obs = _LoopObs()
    loop = RemoteEngineLoop(
        {"default": ReplicaGroup("default", h, core, 4)},
        GroupSelector(frozenset({"default"})),
        obs,
    )
    return loop, h, obs


async def _drain(q: asyncio.Queue[Any]) -> list[Any]:
    got = []
    while True:
        x = await asyncio.wait_for(q.get(), 5)
        got.append(x)
        if isinstance(x, EngineFailure) or x.finished:
            return got


def test_remote_loop_streams_and_records_hits() -> None:
    async def main() -> None:
        loop, h, obs = _loop({"a": [_Out(1, False), _Out(2, True)]})
        loop.start(asyncio.get_running_loop())
        q = await loop.add("r1", [1, 2, 3], None, arrival_time=5.0)
        got = await _drain(q)
        assert [g.finished for g in got] == [False, True]
        assert got[0].arrival_time == 5.0 and got[0].first_scheduled_time == 5.5
        assert ("hits", "default", 0, 2) in obs.events  # 8 cached tokens / block 4
        assert h.core.in_flight == {"a": 0}

    asyncio.run(main())


def test_remote_loop_retries_once_before_the_first_output() -> None:
    async def main() -> None:
        dead = RuntimeError("ActorDiedError: the actor died")
        loop, h, obs = _loop({"a": [dead], "b": [_Out(1, True)]})
        loop.start(asyncio.get_running_loop())
        q = await loop.add("r1", [1, 2, 3], None)
        assert (await _drain(q))[-1].finished
        assert h.calls == [("a", []), ("b", ["a"])]  # never back to the failed replica
        assert ("retry", "default") in obs.events

    asyncio.run(main())


def test_remote_loop_gives_up_after_one_retry_with_503() -> None:
    async def main() -> None:
        loop, h, obs = _loop({"a": [RuntimeError("x")], "b": [RuntimeError("y")]})
        loop.start(asyncio.get_running_loop())
        with pytest.raises(APIError) as ei:
            await loop.add("r1", [1, 2, 3], None)
        assert ei.value.status == 503 and ei.value.code == "replica_unavailable"
        assert len(h.calls) == 2

    asyncio.run(main())


def test_remote_loop_failure_after_first_output_ends_the_stream() -> None:
    async def main() -> None:
        loop, h, obs = _loop({"a": [_Out(1, False), RuntimeError("boom")], "b": []})
        loop.start(asyncio.get_running_loop())
        q = await loop.add("r1", [1, 2, 3], None)
        got = await _drain(q)
        assert isinstance(got[-1], EngineFailure)
        assert "replica a of group default failed" in str(got[-1])
        assert len(h.calls) == 1  # a started request is not run twice

    asyncio.run(main())


def test_remote_loop_retries_a_non_streamed_request_after_outputs() -> None:
    """Issue 23: a non-streamed request whose replica died after producing outputs got
    a 500 although its client had received nothing; it is run again elsewhere."""

    async def main() -> None:
        died = RuntimeError("ActorDiedError: killed")
        loop, h, obs = _loop({"a": [_Out(1, False), died], "b": [_Out(2, True)]})
        loop.start(asyncio.get_running_loop())
        q = await loop.add("r1", [1, 2, 3], None, replayable=True)
        got = await _drain(q)
        assert [g.finished for g in got] == [False, True]  # a's partial output, then b's
        assert h.calls == [("a", []), ("b", ["a"])]
        assert ("retry", "default") in obs.events
        assert loop.take_placement("r1") == {"group": "default", "replica": "b"}

    asyncio.run(main())


def test_remote_loop_passes_engine_refusals_and_aborts() -> None:
    async def main() -> None:
        loop, h, obs = _loop({"a": [{"rejected": "x: expected y", "reason": "queue_full"}]})
        loop.start(asyncio.get_running_loop())
        with pytest.raises(RequestRejected) as ei:
            await loop.add("r1", [1], None)
        assert ei.value.reason == "queue_full"
        loop2, h2, _ = _loop({"a": [_Out(1, False)]})  # never finishes
        loop2.start(asyncio.get_running_loop())
        q = await loop2.add("r2", [1], None)
        assert not q.get_nowait().finished
        await loop2.abort("r2")
        assert "r2" not in loop2._tasks and h2.core.in_flight == {"a": 0}
        loop2.stop()
        with pytest.raises(RuntimeError):
            await loop2.add("r3", [1], None)

    asyncio.run(main())


def test_ingress_reconfigure_sets_the_canary_share() -> None:
    from kvpage.cluster.ingress import Ingress

    cfg = ClusterConfig.model_validate(
        {"groups": {"default": {}, "canary": {"replicas": 1, "traffic_fraction": 0.1}}}
    )
    ing = Ingress(cfg, default=object(), canary=object())
    assert ing.selector.canary_fraction == 0.1
    ing.reconfigure({"canary_fraction": 0.5})  # Ray Serve user_config, applied in place
    assert ing.selector.canary_fraction == 0.5
    ing.reconfigure({"canary_fraction": 0})  # roll back
    assert ing.selector.canary_fraction == 0.0
    with pytest.raises(ValueError, match="traffic_fraction"):
        ing.reconfigure({"canary_fraction": 1.5})
    only = Ingress(ClusterConfig(), default=object())
    with pytest.raises(ValueError, match="without a canary group"):
        only.set_canary(0.2)
    only.set_canary(0.0)


def test_remote_loop_fails_a_request_instead_of_hanging_on_an_ingress_bug() -> None:
    async def main() -> None:
        loop, h, _ = _loop({"a": [_Out(1, True)]})

        def broken(*a: Any, **k: Any) -> Any:
            raise TypeError("unexpected keyword argument")

        h.remote = broken  # type: ignore[method-assign]
        loop.start(asyncio.get_running_loop())
        with pytest.raises(APIError) as ei:
            await asyncio.wait_for(loop.add("r1", [1, 2, 3], None), 5)
        assert ei.value.status == 503 and "TypeError" in ei.value.message

    asyncio.run(main())


def test_new_user_refusals_of_the_cluster_cli(tmp_path: Any, capsys: Any) -> None:
    from kvpage.cluster.cli import serve_entry
    from kvpage.cluster.launch import check_cpus_fit

    # the server section's engine would be ignored (each group has its own): refused
    f = tmp_path / "d.yaml"
    f.write_text("server: {engine: {block_size: 32}}\ngroups: {default: {}}\n")
    with pytest.raises(SpecError, match=r"server.engine: expected no engine section"):
        load_cluster_config(f)
    # the dump has no server.engine, so it loads back
    assert serve_entry(_serve_args(["--replicas", "1", "--dump-config"])) == 0
    assert "engine" not in yaml.safe_load(capsys.readouterr().out)["server"]
    # whole-model rules are one line, without the whole config echoed
    f.write_text("groups: {default: {}, canary: {replicas: 1}}\n")
    with pytest.raises(SpecError) as ei:
        load_cluster_config(f)
    assert "traffic_fraction" in str(ei.value) and "'groups':" not in str(ei.value)
    # options the scaled-out server cannot honour are refused by name, not ignored
    for flags, said in (
        (["--metrics-port", "9100"], "--metrics-port: expected none with --replicas"),
        (["--engine-process"], "--engine-process: expected off with --replicas"),
    ):
        assert serve_entry(_serve_args(["--replicas", "2", *flags])) == 2
        assert said in capsys.readouterr().err
    # replicas the in-process Ray could never place are refused before Serve waits forever
    cfg = cluster_config_from_args(_serve_args(["--replicas", "2"]))
    check_cpus_fit(cfg, 64.0)
    with pytest.raises(SpecError, match=r"expected replicas needing <= 0.5 CPUs"):
        check_cpus_fit(cfg, 0.5)
    big = ClusterConfig.model_validate({"groups": {"default": {"num_cpus": 64}}})
    with pytest.raises(SpecError, match=r"groups.default.num_cpus: expected <= 2"):
        check_cpus_fit(big, 2.0)


def test_a_disk_tier_directory_is_not_shared_by_replicas(tmp_path: Any) -> None:
    flags = ["--kv-disk-tier-bytes", "100000000", "--kv-disk-tier-path", str(tmp_path)]
    with pytest.raises(SpecError, match=r"kv_disk_tier_path: expected a directory used by one"):
        cluster_config_from_args(_serve_args(["--replicas", "2", *flags]))
    cfg = cluster_config_from_args(_serve_args(["--replicas", "1", *flags]))
    assert cfg.groups["default"].engine.kv_disk_tier_path == str(tmp_path)
