"""KV-aware request routing over many engine replicas (no Ray, no torch, no engine).

* :mod:`kvpage.routing.events`: KV events (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``, each with its medium: device pool, host or disk tier) in numbered
  batches;
* :mod:`kvpage.routing.publisher`: the :class:`KVEventPublisher` that a replica
  attaches to its :class:`~kvpage.cache.KVCacheManager` (pool and KV tiers);
* :mod:`kvpage.routing.index`: :class:`PrefixIndex`, the router's per-replica view,
  with gap / restart detection and snapshot resync;
* :mod:`kvpage.routing.base`: ``ReplicaLoad``, ``RouteRequest``, :func:`route_request` and
  the :class:`RouterPolicy` protocol;
* :mod:`kvpage.routing.policies`: the policies (``round_robin``, ``power_of_two``,
  ``prefix_approx``, ``kv_precise``, ``oracle``) behind one :class:`RouterPolicy`
  protocol, and :func:`route_request` (block keys from ``kvpage.cache.hash_request_blocks``).

The Ray Serve deployment and the multi-instance simulator (``kvpage.sim.cluster``) both
run these objects; docs/serving.md, "Routing", documents the cost function.
"""

from kvpage.routing.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
    RoutingError,
)
from kvpage.routing.index import IndexStats, PrefixIndex
from kvpage.routing.policies import (
    POLICY_NAMES,
    CostWeights,
    ReplicaLoad,
    RouteRequest,
    RouterPolicy,
    make_policy,
    route_request,
)
from kvpage.routing.publisher import KVEventPublisher

__all__ = [
    "POLICY_NAMES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CostWeights",
    "IndexStats",
    "KVEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVSnapshot",
    "PrefixIndex",
    "ReplicaLoad",
    "RouteRequest",
    "RouterPolicy",
    "RoutingError",
    "make_policy",
    "route_request",
]
