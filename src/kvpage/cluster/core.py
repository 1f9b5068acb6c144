"""Per-group router state, shared by the ingress and the Ray Serve router (no Ray here).

One :class:`RouterCore` per replica group lives in the ingress process: the group's
:class:`~kvpage.routing.index.PrefixIndex`, its routing policy
(:func:`kvpage.routing.policies.make_policy`), the latest load of every replica and the
decisions waiting for their outcome. The ingress applies KV event batches and
snapshots to it (:meth:`RouterCore.apply_report`, :meth:`RouterCore.resync`); the
custom ``RequestRouter`` (:mod:`kvpage.cluster.router`, running on Ray Serve's router
event loop, another thread) asks it to choose (:meth:`RouterCore.choose`) and reports
the replica set (:meth:`RouterCore.set_replicas`) and deaths (:meth:`RouterCore.drop`).
A lock serialises the two threads.

The request's block keys are computed with ``kvpage.routing.policies.route_request``,
i.e. ``kvpage.cache.hash_request_blocks`` with the group's block size and hash seed and
the request's effective ``cache_salt`` -- the salt the ingress computed with
``kvpage.server.auth.scoped_cache_salt`` and sends to the replica, so the router hashes
exactly what the replica's engine will hash.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvpage.routing.events import KVEventBatch, KVSnapshot
from kvpage.routing.index import PrefixIndex
from kvpage.routing.policies import ReplicaLoad, make_policy, route_request

__all__ = ["CORES", "Decision", "RouterCore", "RouterObserver"]


class RouterObserver:
    """What a :class:`RouterCore` reports (the ingress's metrics implement it)."""

    def decision(self, group: str, replica_id: str, predicted_blocks: int) -> None:
        """A request of ``group`` was routed to ``replica_id``."""

    def resync(self, group: str, replica_id: str) -> None:
        """The view of ``replica_id`` was replaced by a snapshot."""

    def removed(self, group: str, replica_id: str) -> None:
        """``replica_id`` left the group (dead or scaled down); its view is dropped."""

    def lag(self, group: str, seconds: float) -> None:
        """A batch was applied ``seconds`` after the replica drained it."""


@dataclass
class Decision:
    """A routed request: where it went and how many leading blocks the index
    predicted that replica holds."""

    replica_id: str
    predicted_blocks: int
    num_blocks: int


@dataclass
class RouterCore:
    """Router state of one replica group (see module doc).

    Args:
        group: the group's name.
        policy: a policy name of :func:`kvpage.routing.policies.make_policy`.
        block_size: the group's engine block size (tokens).
        hash_seed: the group's engine hash seed (``KVCacheManager.hash_seed``).
        seed: seed of randomised policies.
        observer: receives decisions, resyncs, removals and lags.
    """

    group: str
    policy: str
    block_size: int
    hash_seed: int = 0
    seed: int = 0
    observer: RouterObserver = field(default_factory=RouterObserver)

    def __post_init__(self) -> None:
        self.index = PrefixIndex()
        self._policy = make_policy(self.policy, index=self.index, seed=self.seed)
        self.lock = threading.Lock()
        #: replica id -> latest load reported by the replica
        self.loads: dict[str, ReplicaLoad] = {}
        #: replica id -> requests routed there and not finished (counted at the ingress)
        self.in_flight: dict[str, int] = {}
        #: replicas the Serve router currently knows (set by set_replicas)
        self.replicas: set[str] = set()
        self._pending: dict[str, tuple[Any, dict[str, int]]] = {}
        self.decisions: dict[str, Decision] = {}
        #: called with a replica id when a new one appears (the ingress starts polling)
        self.on_new_replica: Callable[[str], None] | None = None

    # ------------------------------------------------------------ routing
    def choose(self, request_id: str, route: dict[str, Any], candidates: list[str]) -> str:
        """The replica (one of ``candidates``, non-empty) for a request; the decision is
        completed by :meth:`routed` once Ray Serve has sent it."""
        req = route_request(
            list(route["prompt_token_ids"]),
            block_size=self.block_size,
            cache_salt=route.get("cache_salt"),
            hash_seed=self.hash_seed,
        )
        with self.lock:
            loads = [self._load(r) for r in candidates]
            choice = str(self._policy.choose(req, loads))
            if choice not in candidates:  # defensive: a policy must pick a candidate
                choice = candidates[0]
            matched = self.index.matched_blocks(req.block_hashes)
            self._pending[request_id] = (req, matched)
        return choice

    def routed(self, request_id: str, replica_id: str) -> None:
        """Ray Serve sent ``request_id`` to ``replica_id`` (it may differ from the
        choice when that replica was full): record the decision."""
        with self.lock:
            req, matched = self._pending.pop(request_id, (None, {}))
            if req is None:
                return
            self._policy.on_routed(req, replica_id)
            self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
            predicted = int(matched.get(replica_id, 0))
            self.decisions[request_id] = Decision(replica_id, predicted, len(req.block_hashes))
        self.observer.decision(self.group, replica_id, predicted)

    def finished(self, request_id: str) -> Decision | None:
        """The request ended (any way): forget it; returns its decision, if any."""
        with self.lock:
            self._pending.pop(request_id, None)
            d = self.decisions.pop(request_id, None)
            if d is not None and self.in_flight.get(d.replica_id, 0) > 0:
                self.in_flight[d.replica_id] -= 1
        return d

    def _load(self, rid: str) -> ReplicaLoad:
        rep = self.loads.get(rid)
        running = self.in_flight.get(rid, 0)
        if rep is None:
            return ReplicaLoad(rid, running, 0, 0.0)
        # requests in flight from this ingress are known now; the replica's own counts
        # are as old as its last report
        return ReplicaLoad(
            rid, max(running, int(rep.num_running)), int(rep.num_waiting), rep.kv_usage
        )

    # ------------------------------------------------------------ replica set
    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """The group's replicas are now ``replica_ids``: views of the others are dropped
        at once."""
        new = set(replica_ids)
        with self.lock:
            gone = self.replicas - new
            added = new - self.replicas
            self.replicas = new
        for rid in gone:
            self.drop(rid)
        if self.on_new_replica is not None:
            for rid in added:
                self.on_new_replica(rid)

    def drop(self, replica_id: str) -> None:
        """``replica_id`` died or left: forget its view, load and in-flight count."""
        with self.lock:
            self.replicas.discard(replica_id)
            removed = self.index.remove(replica_id)
            forget = getattr(self._policy, "forget", None)
            if forget is not None:  # prefix_approx: its tree entries of that replica
                forget(replica_id)
            self.loads.pop(replica_id, None)
            self.in_flight.pop(replica_id, None)
        if removed:
            self.observer.removed(self.group, replica_id)

    def view_sizes(self) -> dict[str, int]:
        """Replica id -> blocks in the router's view of it (a consistent copy)."""
        with self.lock:
            return {rid: self.index.num_blocks(rid) for rid in self.index.replicas}

    # ------------------------------------------------------------ KV events
    def apply_report(self, report: dict[str, Any]) -> bool:
        """Apply a replica's ``kv_events`` report (batches in order, then its load).

        Returns:
            False when the view needs a resync (gap, unknown replica or new epoch).
        """
        rid = str(report["replica_id"])
        ok = True
        with self.lock:
            if rid not in self.replicas:
                return True  # dropped meanwhile: nothing to keep
            ld = report.get("load") or {}
            self.loads[rid] = ReplicaLoad(
                rid,
                int(ld.get("num_running", 0)),
                int(ld.get("num_waiting", 0)),
                float(ld.get("kv_usage", 0.0)),
            )
            for b in report.get("batches", ()):
                batch = KVEventBatch.from_dict(b)
                if not self.index.apply(batch):
                    ok = False
                    break
                self.observer.lag(self.group, self.index.stats.last_lag_s)
            if rid not in self.index:
                ok = False  # never synced (a new replica with nothing to say yet)
        return ok

    def resync(self, snapshot: dict[str, Any]) -> None:
        """Replace a replica's view with its snapshot (``KVSnapshot.to_dict`` form)."""
        snap = KVSnapshot.from_dict(snapshot)
        with self.lock:
            if snap.replica_id not in self.replicas:
                return
            self.index.resync(snap)
        self.observer.resync(self.group, snap.replica_id)


#: group name -> its RouterCore, in this process (the ingress registers them; the Serve
#: router of the group's deployment handle, created in the same process, looks them up)
CORES: dict[str, RouterCore] = {}
