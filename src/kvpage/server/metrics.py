"""Prometheus metrics of the server (``GET /metrics``).

Each server owns its own ``CollectorRegistry`` (no process-global state), holding:

* the engine's ``kvpage:*`` metrics (named as in docs/user-guide.md), read from the latest snapshot of
  ``LLMEngine.get_metrics()``; names ending in ``_total`` are exported as counters, the
  rest as gauges; each carries a ``model_name`` label (the served model, as vLLM's);
* per-request phase histograms with ``model_name``: queue time (arrival -> first
  scheduled), prefill time (first scheduled -> first token), decode time (first token
  -> finish), inference time (first scheduled -> finish), and
  ``kvpage:request_success_total{finished_reason, model_name}`` per finished choice;
* server histograms: TTFT, TPOT, end-to-end latency (seconds), prefill and decode
  throughput per engine step (tokens/s);
* gauges and counters: queue lengths, active sequences, prefix cache hit ratio, KV
  memory utilization (actual and projected), cancellations, rejections by reason,
  degradation state and transitions, max_tokens caps;
* ``kvpage:cache_config`` info: block size, number of blocks, kv dtype, backend.

Placement labels: a scaled-out ingress (``placement_labels=("group", "replica")``)
adds ``group`` and ``replica`` to every request-level series (the phase, TTFT, TPOT
and e2e histograms, ``request_success``, ``request_errors``, ``request_cancellations``,
``server_requests``, ``server_requests_rejected``) -- the replica group and replica that
served the request, ``"none"`` when it was refused before one was chosen, ``"mixed"``
for a several-prompt request whose prompts went to different groups -- and exports one
``cache_config`` series per group (``group`` label). The single server has no
placement labels: its series are exactly vLLM's shape.

Bucket bounds are chosen for a CPU-served tiny model up to large GPU deployments (1 ms to
60 s); see docs/serving.md for what to alert on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["NOT_PLACED", "RequestSeries", "ServerMetrics"]

#: the placement label value of a request refused before a group/replica was chosen
NOT_PLACED = "none"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_THROUGHPUT_BUCKETS = (10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000)
_COUNT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_NAME_OK = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
#: an engine metric key with one label: ``name{label="value"}``
_LABELLED = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"\}$')


class _EngineCollector(Collector):
    """Exports the latest engine metric snapshot under the engine's own names."""

    def __init__(self, snapshot: Callable[[], Mapping[str, float]], model_name: str) -> None:
        self._snapshot = snapshot
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        labelled: dict[tuple[str, str], list[tuple[str, float]]] = {}
        for name, value in sorted(self._snapshot().items()):
            m = _LABELLED.match(name)
            if m is not None:
                labelled.setdefault((m.group(1), m.group(2)), []).append((m.group(3), value))
                continue
            if not _NAME_OK.match(name):
                continue
            if name.endswith("_total"):
                c = CounterMetricFamily(
                    name[: -len("_total")], f"engine metric {name}", labels=["model_name"]
                )
                c.add_metric([self._model], float(value))
                yield c
            else:
                g = GaugeMetricFamily(name, f"engine metric {name}", labels=["model_name"])
                g.add_metric([self._model], float(value))
                yield g
        for (name, label), values in sorted(labelled.items()):
            # e.g. kvpage:cache_miss_reasons_total{reason="evicted"}: one family, one
            # sample per label value (a bounded set, never per request)
            if name.endswith("_total"):
                fam: Metric = CounterMetricFamily(
                    name[: -len("_total")], f"engine metric {name}", labels=[label, "model_name"]
                )
            else:
                fam = GaugeMetricFamily(name, f"engine metric {name}", labels=[label, "model_name"])
            for v, x in values:
                fam.add_metric([v, self._model], float(x))  # type: ignore[attr-defined]
            yield fam


class RequestSeries:
    """The request-level series of one placement (children of the labelled families).

    Attributes:
        ttft, tpot, e2e: histogram children (seconds).
        phase: ``queue``/``prefill``/``decode``/``inference`` histogram children.
    """

    def __init__(self, m: ServerMetrics, labels: dict[str, str]) -> None:
        self._m, self._labels = m, labels
        mn = {"model_name": m.model_name, **labels}
        self.ttft = m.ttft_family.labels(**mn)
        self.tpot = m.tpot_family.labels(**mn)
        self.e2e = m.e2e_family.labels(**mn)
        self.phase = {k: f.labels(**mn) for k, f in m.phase_family.items()}

    def success(self, finished_reason: str) -> None:
        """Count one finished choice."""
        self._m.request_success.labels(
            finished_reason=finished_reason, model_name=self._m.model_name, **self._labels
        ).inc()

    def error(self, reason: str) -> None:
        """Count one request that reached the engine (a replica) and failed there."""
        self._m.request_errors.labels(
            reason=reason, model_name=self._m.model_name, **self._labels
        ).inc()

    def cancellation(self, cause: str) -> None:
        """Count one request aborted before it finished."""
        self._m.cancellations.labels(cause=cause, **self._labels).inc()


