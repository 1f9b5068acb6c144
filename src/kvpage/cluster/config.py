"""The deployment file: replica groups, router policy, canary share (pydantic, dumpable).

A :class:`ClusterConfig` is to ``kvpage serve --replicas/--deployment`` what
:class:`~kvpage.server.config.ServerConfig` is to ``kvpage serve``: the whole effective
configuration, loadable from YAML/JSON and printed back with ``--dump-config`` so a
known-good deployment can be kept and restored. Example::

    server:                     # the ingress: bind address, admission, security
      port: 8000
    router:
      policy: kv_precise
    groups:
      default:
        replicas: 2
        engine: {model: stories260K, block_size: 16}
      long_context:             # every prompt of >= min_prompt_tokens tokens
        replicas: 1
        min_prompt_tokens: 192
        engine: {model: stories260K, max_num_seqs: 8}
      canary:                   # traffic_fraction of the remaining requests
        replicas: 1
        traffic_fraction: 0.1
        engine: {model: stories260K, kv_cache_dtype: int8}

Group names are roles: ``default`` (required), ``long_context`` (needs
``min_prompt_tokens``) and ``canary`` (needs ``traffic_fraction``). Every group serves
the same model (one tokenizer at the ingress). This module imports no Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from kvpage.errors import SpecError
from kvpage.server.config import (
    EngineConfig,
    ServerConfig,
    dump_mapping,
    format_validation_error,
    read_config_file,
)
from kvpage.specs.engine_config import StrictModel as _Strict

__all__ = [
    "POLICIES",
    "ClusterConfig",
    "GroupConfig",
    "RouterConfig",
    "check_cpus_fit",
    "cluster_config_data",
    "dump_cluster_config",
    "load_cluster_config",
]

#: router policy names (kvpage.routing.policies.make_policy)
POLICIES = ("round_robin", "power_of_two", "prefix_approx", "kv_precise")
PolicyName = Literal["round_robin", "power_of_two", "prefix_approx", "kv_precise"]
GroupName = Literal["default", "long_context", "canary"]


class GroupConfig(_Strict):
    """One replica group: ``replicas`` engine replicas built from ``engine``.

    ``num_cpus`` is the Ray CPU share each replica reserves (fractional: a replica of a
    small model on a 2-core machine needs far less than a core); ``max_ongoing_requests``
    is Ray Serve's per-replica cap of requests in flight (further requests wait at the
    router). ``min_prompt_tokens`` (``long_context`` only) and ``traffic_fraction``
    (``canary`` only) say which requests the group gets.
    """

    replicas: int = Field(1, ge=0, le=1024)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_cpus: float = Field(0.5, ge=0.0)
    max_ongoing_requests: int = Field(64, ge=1)
    min_prompt_tokens: int | None = Field(None, ge=1)
    traffic_fraction: float | None = Field(None, ge=0.0, le=1.0)


class RouterConfig(_Strict):
    """The request router of every group.

    ``policy``: see docs/serving.md ("Router policies"). ``kv_event_poll_s``: how often
    the ingress pulls each replica's KV events and load (also right after a request
    routed to it got its first token); ``replica_call_timeout_s`` bounds each such pull.
    ``seed`` seeds the randomised policies (power_of_two) and the canary draw.
    """

    policy: PolicyName = "kv_precise"
    kv_event_poll_s: float = Field(0.2, gt=0.0)
    replica_call_timeout_s: float = Field(10.0, gt=0.0)
    seed: int = Field(0, ge=0)


def _default_groups() -> dict[GroupName, GroupConfig]:
    return {"default": GroupConfig(replicas=2)}


class ClusterConfig(_Strict):
    """The complete configuration of a scaled-out ``kvpage serve``.

    ``server`` configures the ingress exactly as ``kvpage serve`` is configured (its
    ``engine`` section is ignored: each group has its own). ``ingress_num_cpus`` is the
    Ray CPU share of the ingress replica; ``ray_address`` None starts Ray in-process.

    ``ingress_replicas`` must be 1, refused otherwise with the reason: every engine
    replica's KV event batches are drained by one consumer (the ingress's pump), so a
    second ingress would see a gap on every pull and resync from snapshots; and the
    admission KV budget, the ``/admin/canary`` route and ``/metrics`` are each one
    ingress's own (a second would double-admit, miss canary changes, and report half).
    """

    server: ServerConfig = Field(default_factory=ServerConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    groups: dict[GroupName, GroupConfig] = Field(default_factory=lambda: _default_groups())
    ingress_num_cpus: float = Field(0.25, ge=0.0)
    ingress_replicas: int = 1
    ray_address: str | None = None
    app_name: str = Field("kvpage", min_length=1)

    @model_validator(mode="after")
    def _roles(self) -> ClusterConfig:
        g = self.groups
        if self.ingress_replicas != 1:
            raise ValueError(
                f"ingress_replicas: expected 1, got {self.ingress_replicas}: the engine "
                "replicas' KV event streams have one consumer (a second ingress would resync "
                "on every pull) and admission, /admin/canary and /metrics are per ingress"
            )
        if "default" not in g:
            raise ValueError(f"groups: expected a 'default' group, got {sorted(g)}")
        if g["default"].replicas < 1:
            raise ValueError(f"groups.default.replicas: expected >= 1, got {g['default'].replicas}")
        for name, grp in g.items():
            if grp.min_prompt_tokens is not None and name != "long_context":
                raise ValueError(
                    f"groups.{name}.min_prompt_tokens: expected unset outside the "
                    f"long_context group, got {grp.min_prompt_tokens}"
                )
            if grp.traffic_fraction is not None and name != "canary":
                raise ValueError(
                    f"groups.{name}.traffic_fraction: expected unset outside the canary "
                    f"group, got {grp.traffic_fraction}"
                )
            if grp.engine.model != g["default"].engine.model:
                raise ValueError(
                    f"groups.{name}.engine.model: expected the default group's model "
                    f"{g['default'].engine.model!r} (one tokenizer at the ingress), got "
                    f"{grp.engine.model!r}"
                )
        lc = g.get("long_context")
        if lc is not None and lc.min_prompt_tokens is None:
            raise ValueError("groups.long_context.min_prompt_tokens: expected a value, got None")
        if lc is not None and lc.replicas < 1:
            raise ValueError(f"groups.long_context.replicas: expected >= 1, got {lc.replicas}")
        can = g.get("canary")
        if can is not None and can.traffic_fraction is None:
            raise ValueError("groups.canary.traffic_fraction: expected a value, got None")
        if can is not None and can.replicas < 1 and (can.traffic_fraction or 0.0) > 0.0:
            raise ValueError(
                f"groups.canary.replicas: expected >= 1 with traffic_fraction "
                f"{can.traffic_fraction}, got {can.replicas}"
            )
        return self

    @property
    def canary_fraction(self) -> float:
        """The configured canary share (0 without a canary group)."""
        can = self.groups.get("canary")
        return float(can.traffic_fraction or 0.0) if can is not None else 0.0

    @property
    def long_context_threshold(self) -> int | None:
        """Prompt length (tokens) from which requests go to ``long_context``, or None."""
        lc = self.groups.get("long_context")
        return lc.min_prompt_tokens if lc is not None else None

    def num_replicas(self) -> int:
        """Engine replicas over all groups."""
        return sum(g.replicas for g in self.groups.values())


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read a :class:`ClusterConfig` from a YAML or JSON file (``.json`` = JSON).

    Raises:
        SpecError: unreadable file or invalid content (the message names the field).
    """
    p = Path(path)
    data = read_config_file(p, "deployment")
    server = data.get("server")
    if isinstance(server, dict) and "engine" in server:
        raise SpecError(
            f"deployment: server.engine: expected no engine section in {p} (each replica "
            "group has its own: groups.<name>.engine), got one"
        )
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise SpecError(
            f"deployment: expected a valid ClusterConfig in {p}, got {format_validation_error(exc)}"
        ) from exc


