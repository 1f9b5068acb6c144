"""The ingress deployment: the single server's HTTP app over replica groups.

:class:`Ingress` is wrapped by :func:`kvpage.cluster.launch.build_app` as a Ray Serve
ingress deployment (``serve.ingress()`` with ``__serve_build_asgi_app__``). It builds
the app with :func:`kvpage.server.app.create_app` -- the same routes, validation,
authentication, admission, error bodies and streaming as ``kvpage serve`` -- around a
:class:`ClusterState`, whose engine loop (:class:`~kvpage.cluster.remote.
RemoteEngineLoop`) sends each admitted request to a replica. A request refused at the
ingress never reaches a replica.

It also runs the KV event pump (:class:`KVEventPump`: pulls every replica's event
batches, load and metrics, resyncs views from snapshots) and adds two admin routes for
the canary share: ``GET /admin/canary`` and ``POST /admin/canary`` with
``{"traffic_fraction": f}`` (0 rolls back). With API keys these need an operator key
(as ``/metrics``). The share can also be set through Ray Serve's ``user_config``
(``{"canary_fraction": f}``, applied by :meth:`Ingress.reconfigure` without restarting
anything). Either way requests in flight finish where they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpage.cluster.config import ClusterConfig
from kvpage.cluster.core import CORES, RouterCore
from kvpage.cluster.metrics import ClusterMetrics
from kvpage.cluster.remote import GroupSelector, RemoteEngineLoop, ReplicaGroup
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server.config import EngineConfig, ServerConfig
from kvpage.server.engine_client import EngineClient, ServedEngine
from kvpage.server.service import ServingState

__all__ = ["ClusterState", "EngineFacade", "Ingress", "KVEventPump", "core_key"]

logger = logging.getLogger("kvpage.cluster")


def core_key(app_name: str, group: str) -> str:
    """Key of a group's :class:`RouterCore` in :data:`kvpage.cluster.core.CORES`."""
    return f"{app_name}/{group}"


@dataclass(frozen=True)
class _FacadeCacheSpec:
    """The replicas' cache facts (``ServedCacheSpec``): ``num_blocks`` of all of them."""

    block_size: int
    num_blocks: int
    kv_dtype: str
    total_bytes: int


@dataclass(frozen=True)
class _FacadeScheduler:
    """The ingress's limits (``ServedScheduler``): the largest group's ``max_model_len``
    (every request that fits it is routed to a group it fits); the policy configured."""

    max_model_len: int
    max_servable_len: int
    policy: str


class EngineFacade:
    """What :class:`ServingState` reads of an engine
    (:class:`~kvpage.server.engine_client.ServedEngine`), from a replica's ``info()``.

    Args:
        info: the default group's replica ``info()`` (``kvpage.cluster.replica``).
        num_blocks: the blocks of every replica of every group.
        max_model_len: the largest group's ``max_model_len``.
        policy: the configured scheduling policy.
    """

    def __init__(
        self, info: Mapping[str, Any], num_blocks: int, max_model_len: int, policy: str
    ) -> None:
        self.tokenizer: Tokenizer | None = info["tokenizer"]
        self.default_sampling_params: dict[str, Any] = dict(
            info.get("default_sampling_params") or {}
        )
        gen_path = info.get("generation_config_path")
        self.generation_config_path = None if gen_path is None else str(gen_path)
        self.backend_name = str(info["backend_name"])
        self.cache_spec = _FacadeCacheSpec(
            int(info["block_size"]), num_blocks, str(info["kv_dtype"]), int(info["total_bytes"])
        )
        self.scheduler = _FacadeScheduler(max_model_len, max_model_len, policy)

    def get_metrics(self) -> dict[str, float]:
        """Nothing: each replica's metrics are exported, labelled (``ClusterMetrics``)."""
        return {}


if TYPE_CHECKING:  # mypy proves the facade is a ServedEngine

    def _facade_is_served(facade: EngineFacade) -> ServedEngine:
        return facade


