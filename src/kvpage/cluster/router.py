"""The Ray Serve ``RequestRouter`` of every engine replica group.

Ray Serve (2.60, alpha API ``ray.serve.request_router``) creates one router per
deployment handle, in the process that holds the handle -- here the ingress -- and
calls :meth:`KVAwareRouter.choose_replicas` for every request with the replicas that
are running. The router reads the request's routing hint (the ``route`` keyword every
:class:`~kvpage.cluster.replica.EngineReplica` method takes) and:

* ``{"target": replica_id}`` (KV event pulls, snapshots): that replica, or any when it
  is no longer running (pulls and snapshots carry the answering replica's id);
* ``{"prompt_token_ids": [...], "cache_salt": ..., "request_id": ..., "exclude": [...]}``
  (generation): asks the group's :class:`~kvpage.cluster.core.RouterCore` (the routing
  policy) for a replica among the candidates not in ``exclude`` (a retry never goes
  back to the replica that failed), ranked first; the other candidates follow as a
  fallback rank (used by Serve only when the first is at ``max_ongoing_requests``);
* anything else: any candidate.

Replica set changes and actor deaths are passed to the core at once, which drops the
dead replica's index view.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvpage.cluster.core import RouterCore

__all__ = ["KVAwareRouter"]

logger = logging.getLogger("kvpage.cluster")


def _route_of(pending: PendingRequest | None) -> dict[str, Any] | None:
    if pending is None:
        return None
    route = pending.kwargs.get("route")
    return route if isinstance(route, dict) else None


class KVAwareRouter(RequestRouter):
    """Routes a group's requests with the kvpage routing policy (see module doc).

    ``request_router_kwargs``: ``core`` -- the key of the group's
    :class:`~kvpage.cluster.core.RouterCore` in :data:`kvpage.cluster.core.CORES`.
    """

    _core_key: str = ""

    def initialize_state(self, core: str = "", **kwargs: Any) -> None:
        """Called by Ray Serve with ``request_router_kwargs``."""
        self._core_key = core

    @property
    def core(self) -> RouterCore | None:
        """The group's router state (None until the ingress registered it); told the
        current replica set the first time it is found."""
        # looked up in the module at call time: Ray Serve may hand us a copy of this
        # class whose module globals are not the live ones of this process
        cores: dict[str, RouterCore] = importlib.import_module("kvpage.cluster.core").CORES
        core = cores.get(self._core_key)
        if core is not None and getattr(self, "_told", None) is not core:
            self._told = core
            core.set_replicas(r.unique_id for r in self.curr_replicas)
        return core

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One ranked choice (see module doc)."""
        if not candidate_replicas:
            return []
        route = _route_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if route is not None and route.get("target") is not None:
            r = by_id.get(str(route["target"]))
            # A target that is gone (died, replaced) must not leave the call pending:
            # Serve's routing tasks would retry it with backoff ahead of every other
            # request. Any replica answers instead; its report names itself.
            return [[r]] if r is not None else [list(candidate_replicas)]
        core = self.core
        if route is None or core is None or "prompt_token_ids" not in route:
            return [list(candidate_replicas)]
        exclude = set(route.get("exclude") or ())
        ids = [i for i in by_id if i not in exclude] or list(by_id)
        choice = core.choose(str(route["request_id"]), route, ids)
        rest = [by_id[i] for i in ids if i != choice]
        return [[by_id[choice]], rest] if rest else [[by_id[choice]]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Record the decision (the replica Serve actually sent it to)."""
        route = _route_of(pending_request)
        core = self.core
        if core is None or route is None or "request_id" not in route:
            return
        core.routed(str(route["request_id"]), replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's replica set changed: the core drops views of replicas that left."""
        super().update_replicas(replicas)
        core = self.core  # (a first lookup already passes the new set)
        if core is not None:
            core.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica's actor died: stop routing there and drop its view at once."""
        super().on_replica_actor_died(replica_id)
        core = self.core
        if core is not None:
            logger.warning(
                "kvpage router: replica %s of group %s died; its KV index is dropped",
                replica_id.unique_id,
                core.group,
            )
            core.drop(replica_id.unique_id)
