"""N simulated engine instances behind one router: the routing code of ``kvpage.routing``
run at scale, without weights.

Each instance is a :class:`~kvpage.sim.instance.SimInstance` (the single-instance
simulator's real scheduler + ``KVCacheManager`` + cost model) with its own
:class:`~kvpage.routing.KVEventPublisher`; all publishers feed one
:class:`~kvpage.routing.PrefixIndex`, and the policy is built by
``kvpage.routing.make_policy`` exactly as the Ray deployment builds it.

Event loop (one global clock): the next thing to happen is either the next arrival or
the end of the earliest instance step. An arrival is mapped to tokens, hashed with
``route_request`` (the engine's block size and hash seed), routed with the loads of all
instances at that moment (running, waiting, KV usage) and submitted to the chosen
instance. A step's KV events are drained when the step ends (a heartbeat batch when
there are none) and delivered to the index ``event_delay_s`` later (default 0: at the
step's end); a refused batch (a gap) triggers a snapshot resync. The ``oracle`` policy
reads every instance's pool directly (exact, no delay).

Metrics over all instances: prefix hit ratio in blocks (blocks served from the cache at
each request's first admission / full prompt blocks of finished requests), TTFT
percentiles (``kvpage.stats.summarize``), output throughput (tokens / makespan), load
imbalance (time-weighted mean over the busy period of max/mean running requests across
instances), preemptions, per-instance finished counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpage.cache import KVCacheManager
from kvpage.errors import SpecError
from kvpage.routing import (
    POLICY_NAMES,
    CostWeights,
    KVEventBatch,
    KVEventPublisher,
    PrefixIndex,
    ReplicaLoad,
    make_policy,
    route_request,
)
from kvpage.sim.instance import SimInstance
from kvpage.sim.simulator import SimConfig, build_setup
from kvpage.stats import summarize
from kvpage.workload.traces import TokenMapper, Trace, TraceRequest


@dataclass
class ClusterResult:
    """Outcome of one multi-instance simulation (times in seconds).

    Attributes:
        router: the policy name.
        instances: N.
        requests, finished: trace requests routed / finished.
        rejected: refusals by reason (summed over instances).
        makespan_s: last step end - first arrival.
        throughput_tok_s: output tokens / makespan.
        prefix_hit_pct: hit blocks / full prompt blocks, % (module docstring).
        ttft_s: ``summarize`` of TTFT over all requests.
        imbalance: time-weighted mean of max/mean running requests across instances.
        preemptions: summed over instances.
        finished_per_instance: finished requests per instance.
        index: the PrefixIndex counters (resyncs, gaps, lag, ...).
        extra: other numbers (routing decisions that matched blocks, ...).
    """

    router: str
    instances: int
    requests: int
    finished: int
    rejected: dict[str, int]
    makespan_s: float
    throughput_tok_s: float
    prefix_hit_pct: float
    ttft_s: dict[str, float]
    imbalance: float
    preemptions: int
    finished_per_instance: list[int]
    index: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _clock_of(inst: SimInstance) -> Callable[[], float]:
    """The instance's clock as a function (the publisher stamps batches with it)."""
    return lambda: inst.t


class _Cluster:
    """The instances, publishers, index and policy of one run."""

    def __init__(
        self,
        reqs: Sequence[TraceRequest],
        cfg: SimConfig,
        mapper: TokenMapper,
        n: int,
        router: str,
        seed: int,
        cost: CostWeights | None,
        event_delay_s: float,
    ) -> None:
        spec, costm, mml, slots = build_setup(cfg)
        final = {r.request_id: r.prompt_tokens + max(r.output_tokens, 1) for r in reqs}
        self.now = 0.0
        self.ids = [f"i{k}" for k in range(n)]
        self.insts = [SimInstance(cfg, spec, costm, mml, slots, mapper, final) for _ in range(n)]
        self.index = PrefixIndex(clock=lambda: self.now)
        self.pubs: list[KVEventPublisher] = []
        for rid, inst in zip(self.ids, self.insts):
            pub = KVEventPublisher(rid, clock=_clock_of(inst))
            assert isinstance(inst.kv, KVCacheManager)
            pub.attach(inst.kv)
            self.pubs.append(pub)
            self.index.resync(pub.snapshot())
        lookup = self.exact_lookup if router == "oracle" else None
        self.policy = make_policy(router, index=self.index, seed=seed, cost=cost, lookup=lookup)
        self.delay = event_delay_s
        self.inflight: list[tuple[float, int, int, KVEventBatch]] = []  # (due, order, inst, batch)
        self._order = 0

    def exact_lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each instance's pool holds now (the oracle); on
        a hybrid model only up to its deepest state snapshot within them (a hit needs
        one at its end: ``kvpage.cache.state_pool.StatePool.deepest``)."""
        out = {}
        for rid, inst in zip(self.ids, self.insts):
            assert isinstance(inst.kv, KVCacheManager)
            pool = inst.kv.prefix_pools[0]
            m = 0
            for h in hashes:
                if not pool.is_cached(h):
                    break
                m += 1
            state = inst.kv.state
            out[rid] = m if state is None else state.deepest(hashes, m)
        return out

    def loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(rid, inst.num_running, inst.num_waiting, inst.kv.usage)
            for rid, inst in zip(self.ids, self.insts)
        ]

    def publish(self, k: int) -> None:
        """Drain instance ``k``'s events at its step end; queue them for delivery."""
        batch = self.pubs[k].drain(heartbeat=True)
        assert batch is not None
        self._order += 1
        heapq.heappush(self.inflight, (self.insts[k].t + self.delay, self._order, k, batch))

    def deliver(self, until: float) -> None:
        """Apply every queued batch due by ``until`` (resync on a refused one)."""
        fl = self.inflight
        while fl and fl[0][0] <= until:
            due, _, k, batch = heapq.heappop(fl)
            self.now = due
            if not self.index.apply(batch):
                self.index.resync(self.pubs[k].snapshot())