class ClusterState(ServingState):
    """The ingress's serving state: a :class:`ServingState` whose engine loop is a
    :class:`RemoteEngineLoop`.

    The admission KV budget counts the blocks of every replica of every group (a
    cluster-wide upper bound); ``max_model_len`` is the largest of the groups: a
    request too long (or with ``n`` too large) for the group the rules choose is sent
    to a group that can take it (:meth:`GroupSelector.route
    <kvpage.cluster.remote.GroupSelector.route>`).
    """

    export_engine_snapshot = False  # each replica's metrics are exported, labelled
    placement_labels = ("group", "replica")

    def __init__(
        self,
        config: ServerConfig,
        facade: EngineFacade,
        loop: RemoteEngineLoop,
        infos: dict[str, dict[str, Any]] | None = None,
        replicas: dict[str, int] | None = None,
        cluster: ClusterConfig | None = None,
    ) -> None:
        from kvpage.engine import SamplingParams

        #: group -> the ``info()`` of one of its replicas; group -> replica count
        self.group_infos = dict(infos or {})
        self.group_replicas = dict(replicas or {})
        #: the deployment this ingress runs (``/admin/config``)
        self.cluster = cluster
        self._remote_loop = loop  # ServingState.__init__ takes it (_engine_client)
        super().__init__(config, facade, SamplingParams)

    def _engine_client(self, engine: ServedEngine) -> EngineClient:
        """The replicas' :class:`RemoteEngineLoop` (``engine`` is the facade): the loop
        the serving state and its ``RequestGenerator`` share."""
        return self._remote_loop

    def effective_config(self) -> dict[str, Any]:
        """``GET /admin/config``: the running deployment as a deployment file (the
        ingress's server section, the router, each group with the engine its replicas
        resolved and the canary share in effect now), the ingress's and each group's
        machine facts."""
        from kvpage.cluster.config import cluster_config_data
        from kvpage.server.resolved import machine_facts

        if self.cluster is None:
            return super().effective_config()
        groups: dict[str, Any] = {str(k): v for k, v in self.cluster.groups.items()}
        for name, info in self.group_infos.items():
            if "engine_config" in info and name in groups:
                engine = EngineConfig.model_validate(info["engine_config"])
                groups[name] = groups[name].model_copy(update={"engine": engine})
        selector = getattr(self.loop, "selector", None)
        if "canary" in groups and selector is not None:
            groups["canary"] = groups["canary"].model_copy(
                update={"traffic_fraction": selector.canary_fraction}
            )
        here = machine_facts()
        cfg = self.cluster.model_copy(
            update={
                "groups": groups,
                "server": self.cluster.server.model_copy(update={"resolved_on": here}),
            }
        )
        machines: dict[str, Any] = {"ingress": here}
        for name, info in sorted(self.group_infos.items()):
            if "machine" in info:
                machines[name] = info["machine"]
        return {"config": cluster_config_data(cfg), "machines": machines}

    def export_cache_config(self) -> None:
        """One ``kvpage:cache_config`` series per group (its own block size, blocks per
        replica, replicas, kv dtype, backend, max_model_len) and
        ``kvpage:group_kv_cache_blocks{group}``: the blocks of all its replicas."""
        from prometheus_client import Gauge

        blocks = Gauge(
            "kvpage:group_kv_cache_blocks",
            "KV cache blocks of each replica group (blocks per replica x replicas, each "
            "pool's reserved null block included)",
            ["group"],
            registry=self.metrics.registry,
        )
        for name, info in sorted(self.group_infos.items()):
            n = self.group_replicas.get(name, 1)
            self.metrics.cache_config.labels(group=name).info(
                {
                    "block_size": str(info["block_size"]),
                    "num_blocks": str(info["num_blocks"]),
                    "replicas": str(n),
                    "kv_dtype": str(info.get("kv_dtype", "auto")),
                    "backend": str(info.get("backend_name", "unknown")),
                    "max_model_len": str(info.get("max_model_len", "")),
                    "model": self.config.model_name,
                }
            )
            blocks.labels(group=name).set(float(info["num_blocks"]) * n)


