"""One simulated engine instance: the real scheduler and allocator, a clock, the metrics.

:class:`SimInstance` is the step loop body of :func:`kvpage.sim.simulator.simulate`
(module docstring there: cost model, token mapping, metrics) cut out so that the
single-instance simulator and the multi-instance cluster (:mod:`kvpage.sim.cluster`) run
the same code. The caller owns the arrivals: it submits requests (:meth:`submit`) at
their arrival time and calls :meth:`step` while :meth:`has_unfinished`; each step
advances the instance's clock ``t`` by the cost model's step time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpage.cache.explain import CacheMissExplanation
from kvpage.cache.protocol import KVAllocator
from kvpage.errors import RequestRejected
from kvpage.sim.config import SimConfig
from kvpage.sim.contiguous import ContiguousAllocator
from kvpage.sim.costmodel import StepCostModel
from kvpage.sim.tiers import StateCopyMeter, attach_sim_tiers, get_transfer_preset
from kvpage.specs import CacheSpec
from kvpage.workload.traces import TokenMapper, TraceRequest

if TYPE_CHECKING:
    from kvpage.engine.request import Request


def snapshot_slots(cfg: SimConfig, spec: CacheSpec) -> int:
    """Snapshot slots of a hybrid model's pool (0 without state layers): the engine's
    ``kvpage.cache.state_pool.snapshot_slots_for`` with the KV blocks' bytes (so the
    snapshots get ``share / (1 - share)`` of them, the memory
    ``kvpage.sim.simulator.build_setup`` left for them), at most one per usable block."""
    from kvpage.cache.state_pool import snapshot_slots_for

    sb = spec.state_bytes_per_sequence
    if not sb:
        return 0
    kv = (spec.num_blocks - 1) * spec.bytes_per_block
    return snapshot_slots_for(sb, cfg.state_snapshot_share, spec.num_blocks - 1, kv_bytes=kv)


def host_snapshot_rows(cfg: SimConfig, spec: CacheSpec) -> int:
    """Host snapshot rows of a hybrid model's pool beside the host KV tier (0 without
    state layers, a host tier or prefix caching): the engine's
    ``kvpage.capacity.host_snapshot_rows`` of ``cfg.kv_host_tier_bytes`` with
    :func:`snapshot_slots` device snapshot slots."""
    from kvpage.capacity import host_snapshot_rows as rows

    sb = spec.state_bytes_per_sequence
    if not sb:
        return 0
    return rows(
        cfg.kv_host_tier_bytes,
        sb,
        cfg.state_snapshot_share,
        num_snapshot_slots=snapshot_slots(cfg, spec),
        prefix_caching=cfg.policy == "paged-prefix",
    )


def make_allocator(
    cfg: SimConfig, spec: CacheSpec, mml: int, slots: int, final: dict[str, int]
) -> KVAllocator:
    """The allocator of ``cfg.policy`` (contiguous-* or the paged KVCacheManager; on a
    hybrid model with the engine's ``StatePool``: :func:`snapshot_slots` device
    snapshot slots and :func:`host_snapshot_rows` host rows)."""
    if cfg.policy.startswith("contiguous"):
        return ContiguousAllocator(slots, cfg.policy.split("-")[1], mml, final.__getitem__)
    from kvpage.cache import KVCacheManager

    pool = None
    if spec.state_layers:  # hybrid: live state slots + snapshots (the engine's pool)
        from kvpage.cache.snapshot_policy import SnapshotPolicy
        from kvpage.cache.state_pool import StatePool

        policy = SnapshotPolicy(
            spec.block_size,
            share_threshold=cfg.state_share_threshold,
            predicted_share=cfg.state_predicted_share,
            decode_snapshots=cfg.state_decode_snapshots,
        )
        pool = StatePool(
            cfg.max_num_seqs,
            snapshot_slots(cfg, spec),
            policy,
            num_host_snapshots=host_snapshot_rows(cfg, spec),
        )
    return KVCacheManager(
        spec,
        enable_prefix_caching=cfg.policy == "paged-prefix",
        hash_seed=cfg.seed,
        max_alloc_tokens=cfg.max_num_batched_tokens,
        state_pool=pool,
    )


def _state_copy_meter(
    cfg: SimConfig, cost: StepCostModel, kv: KVAllocator
) -> StateCopyMeter | None:
    """The :class:`~kvpage.sim.tiers.StateCopyMeter` of ``kv``'s state pool (None
    without one): device copies at the cost model's achieved memory bandwidth, host
    rows at ``cfg.transfer_preset``'s host link."""
    pool = getattr(kv, "state", None)
    if pool is None:
        return None
    return StateCopyMeter(
        kv.spec.state_bytes_per_sequence,  # type: ignore[attr-defined]
        pool.num_slots,
        cost.gpu.peak_bandwidth * cost.bandwidth_efficiency,
        get_transfer_preset(cfg.transfer_preset).host_bandwidth,
    )