def simulate_cluster(
    trace: Trace | Sequence[TraceRequest],
    cfg: SimConfig,
    *,
    instances: int,
    router: str,
    seed: int = 0,
    cost: CostWeights | None = None,
    event_delay_s: float = 0.0,
) -> ClusterResult:
    """Route ``trace`` over ``instances`` simulated instances with policy ``router``.

    Args:
        trace: the requests (arrival times are multiplied by ``cfg.time_scale``).
        cfg: per-instance config; its policy must be ``paged-prefix``.
        instances: N >= 1.
        router: one of ``kvpage.routing.POLICY_NAMES``.
        seed: the policy's random draws.
        cost: ``kv_precise`` weights (None = defaults).
        event_delay_s: transport delay of KV events, seconds (>= 0).

    Raises:
        SpecError: bad N, router, delay, or a policy without prefix caching.
    """
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise SpecError(f"instances: expected an int >= 1, got {instances!r}")
    if router not in POLICY_NAMES:
        raise SpecError(f"router: expected one of {list(POLICY_NAMES)}, got {router!r}")
    if cfg.policy != "paged-prefix":
        raise SpecError(f"policy: expected 'paged-prefix' with --instances, got {cfg.policy!r}")
    if not event_delay_s >= 0:
        raise SpecError(f"event_delay_s: expected >= 0, got {event_delay_s!r}")
    reqs = list(trace.requests if isinstance(trace, Trace) else trace)
    hb = trace.hash_block_tokens if isinstance(trace, Trace) else 512
    mapper = TokenMapper(seed=cfg.seed, vocab_size=cfg.vocab_size, hash_block_tokens=hb)
    cl = _Cluster(reqs, cfg, mapper, instances, router, seed, cost, event_delay_s)
    insts, policy = cl.insts, cl.policy
    arrivals = sorted(((r.arrival_s * cfg.time_scale, i) for i, r in enumerate(reqs)))
    t_first = arrivals[0][0] if arrivals else 0.0
    busy: list[tuple[float, int]] = []  # (instance clock, instance) of instances with work
    in_busy = [False] * instances
    ai = 0
    matched_routes = 0
    imb_w = imb_t = 0.0
    last_t = t_first
    end_t = t_first
    inf = float("inf")
    while ai < len(arrivals) or busy:
        ta = arrivals[ai][0] if ai < len(arrivals) else inf
        tb = busy[0][0] if busy else inf
        now = min(ta, tb)
        # load imbalance, time-weighted, over periods with anything running
        run = [x.num_running for x in insts]
        tot = sum(run)
        if tot and now > last_t:
            imb_w += (now - last_t) * max(run) * instances / tot
            imb_t += now - last_t
        last_t = max(last_t, now)
        if ta <= tb:
            cl.deliver(ta)
            cl.now = ta
            tr = reqs[arrivals[ai][1]]
            ai += 1
            prompt = mapper.prompt(tr)
            req = route_request(prompt, block_size=cfg.block_size, hash_seed=cfg.seed)
            loads = cl.loads()
            rid = policy.choose(req, loads)
            policy.on_routed(req, rid)
            k = cl.ids.index(rid)
            if cl.index.matched_blocks(req.block_hashes).get(rid, 0):
                matched_routes += 1
            inst = insts[k]
            if not inst.submit(tr, ta, prompt):
                continue
            if not in_busy[k]:
                inst.t = max(inst.t, ta)
                heapq.heappush(busy, (inst.t, k))
                in_busy[k] = True
            continue
        _, k = heapq.heappop(busy)
        inst = insts[k]
        worked = inst.step()
        if worked:
            cl.publish(k)
            end_t = max(end_t, inst.t)
        elif not inst.abort_unschedulable():
            in_busy[k] = False  # stuck until a new request arrives for it
            continue
        if inst.has_unfinished():
            heapq.heappush(busy, (inst.t, k))
        else:
            in_busy[k] = False
    cl.deliver(inf)
    makespan = max(end_t - t_first, 1e-12)
    rejected: dict[str, int] = {}
    for x in insts:
        for key, v in x.rejected.items():
            rejected[key] = rejected.get(key, 0) + v
    hit = sum(x.hit_blocks for x in insts)
    blocks = sum(x.prompt_blocks for x in insts)
    return ClusterResult(
        router=router,
        instances=instances,
        requests=len(reqs),
        finished=sum(x.finished for x in insts),
        rejected=rejected,
        makespan_s=makespan,
        throughput_tok_s=sum(x.out_tokens for x in insts) / makespan,
        prefix_hit_pct=100.0 * hit / blocks if blocks else 0.0,
        ttft_s=summarize([v for x in insts for v in x.ttft]),
        imbalance=imb_w / imb_t if imb_t else 1.0,
        preemptions=sum(x.sched.num_preemptions for x in insts),
        finished_per_instance=[x.finished for x in insts],
        index=cl.index.stats.to_dict(),
        extra={
            "routes_with_matched_blocks": matched_routes,
            "evictions": sum(x.kv.stats.evictions for x in insts),
        },
    )


__all__ = ["ClusterResult", "simulate_cluster"]
