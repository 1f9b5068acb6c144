"""Metrics of a scaled-out server, in the ingress's registry (``GET /metrics``).

Router (labels: ``policy``, ``group``, and ``replica`` where it names one):

* ``kvpage:router_decisions_total{policy, group, replica}`` -- requests routed;
* ``kvpage:router_predicted_hit_blocks_total`` / ``kvpage:router_actual_hit_blocks_total``
  ``{policy, group}`` -- per finished request, the leading blocks the index said the
  chosen replica held, and the blocks its engine actually served from the prefix cache
  (``num_cached_tokens // block_size``);
* ``kvpage:router_resyncs_total{group, replica}`` -- snapshot resyncs (gap, restart,
  new replica); ``kvpage:router_replicas_removed_total{group}`` -- views dropped
  (dead or scaled-down replicas);
* ``kvpage:router_kv_event_lag_seconds{group}`` -- from a replica draining a batch to
  the router applying it;
* ``kvpage:router_index_blocks{group, replica}`` -- blocks in the router's view;
* ``kvpage:router_retries_total{group}``, ``kvpage:router_replica_failures_total{group}``;
* ``kvpage:group_requests_total{group}`` -- requests per group (canary share);
  ``kvpage:canary_traffic_fraction`` -- the configured share.

Engines: every replica's ``kvpage:*`` engine metrics (the names of a single server)
with labels ``model_name``, ``group`` and ``replica``, as of the replica's last report.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpage.cluster.core import RouterObserver

__all__ = ["ClusterMetrics"]

_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_NAME_OK = re.compile(r"^kvpage:[a-zA-Z0-9_:]*$")


class _ReplicaCollector(Collector):
    """Each replica's latest engine metrics, labelled by group and replica."""

    def __init__(
        self,
        reports: Callable[[], Mapping[tuple[str, str], Mapping[str, float]]],
        index_blocks: Callable[[], Mapping[tuple[str, str], int]],
        model_name: str,
    ) -> None:
        self._reports = reports
        self._blocks = index_blocks
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        fams: dict[str, Any] = {}
        labels = ["model_name", "group", "replica"]
        for (group, rid), snap in sorted(self._reports().items()):
            for name, value in snap.items():
                if not _NAME_OK.match(name):
                    continue
                if name.endswith("_total"):
                    base = name[: -len("_total")]
                    fam = fams.get(base)
                    if fam is None:
                        fam = fams[base] = CounterMetricFamily(
                            base, f"engine metric {name} of each replica", labels=labels
                        )
                else:
                    fam = fams.get(name)
                    if fam is None:
                        fam = fams[name] = GaugeMetricFamily(
                            name, f"engine metric {name} of each replica", labels=labels
                        )
                fam.add_metric([self._model, group, rid], float(value))
        yield from (fams[k] for k in sorted(fams))
        g = GaugeMetricFamily(
            "kvpage:router_index_blocks",
            "Blocks the router's KV index holds for each replica",
            labels=["group", "replica"],
        )
        for (group, rid), n in sorted(self._blocks().items()):
            g.add_metric([group, rid], float(n))
        yield g