def reserved_live(kv: KVAllocator, running: list[Request], bs: int) -> tuple[int, int]:
    """Slots reserved and slots holding live tokens (simulator docstring, "Metrics").
    A unified pool's block holds one of its ``G`` groups' layers: its used block slots
    count ``1 / G`` token slot each (the bytes of one token in every layer)."""
    if isinstance(kv, ContiguousAllocator):
        return kv.reserved_slots, kv.live_tokens()
    g = kv.num_groups if getattr(kv, "unified", False) else 1
    reserved = kv.num_used_blocks * bs // g
    slack = 0
    for r in running:
        if r.has_blocks:
            n = kv.num_allocated_tokens(r.request_id)
            slack += -(-n // bs) * bs - r.num_computed_tokens
    return reserved, reserved - slack


class SimInstance:
    """One engine replica in simulated time.

    Args:
        cfg: the simulation config (policy, scheduler limits, block size, seed).
        spec, cost, mml, slots: from :func:`kvpage.sim.simulator.build_setup`.
        mapper: the trace's token mapping (may be shared by instances).
        final: request id -> final sequence length (the contiguous-oracle policy).

    Attributes:
        kv: the allocator (a ``KVCacheManager`` for the paged policies).
        sched: the real ``kvpage.engine.Scheduler``.
        t: the instance clock, seconds (end of its last step).
        ttft, tpot: samples in seconds, one per request (TPOT: requests with > 1 output).
        rejected: refusals by reason.
        meter: the KV tiers' and swap's transfer meter (``kvpage.sim.tiers``), or None.
        state_copies: a hybrid model's state slot copy meter
            (``kvpage.sim.tiers.StateCopyMeter``: snapshot saves, restores, host
            demotions and promotions, charged to the step time), or None.
        step_s: seconds of all steps (the sum of their step times).
        misses: the cache-miss explanation of each finished request.
    """

    def __init__(
        self,
        cfg: SimConfig,
        spec: CacheSpec,
        cost: StepCostModel,
        mml: int,
        slots: int,
        mapper: TokenMapper,
        final: dict[str, int],
    ) -> None:
        from kvpage.engine.scheduler import Scheduler

        self.cfg = cfg
        self.cost = cost
        self.mml = mml
        self.mapper = mapper
        self.kv = make_allocator(cfg, spec, mml, slots, final)
        self.sched = Scheduler(
            self.kv,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=mml,
        )
        #: state slot copies of a hybrid model (None without a StatePool)
        self.state_copies = _state_copy_meter(cfg, cost, self.kv)
        #: transfers of the KV tiers and swap (None without them), charged to step time
        self.meter = attach_sim_tiers(cfg, spec, self.kv, self.sched, cost, self.state_copies)
        self.bs = 1 if isinstance(self.kv, ContiguousAllocator) else cfg.block_size
        self.t = 0.0
        self.step_s = 0.0
        self.by_id: dict[str, TraceRequest] = {}
        self.arrival_t: dict[str, float] = {}
        self.outputs: dict[str, list[int]] = {}
        self.first_tok: dict[str, float] = {}
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.rejected: Counter[str] = Counter()
        self.steps = 0
        self.busy = self.util_w = 0.0
        self.peak_usage = self.peak_batch = 0
        self.batch_sum = 0
        self.out_tokens = self.prompt_tokens = 0
        self.first_hit = self.first_query = 0
        self.hit_blocks = self.prompt_blocks = 0
        self.finished = 0
        self.submitted = 0
        #: the cache-miss explanation of each finished request (``kvpage.cache.explain``)
        self.misses: list[CacheMissExplanation | None] = []

    def has_unfinished(self) -> bool:
        """Whether requests are waiting or running."""
        return self.sched.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    def submit(self, tr: TraceRequest, at: float, prompt: list[int] | None = None) -> bool:
        """Add ``tr`` (arrived at ``at``) to the scheduler; False (reason counted in
        ``rejected``) when the scheduler refuses it.

        Args:
            prompt: its token ids when the caller already mapped them (else mapped here).
        """
        from kvpage.engine.params import SamplingParams
        from kvpage.engine.request import Request

        n_out = max(tr.output_tokens, 1)
        if prompt is None:
            prompt = self.mapper.prompt(tr)
        req = Request(
            request_id=tr.request_id,
            parent_id=tr.request_id,
            sample_index=0,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True),
            max_tokens=min(n_out, max(self.mml - len(prompt), 0)),
        )
        try:
            self.sched.add_request(req)
        except RequestRejected as e:
            self.rejected[e.reason] += 1
            return False
        self.by_id[tr.request_id] = tr
        self.arrival_t[tr.request_id] = at
        self.submitted += 1
        return True

    def abort_unschedulable(self) -> bool:
        """When nothing runs and the queue head can never be admitted: abort it (counted
        as ``rejected["unschedulable"]``) and return True; else False."""
        s = self.sched
        if s.waiting and not s.running:
            s.finish(s.waiting[0], "abort")
            self.rejected["unschedulable"] += 1
            return True
        return False

    def step(self) -> bool:
        """One ``schedule()`` -> cost model -> clock += step time -> ``update()``.

        Returns:
            False (nothing changed) when the scheduler planned an empty step.
        """
        sched = self.sched
        out = sched.schedule()
        tiers = getattr(sched.kv, "tiers", None)
        if tiers is not None:
            tiers.flush()  # the step's batched demotion, as the engine does
        copies = self.state_copies
        if copies is not None:  # run before the forward, even of an empty step
            copies.add(out.state_copies)
        if out.is_empty:
            return False
        q = [s.num_tokens for s in out.scheduled]
        c = [s.start for s in out.scheduled]
        dt = self.cost.step_time(q, c)
        if self.meter is not None:  # tier promotions/demotions and swaps of this step
            dt += self.meter.step_seconds()
        if copies is not None:
            dt += copies.step_seconds()
        self.t += dt
        self.step_s += dt
        t = self.t
        self.steps += 1
        sampled: dict[str, list[int]] = {}
        for s in out.scheduled:
            if s.samples:
                rid = s.request_id
                toks = self.outputs.get(rid)
                if toks is None:
                    tr = self.by_id[rid]
                    # 0 output tokens in the trace: the request still generates 1
                    toks = self.outputs[rid] = self.mapper.output(
                        tr if tr.output_tokens else replace(tr, output_tokens=1)
                    )
                sampled[rid] = [toks[min(s.request.num_output_tokens, len(toks) - 1)]]
        _, done = sched.update(out, sampled)
        for s in out.scheduled:
            rid = s.request_id
            if s.samples and rid not in self.first_tok:
                self.first_tok[rid] = t
                self.ttft.append(t - self.arrival_t[rid])
        bs = self.cfg.block_size
        for r in done:
            rid = r.request_id
            n = r.num_output_tokens
            self.out_tokens += n
            self.prompt_tokens += r.num_prompt_tokens
            hit = max(0, r.num_cached_tokens)
            self.first_hit += hit
            self.first_query += r.num_prompt_tokens
            self.hit_blocks += hit // bs
            self.prompt_blocks += r.num_prompt_tokens // bs
            self.finished += 1
            self.misses.append(r.cache_miss)
            if n > 1:
                self.tpot.append((t - self.first_tok[rid]) / (n - 1))
            self.outputs.pop(rid, None)
            sched.release(r.parent_id)
        reserved, live = reserved_live(self.kv, sched.running, self.bs)
        if reserved:
            self.util_w += dt * live / reserved
            self.busy += dt
        self.peak_usage = max(self.peak_usage, reserved)
        self.peak_batch = max(self.peak_batch, len(q))
        self.batch_sum += len(q)
        return True


__all__ = [
    "SimInstance",
    "host_snapshot_rows",
    "make_allocator",
    "reserved_live",
    "snapshot_slots",
]
