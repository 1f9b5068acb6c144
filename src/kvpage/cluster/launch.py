"""Starting Ray, deploying the scaled-out server, stopping it.

:func:`build_app` turns a :class:`~kvpage.cluster.config.ClusterConfig` into a Ray
Serve application: one deployment per replica group (``engine-<group>``, the
:class:`~kvpage.cluster.replica.EngineReplica` class, ``num_replicas`` and a fractional
``num_cpus`` from the file, the :class:`~kvpage.cluster.router.KVAwareRouter` as its
request router) and the ``ingress`` deployment (one replica) that holds their handles.
:func:`start` initialises Ray (in-process, or joining ``ray_address``), starts Serve's
HTTP proxy on the configured host/port and deploys; :func:`stop` tears both down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvpage.cluster.config import ClusterConfig, check_cpus_fit
from kvpage.cluster.ingress import Ingress, core_key
from kvpage.cluster.replica import EngineReplica

__all__ = ["build_app", "run_forever", "start", "stop"]

logger = logging.getLogger("kvpage.cluster")

ROUTER_CLASS = "kvpage.cluster.router.KVAwareRouter"


def build_app(cfg: ClusterConfig) -> Any:
    """The Ray Serve application (a bound ingress deployment) of ``cfg``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    deployment: Any = serve.deployment  # (Ray's annotations of these are too narrow)
    router_config: Any = RequestRouterConfig
    bound: dict[str, Any] = {}
    for name, g in cfg.groups.items():
        if g.replicas < 1:
            continue  # a canary group scaled to zero (traffic_fraction 0)
        dep = deployment(
            EngineReplica,
            name=f"engine-{name}",
            num_replicas=g.replicas,
            ray_actor_options={"num_cpus": g.num_cpus},
            max_ongoing_requests=g.max_ongoing_requests,
            graceful_shutdown_timeout_s=5.0,
            # no per-call access log: the ingress polls kv_events about 10 times a second
            logging_config={"enable_access_log": False},
            request_router_config=router_config(
                request_router_class=ROUTER_CLASS,
                request_router_kwargs={"core": core_key(cfg.app_name, name)},
            ),
        )
        bound[name] = dep.bind(name, g.engine.engine_kwargs())
    ingress = deployment(
        serve.ingress()(Ingress),
        name="ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus},
        max_ongoing_requests=4096,  # admission is the ingress's own (ServingState)
        graceful_shutdown_timeout_s=10.0,
        user_config={"canary_fraction": cfg.canary_fraction},
    )
    return ingress.bind(cfg, **bound)


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """While ``ray.init`` runs, keep the process's SIGTERM handler.

    ``ray.init`` begins by installing a handler that exits at once (``sys.exit``),
    *before* it starts the local node's processes; a SIGTERM in that window killed the
    driver with half a node started and Ray's DashboardAgent and RuntimeEnvAgent were
    left running (no ``_global_node`` yet, so ``ray.shutdown`` cannot reach them). Ray
    2.60 installs it through ``ray._private.utils.set_sigterm_handler`` (a private hook,
    so: only when it exists, and only for the duration of the call)."""
    try:
        from ray._private import utils as ray_utils
    except ImportError:  # pragma: no cover - another Ray layout: plain ray.init
        yield
        return
    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:  # pragma: no cover
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def start(
    cfg: ClusterConfig,
    *,
    ray_init_kwargs: dict[str, Any] | None = None,
    on_ray_started: Callable[[], None] | None = None,
) -> str:
    """Start (or join) Ray, start Serve's HTTP proxy and deploy ``cfg``; blocks until
    every replica is up. Returns the base URL. With ``on_ray_started`` (a caller that
    handles signals itself) the process's SIGTERM handler is kept while ``ray.init``
    runs and ``on_ray_started`` runs right after it (Ray replaces the handler again
    when it connects); it may raise to stop the start (then nothing is deployed).

    Raises:
        SpecError: an unauthenticated server asked to bind a non-loopback address
            (the single server's rule, :func:`kvpage.server.security.check_bind`), or
            replicas that need more CPUs than the in-process Ray has
            (:func:`check_cpus_fit`).
    """
    import ray
    from ray import serve

    from kvpage.server.resolved import warn_if_elsewhere
    from kvpage.server.security import check_bind

    check_bind(cfg.server, cfg.server.security.auth_enabled)
    warn_if_elsewhere(cfg.server, "deployment")
    if cfg.ray_address is None and not ray.is_initialized():
        # before starting Ray (the CPUs it will be given), and again once it runs
        have = (ray_init_kwargs or {}).get("num_cpus") or os.cpu_count() or 1
        check_cpus_fit(cfg, float(have))
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if cfg.ray_address is None:
            # "local": always a new in-process instance; without it ray.init joins
            # RAY_ADDRESS or the last `ray start` cluster of this machine (and then
            # refuses num_cpus), which --replicas without --ray-address never means
            kwargs["address"] = "local"
            kwargs["num_cpus"] = os.cpu_count()
        else:
            kwargs["address"] = cfg.ray_address
        kwargs.update(ray_init_kwargs or {})
        with _keep_sigterm_handler() if on_ray_started is not None else contextlib.nullcontext():
            ray.init(**kwargs)
        if on_ray_started is not None:
            on_ray_started()
    if cfg.ray_address is None:
        check_cpus_fit(cfg, float(ray.cluster_resources().get("CPU", 0.0)))
    serve.start(
        proxy_location="HeadOnly",
        http_options={
            "host": cfg.server.host,
            "port": cfg.server.port,
            "keep_alive_timeout_s": cfg.server.security.keep_alive_timeout_s,
        },
    )
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix="/")
    return f"http://{cfg.server.host}:{cfg.server.port}"


