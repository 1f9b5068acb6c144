"""The engine replica deployment: one ``LLMEngine`` behind Ray Serve.

:class:`EngineReplica` is a plain class; :func:`kvpage.cluster.launch.build_app` turns
it into a Ray Serve deployment per replica group (``serve.deployment(...)``), so the
Ray options come from the deployment file. Each replica runs the server's engine loop
(:class:`kvpage.server.engine_loop.AsyncEngine`: one thread owns the engine) and a
:class:`kvpage.routing.publisher.KVEventPublisher` on the engine's KV cache manager. The
publisher is drained on the engine thread after every step (it is not thread-safe);
the drained batches wait in a queue until the ingress pulls them with
:meth:`EngineReplica.kv_events` (one consumer, in order, so sequence numbers arrive
without gaps unless a batch is really lost).

Methods called by the ingress (all through the group's deployment handle and the
custom router, see :mod:`kvpage.cluster.router`; ``route`` is the routing hint the
router reads and the replica ignores):

* ``generate(request_id, prompt, params, route)`` -- async generator of the engine's
  ``RequestOutput`` objects (cumulative, as ``LLMEngine.step`` returns them); an engine
  failure arrives as a ``{"failure": message, "oom": bool}`` item, an engine refusal
  as a single ``{"rejected": message, "reason": reason}`` item. Cancelling the stream aborts the
  request in the engine.
* ``kv_events(route)`` -- drained event batches (``to_dict`` form; at least a heartbeat
  batch every :data:`HEARTBEAT_S`), the load and the engine metrics.
* ``kv_snapshot(route)`` -- a full snapshot (``KVSnapshot.to_dict``) for a resync.
* ``info(route)`` -- cache facts and the tokenizer (the ingress validates with it),
  the resolved engine configuration and the host's facts (``/admin/config``).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.errors import RequestRejected
from kvpage.server.engine_client import PromptInput
from kvpage.server.engine_loop import AsyncEngine, EngineFailure, StepStats

__all__ = ["EngineReplica", "replica_load"]

#: drained batches a replica keeps for the ingress; older ones are dropped (the ingress
#: then sees a sequence gap and resyncs from a snapshot: nothing goes silently stale)
MAX_PENDING_BATCHES = 4096

#: a report carries at least a heartbeat batch this often (seconds), so a lost last
#: batch is noticed (as a gap) within it even when the replica is quiet
HEARTBEAT_S = 2.0


def replica_load(metrics: dict[str, float]) -> dict[str, float]:
    """The load fields the router uses, from ``LLMEngine.get_metrics()``."""
    return {
        "num_running": float(metrics.get("kvpage:num_requests_running", 0.0)),
        "num_waiting": float(metrics.get("kvpage:num_requests_waiting", 0.0)),
        "kv_usage": float(metrics.get("kvpage:kv_cache_usage_perc", 0.0)),
    }


class EngineReplica:
    """One engine replica of a group.

    Args:
        group: the replica group's name (a metrics label).
        engine_kwargs: ``LLMEngine.from_config`` keyword arguments
            (``kvpage.server.config.EngineConfig.engine_kwargs()``).
        replica_id: the id used in KV events; default the Ray Serve replica's unique id
            (the id the router knows it by).
    """

    def __init__(
        self, group: str, engine_kwargs: dict[str, Any], replica_id: str | None = None
    ) -> None:
        from kvpage.engine import LLMEngine
        from kvpage.routing.publisher import KVEventPublisher

        if replica_id is None:
            from ray import serve

            replica_id = serve.get_replica_context().replica_id.unique_id
        self.replica_id = replica_id
        self.group = group
        self.engine_kwargs = dict(engine_kwargs)
        self.engine = LLMEngine.from_config(**engine_kwargs)
        self.publisher = KVEventPublisher(replica_id)
        self.publisher.attach(self.engine.kv_cache_manager)
        self._batches: collections.deque[Any] = collections.deque(maxlen=MAX_PENDING_BATCHES)
        self._lock = threading.Lock()
        self._last_sent = 0.0  # time.monotonic() of the last report carrying a batch
        self.loop = AsyncEngine(self.engine, on_step=self._on_step)

    # ------------------------------------------------------------ engine thread
    def _on_step(self, st: StepStats) -> None:
        self._drain()

    def _drain(self, heartbeat: bool = False) -> None:
        batch = self.publisher.drain(heartbeat=heartbeat)
        if batch is not None:
            with self._lock:
                self._batches.append(batch)

    def _ensure_started(self) -> None:
        if not self.loop.running:
            self.loop.start(asyncio.get_running_loop())

    # ------------------------------------------------------------ calls
    async def generate(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        route: Any = None,  # the router's hint (a JSON dict), unused here
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput | dict[str, Any]]:
        """Run one request; yield its ``RequestOutput`` objects (see module doc);
        ``priority`` is the scheduling priority the ingress resolved for its tenant."""
        self._ensure_started()
        try:
            q = await self.loop.add(request_id, prompt, params, priority=priority)
        except RequestRejected as exc:  # sent as data: the exception does not pickle
            yield {"rejected": str(exc), "reason": exc.reason}
            return
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, EngineFailure):
                    finished = True
                    yield {"failure": str(out), "oom": out.oom}
                    return
                finished = bool(out.finished)
                yield out
        finally:
            if not finished:  # the ingress cancelled the stream (client gone, failure)
                self.loop.abort_nowait(request_id)

    async def kv_events(self, route: Any = None) -> dict[str, Any]:
        """Pending KV event batches (oldest first), the load and the engine metrics."""
        self._ensure_started()
        now = time.monotonic()
        beat = now - self._last_sent >= HEARTBEAT_S
        if beat or not self.engine.has_unfinished_requests():
            # an idle engine runs no step that would drain the publisher (e.g. after an
            # abort); a heartbeat (an empty batch with the next seq) lets the ingress
            # notice a lost last batch within HEARTBEAT_S. Drained on the engine thread.
            await self.loop.call(lambda _e: self._drain(heartbeat=beat))
        with self._lock:
            batches = list(self._batches)
            self._batches.clear()
        if batches:
            self._last_sent = now
        metrics = dict(self.loop.metrics_snapshot)
        return {
            "replica_id": self.replica_id,
            "group": self.group,
            "batches": [b.to_dict() for b in batches],
            "load": replica_load(metrics),
            "metrics": metrics,
        }

    async def kv_snapshot(self, route: Any = None) -> dict[str, Any]:
        """The publisher's full snapshot, taken on the engine thread between steps."""
        self._ensure_started()
        snap = await self.loop.call(lambda _e: self.publisher.snapshot())
        return dict(snap.to_dict())

    async def info(self, route: Any = None) -> dict[str, Any]:
        """Cache facts and the tokenizer for the ingress; ``engine_config``: the engine
        section with what this replica's start-up decided pinned
        (:func:`kvpage.server.resolved.resolve_engine`), ``machine``: its host's facts."""
        from kvpage.server.config import EngineConfig
        from kvpage.server.resolved import machine_facts, resolve_engine

        self._ensure_started()
        e = self.engine
        spec = e.cache_spec
        return {
            "replica_id": self.replica_id,
            "group": self.group,
            "tokenizer": e.tokenizer,
            # generation_config.json request defaults (the ingress validates requests)
            "default_sampling_params": dict(e.default_sampling_params),
            "generation_config_path": e.generation_config_path,
            "block_size": int(spec.block_size),
            "num_blocks": int(spec.num_blocks),
            "kv_dtype": str(spec.kv_dtype),
            "total_bytes": int(spec.total_bytes),
            "max_model_len": int(e.scheduler.max_model_len),
            "max_num_seqs": int(e.scheduler.max_num_seqs),
            "backend_name": str(e.backend_name),
            "hash_seed": int(e.kv_cache_manager.hash_seed),
            "engine_config": resolve_engine(
                EngineConfig.model_validate(self.engine_kwargs), e
            ).model_dump(mode="json"),
            "machine": machine_facts(),
        }

    def __del__(self) -> None:  # replica shutdown: stop the engine thread (bounded)
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout_s=5.0)