def cluster_config_data(config: ClusterConfig) -> dict[str, Any]:
    """``config`` as the mapping a deployment file holds (defaults included; API keys
    never written; no ``server.engine``: the groups' engines are the engines)."""
    data = config.model_dump(mode="json")
    data.get("server", {}).pop("engine", None)
    return data


def dump_cluster_config(config: ClusterConfig, fmt: Literal["yaml", "json"] = "yaml") -> str:
    """Serialise ``config`` completely (defaults included; API keys never written)."""
    return dump_mapping(cluster_config_data(config), fmt)


def check_cpus_fit(cfg: ClusterConfig, have: float) -> None:
    """Refuse a deployment the in-process Ray can never place: Serve would wait forever
    for a replica whose ``num_cpus`` (or all replicas' sum plus the ingress's) exceeds the
    CPUs Ray was started with. Not applied with ``--ray-address`` (a cluster may add nodes).

    Raises:
        SpecError: naming the group and the numbers.
    """
    total = cfg.ingress_num_cpus
    for name, g in cfg.groups.items():
        if g.replicas and g.num_cpus > have:
            raise SpecError(
                f"groups.{name}.num_cpus: expected <= {have:g} (the CPUs of this machine's "
                f"Ray), got {g.num_cpus:g}: the replica could never be placed"
            )
        total += g.num_cpus * g.replicas
    if total > have:
        raise SpecError(
            f"deployment: expected replicas needing <= {have:g} CPUs in all (num_cpus x "
            f"replicas per group + ingress_num_cpus), got {total:g}: lower num_cpus (it may "
            "be fractional) or the replica counts"
        )