class ClusterMetrics(RouterObserver):
    """The cluster metrics of one ingress (see module doc), registered in ``registry``.

    Args:
        registry: the ingress server's registry (``ServerMetrics.registry``).
        policy: the router policy name (a label).
        model_name: the served model id (a label of the engine metrics).
        index_blocks: ``(group, replica) -> blocks in the router's view``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        policy: str,
        model_name: str,
        index_blocks: Callable[[], Mapping[tuple[str, str], int]],
    ) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        #: (group, replica) -> latest engine metrics of that replica
        self.reports: dict[tuple[str, str], dict[str, float]] = {}
        self._routing_metrics(registry)
        self._index_metrics(registry)
        self._group_metrics(registry)
        registry.register(_ReplicaCollector(self._reports_copy, index_blocks, model_name))

    def _routing_metrics(self, r: CollectorRegistry) -> None:
        """Routing decisions and their predicted vs served prefix hits."""
        self.decisions = Counter(
            "kvpage:router_decisions",
            "Requests routed, by policy, group and replica",
            ["policy", "group", "replica"],
            registry=r,
        )
        self.predicted = Counter(
            "kvpage:router_predicted_hit_blocks",
            "Leading prompt blocks the router's index predicted the chosen replica holds "
            "(finished requests)",
            ["policy", "group"],
            registry=r,
        )
        self.actual = Counter(
            "kvpage:router_actual_hit_blocks",
            "Prompt blocks the chosen replica's engine served from its prefix cache "
            "(finished requests)",
            ["policy", "group"],
            registry=r,
        )

    def _index_metrics(self, r: CollectorRegistry) -> None:
        """The router's KV index: resyncs, dropped replica views, event lag."""
        self.resyncs = Counter(
            "kvpage:router_resyncs",
            "Snapshot resyncs of a replica's KV index view (gap, restart, new replica)",
            ["group", "replica"],
            registry=r,
        )
        self.removed_c = Counter(
            "kvpage:router_replicas_removed",
            "Replica views dropped from the KV index (dead or removed replicas)",
            ["group"],
            registry=r,
        )
        self.lag_h = Histogram(
            "kvpage:router_kv_event_lag_seconds",
            "Time from a replica draining a KV event batch to the router applying it",
            ["group"],
            buckets=_LAG_BUCKETS,
            registry=r,
        )

    def _group_metrics(self, r: CollectorRegistry) -> None:
        """Replica failures and retries, replica groups, fallbacks, the canary share."""
        self.retries = Counter(
            "kvpage:router_retries",
            "Requests sent again to another replica after a replica failed before the first output",
            ["group"],
            registry=r,
        )
        self.failures = Counter(
            "kvpage:router_replica_failures",
            "Calls to a replica that failed (actor died, call lost)",
            ["group"],
            registry=r,
        )
        self.group_requests = Counter(
            "kvpage:group_requests", "Requests sent to each replica group", ["group"], registry=r
        )
        self.fallbacks = Counter(
            "kvpage:group_fallbacks",
            "Requests the routing rules sent to a group that could not take them "
            "(max_model_len, max_num_seqs), served by another group instead",
            ["drawn", "group"],
            registry=r,
        )
        self.canary = Gauge(
            "kvpage:canary_traffic_fraction",
            "Configured share of requests sent to the canary group",
            registry=r,
        )

    def _reports_copy(self) -> dict[tuple[str, str], dict[str, float]]:
        with self._lock:
            return dict(self.reports)

    def set_report(self, group: str, replica_id: str, metrics: Mapping[str, float]) -> None:
        """Keep ``replica_id``'s latest engine metrics."""
        with self._lock:
            self.reports[(group, replica_id)] = dict(metrics)

    def summed_counters(self) -> dict[str, float]:
        """Engine ``*_total`` counters summed over live replicas (for degradation)."""
        out: dict[str, float] = {}
        with self._lock:
            for snap in self.reports.values():
                for k, v in snap.items():
                    if k.endswith("_total"):
                        out[k] = out.get(k, 0.0) + float(v)
        return out

    # ---------------------------------------------------------- RouterObserver
    def decision(self, group: str, replica_id: str, predicted_blocks: int) -> None:
        self.decisions.labels(policy=self.policy, group=group, replica=replica_id).inc()

    def resync(self, group: str, replica_id: str) -> None:
        self.resyncs.labels(group=group, replica=replica_id).inc()

    def removed(self, group: str, replica_id: str) -> None:
        self.removed_c.labels(group=group).inc()
        with self._lock:
            self.reports.pop((group, replica_id), None)

    def lag(self, group: str, seconds: float) -> None:
        self.lag_h.labels(group=group).observe(max(0.0, seconds))

    # ---------------------------------------------------------- RemoteEngineLoop
    def request(self, group: str) -> None:
        self.group_requests.labels(group=group).inc()

    def fallback(self, drawn: str, group: str) -> None:
        self.fallbacks.labels(drawn=drawn, group=group).inc()

    def retry(self, group: str) -> None:
        self.retries.labels(group=group).inc()

    def failure(self, group: str) -> None:
        self.failures.labels(group=group).inc()

    def hits(self, group: str, predicted: int, actual: int) -> None:
        self.predicted.labels(policy=self.policy, group=group).inc(predicted)
        self.actual.labels(policy=self.policy, group=group).inc(actual)
