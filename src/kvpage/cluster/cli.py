"""``kvpage serve`` with replicas: the cluster flags (imports no Ray until it runs).

:func:`add_serve_parser` registers ``kvpage serve`` as :mod:`kvpage.server.cli` does
and adds ``--replicas N``, ``--ray-address ADDR``, ``--router POLICY`` and
``--deployment FILE``. Without any of them ``kvpage serve`` is the single server,
unchanged, and Ray is never imported. With one of them the effective
:class:`~kvpage.cluster.config.ClusterConfig` is built as: the deployment file (or the
defaults: one ``default`` group), its ``server`` section overridden by ``--config`` and
the server flags, the engine flags applied to the ``default`` group's engine, then
``--replicas`` (the default group's count), ``--router`` and ``--ray-address``.
``--dump-config`` prints that deployment file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvpage.cluster.config import (
    POLICIES,
    ClusterConfig,
    GroupConfig,
    check_cpus_fit,
    dump_cluster_config,
    load_cluster_config,
)
from kvpage.errors import KVPageError, SpecError
from kvpage.server import cli as server_cli

__all__ = ["add_serve_parser", "cluster_config_from_args", "wants_cluster"]


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``kvpage serve`` with the cluster flags (see module doc)."""
    p = server_cli.add_serve_parser(subparsers)
    g = p.add_argument_group("scale-out (Ray Serve; needs the 'cluster' extra)")
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N engine replicas on Ray Serve (starts Ray in-process unless --ray-address)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (e.g. 'auto' or 'ray://head:10001') instead of starting one",
    )
    g.add_argument(
        "--router",
        choices=POLICIES,
        default=None,
        help="request router policy of every replica group (default kv_precise)",
    )
    g.add_argument(
        "--deployment",
        metavar="FILE",
        default=None,
        help="YAML/JSON deployment file: replica groups, router, canary (see --dump-config)",
    )
    p.set_defaults(func=serve_entry)
    return p


def wants_cluster(args: argparse.Namespace) -> bool:
    """Whether any cluster flag was given."""
    return any(
        getattr(args, k, None) is not None
        for k in ("replicas", "ray_address", "router", "deployment")
    )


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The effective :class:`ClusterConfig` (see module doc).

    Raises:
        SpecError: an invalid file, flag or combination, named.
    """
    dep = load_cluster_config(args.deployment) if args.deployment else ClusterConfig()
    base = dep.server.model_copy(update={"engine": dep.groups["default"].engine})
    server = server_cli.config_from_args(args, base=base)
    if args.replicas is not None and args.replicas < 1:
        raise SpecError(f"--replicas: expected >= 1, got {args.replicas}")
    if server.security.metrics_port is not None:
        raise SpecError(
            "--metrics-port: expected none with --replicas/--deployment (the ingress serves "
            f"/metrics on the API port, with every replica's metrics), got {server.security.metrics_port}"
        )
    if server.engine_process:
        raise SpecError(
            "--engine-process: expected off with --replicas/--deployment (each replica is "
            "already its own Ray actor process), got on"
        )
    groups = dict(dep.groups)
    default = groups["default"]
    groups["default"] = GroupConfig(
        **{
            **{k: getattr(default, k) for k in type(default).model_fields},
            "engine": server.engine,
            "replicas": args.replicas if args.replicas is not None else default.replicas,
        }
    )
    router = dep.router
    if args.router is not None:
        router = router.model_copy(update={"policy": args.router})
    paths: dict[str, str] = {}
    for name, g in groups.items():
        e = g.engine
        if not (e.kv_disk_tier_bytes and e.kv_disk_tier_path):
            continue
        if g.replicas > 1 or e.kv_disk_tier_path in paths:
            other = paths.get(e.kv_disk_tier_path, name)
            raise SpecError(
                f"groups.{name}.engine.kv_disk_tier_path: expected a directory used by one "
                f"replica (replicas of one engine each keep their own index and byte limit, "
                f"so sharing files would double the disk use and delete each other's "
                f"blocks), got {e.kv_disk_tier_path!r} for {g.replicas} replica(s) of "
                f"{name!r}" + (f" and group {other!r}" if other != name else "")
            )
        paths[e.kv_disk_tier_path] = name
    try:
        return ClusterConfig(
            server=server,
            router=router,
            groups=groups,
            ingress_num_cpus=dep.ingress_num_cpus,
            ray_address=args.ray_address if args.ray_address is not None else dep.ray_address,
            app_name=dep.app_name,
        )
    except ValueError as exc:  # pydantic's ValidationError
        raise SpecError(f"deployment: {exc}") from exc


def resolve_cluster_config(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with every group's engine resolved as its replicas would resolve it on
    this machine (:func:`kvpage.server.cli.resolve_startup_config`, one engine built
    and freed per group) and ``server.resolved_on`` set. Replicas on other nodes of a
    joined cluster may decide differently; ``GET /admin/config`` shows what they did."""
    groups = {}
    server = cfg.server
    for name, g in cfg.groups.items():
        r = server_cli.resolve_startup_config(cfg.server.model_copy(update={"engine": g.engine}))
        groups[name] = g.model_copy(update={"engine": r.engine})
        server = server.model_copy(update={"resolved_on": r.resolved_on})
    return cfg.model_copy(update={"groups": groups, "server": server})


def serve_entry(args: argparse.Namespace) -> int:
    """Run ``kvpage serve``: the single server, or with cluster flags the scaled-out one."""
    if not wants_cluster(args):
        return server_cli.serve_main(args)
    try:
        cfg = cluster_config_from_args(args)
    except SpecError as exc:
        print(f"kvpage serve: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "resolved", False) and not args.dump_config:
        print("kvpage serve: --resolved: expected with --dump-config, got without", file=sys.stderr)
        return 2
    if args.dump_config:
        try:
            for grp in cfg.groups.values():
                server_cli.check_startup_config(
                    cfg.server.model_copy(update={"engine": grp.engine})
                )
            if cfg.ray_address is None:  # the in-process Ray gets this machine's CPUs
                check_cpus_fit(cfg, float(os.cpu_count() or 1))
            if args.resolved:
                cfg = resolve_cluster_config(cfg)
        except KVPageError as exc:
            print(f"kvpage serve: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(dump_cluster_config(cfg, args.dump_format))
        return 0
    import logging

    logging.basicConfig(
        level=cfg.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        from kvpage.cluster.launch import run_forever
    except ImportError as exc:
        print(
            "kvpage serve: --replicas/--ray-address/--router/--deployment need Ray Serve and "
            "the server packages (pip install 'kvpage[server,cluster]', or "
            f"`bash scripts/bootstrap.sh` for everything), got {exc}",
            file=sys.stderr,
        )
        return 2
    try:
        run_forever(cfg)
    except KVPageError as exc:
        print(f"kvpage serve: {exc}", file=sys.stderr)
        return 2
    return 0