class ServerMetrics:
    """All metrics of one server, in a registry of their own.

    Args:
        engine_snapshot: returns the latest ``LLMEngine.get_metrics()`` dict (cheap; the
            engine loop refreshes it after every step).
        kv_total_bytes: bytes of the whole KV pool (``CacheSpec.total_bytes``).
        model_name: the served model id, the ``model_name`` label of engine metrics.
        placement_labels: extra labels of every request-level series (module doc);
            ``()`` for the single server.
    """

    def __init__(
        self,
        engine_snapshot: Callable[[], Mapping[str, float]],
        kv_total_bytes: float = 0.0,
        model_name: str = "",
        placement_labels: tuple[str, ...] = (),
    ) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.kv_total_bytes = float(kv_total_bytes)
        self.model_name = model_name
        self.placement_labels = pl = tuple(placement_labels)
        self._series: dict[tuple[str, ...], RequestSeries] = {}
        r.register(_EngineCollector(engine_snapshot, model_name))
        self._request_metrics(r, pl)
        self._step_metrics(r)
        self._state_metrics(r, pl)
        self._event_counters(r, pl)
        self._set_initial_values()

    def _request_metrics(self, r: CollectorRegistry, pl: tuple[str, ...]) -> None:
        """Per-request latency histograms and outcome counters (labelled by placement)."""
        phases = {
            "queue": "Request time waiting before its first engine step (arrival -> first "
            "scheduled)",
            "prefill": "Request time in prefill (first scheduled -> first token)",
            "decode": "Request time in decode (first token -> last token)",
            "inference": "Request time in the engine (first scheduled -> last token)",
        }
        self.phase_family = {
            k: Histogram(
                f"kvpage:request_{k}_time_seconds",
                doc,
                ["model_name", *pl],
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
            for k, doc in phases.items()
        }
        self.request_success = Counter(
            "kvpage:request_success",
            "Finished choices (completions) by finish reason (stop, length)",
            ["finished_reason", "model_name", *pl],
            registry=r,
        )
        self.request_errors = Counter(
            "kvpage:request_errors",
            "Requests that reached the engine (a replica) and failed there, by reason "
            "(engine_rejected, engine_error, out_of_memory, replica_unavailable)",
            ["reason", "model_name", *pl],
            registry=r,
        )
        self.ttft_family = Histogram(
            "kvpage:time_to_first_token_seconds",
            "Time from request arrival at the server to its first generated token",
            ["model_name", *pl],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot_family = Histogram(
            "kvpage:time_per_output_token_seconds",
            "Mean time between output tokens of a finished request (after the first)",
            ["model_name", *pl],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e_family = Histogram(
            "kvpage:e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            ["model_name", *pl],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _step_metrics(self, r: CollectorRegistry) -> None:
        """Per-engine-step throughput and batch histograms."""
        self.prefill_tps = Histogram(
            "kvpage:prefill_tokens_per_second",
            "Prompt tokens computed per second of engine step time, per step with prefill",
            buckets=_THROUGHPUT_BUCKETS,
            registry=r,
        )
        self.decode_tps = Histogram(
            "kvpage:decode_tokens_per_second",
            "Tokens generated per second of engine step time, per step with generation",
            buckets=_THROUGHPUT_BUCKETS,
            registry=r,
        )
        self.step_running = Histogram(
            "kvpage:step_running_sequences",
            "Running sequences (batch size) after each engine step",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.step_waiting = Histogram(
            "kvpage:step_waiting_requests",
            "Scheduler waiting-queue length after each engine step",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )

    def _state_metrics(self, r: CollectorRegistry, pl: tuple[str, ...]) -> None:
        """Gauges of the server's current state (queues, KV memory) and the cache info."""
        self.queue_length = Gauge(
            "kvpage:server_queue_length",
            "Requests waiting: engine = scheduler waiting queue, kv_pressure = long-context "
            "requests waiting for KV budget, long_context = degraded-mode long-context queue",
            ["queue"],
            registry=r,
        )
        self.active = Gauge(
            "kvpage:server_active_sequences",
            "Requests admitted by the server and not yet finished",
            registry=r,
        )
        self.hit_ratio = Gauge(
            "kvpage:prefix_cache_hit_ratio",
            "Prefix cache hits / queries (tokens, cumulative); 0 before any query",
            registry=r,
        )
        self.kv_util = Gauge(
            "kvpage:kv_memory_utilization",
            "Share of KV cache blocks in use (actual = engine; projected = reservations of "
            "admitted requests at their maximum length)",
            ["kind"],
            registry=r,
        )
        self.kv_bytes = Gauge(
            "kvpage:kv_cache_memory_bytes",
            "KV cache memory in bytes: total = the allocated pool (all layers), used = "
            "actual utilization x total",
            ["kind"],
            registry=r,
        )
        self.cache_config = Info(
            "kvpage:cache_config",
            "KV cache configuration: block size, number of blocks, kv dtype, backend"
            + (" (one series per replica group; num_blocks is per replica)" if pl else ""),
            ["group"] if "group" in pl else [],
            registry=r,
        )

    def _event_counters(self, r: CollectorRegistry, pl: tuple[str, ...]) -> None:
        """Counters of refusals, cancellations, degradation and engine failures."""
        self.cancellations = Counter(
            "kvpage:request_cancellations",
            "Requests aborted before finishing (client disconnect, server shutdown)",
            ["cause", *pl],
            registry=r,
        )
        self.rejected = Counter(
            "kvpage:server_requests_rejected",
            "Requests refused by the server, by reason",
            ["reason", *pl],
            registry=r,
        )
        self.requests = Counter(
            "kvpage:server_requests",
            "HTTP generation requests by endpoint and status code",
            ["endpoint", "status", *pl],
            registry=r,
        )
        self.degraded = Gauge(
            "kvpage:degraded",
            "1 while the server runs in degraded mode (max_tokens capped, long-context "
            "requests queued separately), else 0",
            registry=r,
        )
        self.degradation_transitions = Counter(
            "kvpage:degradation_transitions",
            "Changes of degradation state, by the state entered",
            ["to"],
            registry=r,
        )
        self.max_tokens_capped = Counter(
            "kvpage:max_tokens_capped",
            "Requests whose max_tokens was lowered by degraded mode",
            registry=r,
        )
        self.step_failures = Counter(
            "kvpage:engine_step_errors",
            "Engine steps that raised (their requests were failed with 500)",
            registry=r,
        )
        self.oom = Counter(
            "kvpage:oom",
            "Engine steps that ran out of device or host memory (their requests got 503; "
            "each one drives the degradation controller like a window of allocation failures at enter_alloc_failures_per_s "
            "allocation failures)",
            registry=r,
        )

    def _set_initial_values(self) -> None:
        """Every fixed-label series exists from the start (at 0; the pool's total bytes)."""
        for q in ("engine", "kv_pressure", "long_context"):
            self.queue_length.labels(queue=q).set(0)
        for k in ("actual", "projected"):
            self.kv_util.labels(kind=k).set(0)
        self.degraded.set(0)
        self.kv_bytes.labels(kind="total").set(self.kv_total_bytes)
        self.kv_bytes.labels(kind="used").set(0)
        if not self.placement_labels:
            self.series()  # the single server's series exist (at 0) from the start

    def placement(self, placement: Mapping[str, str] | None) -> dict[str, str]:
        """The placement label values of ``placement`` (``{}`` on the single server;
        :data:`NOT_PLACED` for a label ``placement`` lacks)."""
        p = placement or {}
        return {k: str(p.get(k) or NOT_PLACED) for k in self.placement_labels}

    def series(self, placement: Mapping[str, str] | None = None) -> RequestSeries:
        """The request-level series of ``placement`` (see :meth:`placement`)."""
        labels = self.placement(placement)
        key = tuple(labels.values())
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = RequestSeries(self, labels)
        return s

    def count_request(
        self, endpoint: str, status: int | str, placement: Mapping[str, str] | None = None
    ) -> None:
        """Count one HTTP generation request's outcome."""
        self.requests.labels(
            endpoint=endpoint, status=str(status), **self.placement(placement)
        ).inc()

    def count_rejected(self, reason: str, placement: Mapping[str, str] | None = None) -> None:
        """Count one refused request."""
        self.rejected.labels(reason=reason, **self.placement(placement)).inc()

    def update_from_engine(self, snap: Mapping[str, float]) -> None:
        """Refresh gauges derived from an engine snapshot."""
        self.queue_length.labels(queue="engine").set(snap.get("kvpage:num_requests_waiting", 0.0))
        usage = snap.get("kvpage:kv_cache_usage_perc", 0.0)
        self.kv_util.labels(kind="actual").set(usage)
        self.kv_bytes.labels(kind="used").set(usage * self.kv_total_bytes)
        q = snap.get("kvpage:prefix_cache_queries_total", 0.0)
        h = snap.get("kvpage:prefix_cache_hits_total", 0.0)
        self.hit_ratio.set(h / q if q > 0 else 0.0)

    def set_degraded(self, degraded: bool) -> None:
        """Record a degradation state change."""
        self.degraded.set(1 if degraded else 0)
        self.degradation_transitions.labels(to="degraded" if degraded else "normal").inc()