class KVEventPump:
    """Pulls every replica's KV events (every ``poll_s``, and at once after a request's
    first output on it) and resyncs views that need it.

    Args:
        groups: the replica groups.
        metrics: keeps each replica's engine metrics.
        loop: the ingress engine loop (its ``metrics_snapshot`` gets the summed counters).
        poll_s: pull period in seconds.
        timeout_s: bound of each pull.
    """

    def __init__(
        self,
        groups: dict[str, ReplicaGroup],
        metrics: ClusterMetrics,
        loop: RemoteEngineLoop,
        poll_s: float,
        timeout_s: float,
    ) -> None:
        self.groups = groups
        self.metrics = metrics
        self.loop = loop
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start pulling (on the running event loop)."""
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop pulling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def wake(self, group: str = "", replica_id: str = "") -> None:
        """Pull now (a request's first output: its prompt blocks were just stored)."""
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()
            await self.pull_all()

    async def pull_all(self) -> None:
        """One round: pull every known replica of every group (concurrently)."""
        jobs = [self._pull(g, rid) for g in self.groups.values() for rid in sorted(g.core.replicas)]
        if jobs:
            await asyncio.gather(*jobs)
        self.loop.metrics_snapshot = self.metrics.summed_counters()

    async def _call(self, g: ReplicaGroup, method: str, rid: str) -> Any:
        resp = getattr(g.handle, method).remote(route={"target": rid})
        try:
            return await asyncio.wait_for(resp, self.timeout_s)
        except BaseException:
            resp.cancel()
            raise

    async def _pull(self, g: ReplicaGroup, rid: str) -> None:
        try:
            report = await self._call(g, "kv_events", rid)
            src = str(report["replica_id"])  # the replica that answered (see router)
            if src not in g.core.replicas:
                return  # gone, or not announced yet: a later gap brings a resync
            self.metrics.set_report(g.name, src, report.get("metrics") or {})
            if not g.core.apply_report(report):
                g.core.resync(await self._call(g, "kv_snapshot", src))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead replica: Serve's router drops it
            logger.info("kvpage ingress: KV event pull from %s failed (%r)", rid, exc)


class Ingress:
    """The ingress deployment's user class (see module doc).

    Args:
        config: the deployment's configuration.
        groups: group name -> the group's deployment handle (Ray Serve resolves the
            bound deployments passed by :func:`kvpage.cluster.launch.build_app`).
    """

    def __init__(self, config: ClusterConfig, **groups: Any) -> None:
        self.config = config
        self.handles = groups
        self.selector = GroupSelector(
            frozenset(groups),
            config.long_context_threshold,
            config.canary_fraction,
            seed=config.router.seed,
        )
        self.state: ClusterState | None = None
        self.pump: KVEventPump | None = None

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve ``user_config``: ``{"canary_fraction": f}`` sets the canary share."""
        if user_config and "canary_fraction" in user_config:
            self.set_canary(float(user_config["canary_fraction"]))

    def set_canary(self, fraction: float) -> None:
        """Send ``fraction`` of the (non-long-context) requests to the canary group.

        Raises:
            ValueError: ``fraction`` outside [0, 1], or > 0 without a canary group.
        """
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"traffic_fraction: expected a number in [0, 1], got {fraction}")
        if fraction > 0.0 and "canary" not in self.handles:
            raise ValueError(f"traffic_fraction: expected 0 without a canary group, got {fraction}")
        self.selector.canary_fraction = fraction
        if self.state is not None:
            metrics = getattr(self.state, "cluster_metrics", None)
            if metrics is not None:
                metrics.canary.set(fraction)
        logger.info("kvpage ingress: canary traffic fraction now %g", fraction)

    async def __serve_build_asgi_app__(self) -> Any:
        """Serve's hook: the ingress app (the OpenAI server over the replica groups),
        in named steps: router cores, the replicas' facts, the engine loop and state,
        the cluster metrics, the KV event pump."""
        from kvpage.cluster.admin import register_admin_routes
        from kvpage.server.app import create_app

        cfg = self.config
        groups = self._router_groups()
        infos = await self._replica_infos(groups)
        replicas: dict[str, int] = {k: v.replicas for k, v in cfg.groups.items()}
        total_blocks = sum(int(infos[n]["num_blocks"]) * replicas[n] for n in self.handles)
        max_len = max(int(i["max_model_len"]) for i in infos.values())
        policy = cfg.groups["default"].engine.scheduling_policy
        facade = EngineFacade(infos["default"], total_blocks, max_len, policy)
        pump_ref: list[KVEventPump] = []
        loop = RemoteEngineLoop(
            groups,
            self.selector,
            observer=None,
            on_first_output=lambda g, r: pump_ref[0].wake(g, r) if pump_ref else None,
        )
        server_cfg = cfg.server.model_copy(deep=True)
        server_cfg.engine = cfg.groups["default"].engine
        state = ClusterState(
            server_cfg, facade, loop, infos, {n: replicas[n] for n in self.handles}, cfg
        )
        metrics = self._cluster_metrics(state, groups, loop, server_cfg.model_name)
        pump = KVEventPump(
            groups, metrics, loop, cfg.router.kv_event_poll_s, cfg.router.replica_call_timeout_s
        )
        pump_ref.append(pump)
        self.state, self.pump = state, pump
        app = create_app(server_cfg, state=state)
        register_admin_routes(app, state, self)
        pump.start()
        return app

    def _router_groups(self) -> dict[str, ReplicaGroup]:
        """One ``RouterCore`` per replica group, registered in ``CORES`` before the
        first call through the group's handle (the group's Serve router, created by
        that call in this process, then finds its core at once)."""
        cfg = self.config
        groups: dict[str, ReplicaGroup] = {}
        engines: dict[str, Any] = {k: v.engine for k, v in cfg.groups.items()}
        for name, h in self.handles.items():
            core = RouterCore(
                group=name,
                policy=cfg.router.policy,
                block_size=engines[name].block_size,
                seed=cfg.router.seed,
            )
            CORES[core_key(cfg.app_name, name)] = core
            groups[name] = ReplicaGroup(name, h, core, core.block_size)
        return groups

    async def _replica_infos(self, groups: dict[str, ReplicaGroup]) -> dict[str, Any]:
        """Each group's engine facts (``info`` of one replica: block size, hash seed,
        num_blocks, max_model_len, ...), applied to its router core and the group
        selector's limits (every request that fits the largest group is routed to a
        group it fits, so the largest max_model_len is a true promise)."""
        infos: dict[str, Any] = {}
        for name, h in self.handles.items():
            infos[name] = await h.info.remote(route=None)
            core = groups[name].core
            core.block_size = groups[name].block_size = int(infos[name]["block_size"])
            core.hash_seed = int(infos[name]["hash_seed"])
        self.selector.limits = {
            n: (int(i["max_model_len"]), int(i.get("max_num_seqs", 1 << 30)))
            for n, i in infos.items()
        }
        return infos

    def _cluster_metrics(
        self,
        state: ClusterState,
        groups: dict[str, ReplicaGroup],
        loop: RemoteEngineLoop,
        model_name: str,
    ) -> ClusterMetrics:
        """The cluster metrics in the server's registry, observing the engine loop and
        every router core."""
        metrics = ClusterMetrics(
            state.metrics.registry,
            self.config.router.policy,
            model_name,
            lambda: {
                (g.name, rid): n for g in groups.values() for rid, n in g.core.view_sizes().items()
            },
        )
        loop.observer = metrics
        for g in groups.values():
            g.core.observer = metrics
        state.cluster_metrics = metrics  # type: ignore[attr-defined]
        metrics.canary.set(self.selector.canary_fraction)
        return metrics