def stop(cfg: ClusterConfig | None = None) -> None:
    """Remove the deployment and disconnect: with an in-process Ray (``ray_address``
    None) Serve and Ray are shut down; on a joined cluster only this application is
    deleted (other applications and the cluster keep running)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if cfg is None or cfg.ray_address is None:
            # a start cut short inside ray.init (e.g. SIGTERM: Ray's own handler exits)
            # may have started the local node's processes already: stop them too
            ray.shutdown()
        return
    try:
        if cfg is not None and cfg.ray_address is not None:
            serve.delete(cfg.app_name)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


class _StopDuringStart(Exception):
    """SIGINT/SIGTERM arrived while ``ray.init`` ran: stop before deploying."""


def run_forever(cfg: ClusterConfig) -> None:
    """``kvpage serve --replicas/--ray-address/--deployment``: start, serve until
    SIGINT/SIGTERM, stop."""
    done = threading.Event()

    def on_signal(*_: object) -> None:
        done.set()

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    def after_ray_init() -> None:
        install()
        if done.is_set():
            raise _StopDuringStart

    install()
    # ray.init installs its own SIGTERM handler (exit at once, without shutting Serve and
    # Ray down, leaving Ray's agents behind): start() keeps ours while ray.init runs and
    # we install ours again right after it, so SIGTERM (what systemd, Docker and
    # Kubernetes send) stops as cleanly as Ctrl-C, even mid-start
    try:
        url = start(cfg, on_ray_started=after_ray_init)
    except _StopDuringStart:
        logger.info("kvpage serve: stop signal received while Ray started; shutting down")
        stop(cfg)
        return
    except BaseException:
        stop(cfg)  # a failed deploy: take down what was started
        raise
    if done.is_set():  # SIGINT/SIGTERM arrived while deploying: do not announce
        logger.info("kvpage serve: stop signal received during start-up; shutting down")
    else:
        logger.info(
            "kvpage serve: %d engine replica(s) in group(s) %s behind %s (router %s)",
            cfg.num_replicas(),
            ", ".join(sorted(cfg.groups)),
            url,
            cfg.router.policy,
        )
    try:
        done.wait()
    finally:
        stop(cfg)
