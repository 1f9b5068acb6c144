"""Discrete-event replay of a request trace through the real scheduler and cache manager.

No weights and no kernels: the real ``kvpage.engine.Scheduler`` plans every step over the
real ``kvpage.cache.KVCacheManager`` (or a contiguous-reservation allocator with the same
interface, :mod:`kvpage.sim.contiguous`), and the step's duration comes from
:class:`kvpage.sim.costmodel.StepCostModel`. Token ids come from
:class:`kvpage.workload.traces.TokenMapper`, so Mooncake requests that share hash ids share
exact prefixes and the prefix cache sees the trace's real reuse.

Event loop: the clock jumps to the next arrival when nothing runs; arrivals up to the
clock are submitted (rejections counted by reason); one ``schedule()`` -> cost model ->
clock advances by the step time -> ``update()`` with each request's next trace output
token (``ignore_eos``, ``max_tokens`` = the trace's output length; a request with 0
output tokens in the trace generates 1, as the engine's ``max_tokens >= 1``). A request's
first token time is the end of the step that sampled it. Requests the scheduler refuses
(empty prompt, prompt longer than ``max_model_len``, ...) are counted in
``SimResult.rejected`` by reason, not simulated.

Policies (same slots for all; see :data:`POLICIES`): ``contiguous-max``,
``contiguous-pow2``, ``contiguous-oracle`` (reserve max_model_len / next power of two /
the true final length at admission), ``paged`` (on-demand blocks), ``paged-prefix``
(on-demand blocks + prefix caching).

Metrics: effective KV utilization = slots holding live tokens / slots reserved, averaged
over steps weighted by step time (paged: reserved = used blocks x block_size, live =
reserved minus the unwritten tail of each request's last block; contiguous: reserved =
sum of reservations, live = allocated positions); peak KV usage (reserved / all slots);
peak batch size; throughput (output tokens / makespan); TTFT and TPOT percentiles
(TPOT = (finish - first token) / (outputs - 1)); preemptions; allocation failures
(``allocate`` calls that returned None, including admission attempts the scheduler retries
each step while the queue head does not fit);
prefix hit ratio (prompt tokens served from the prefix cache at each request's *first*
admission / prompt tokens of finished requests — comparable to the traces' "causal" hit
ratio; ``extra["prefix_hit_pct_incl_readmissions"]`` is the cache manager's own counter,
which also counts a preempted request re-finding its own blocks).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvpage.cache.explain import aggregate_misses
from kvpage.cache.state_pool import split_state_memory
from kvpage.capacity import plan_capacity, resolve_model, shard_cache_spec
from kvpage.errors import SpecError
from kvpage.sim.config import POLICIES, RECURRENT_STATE_MODES, SimConfig
from kvpage.sim.costmodel import StepCostModel, get_gpu
from kvpage.sim.instance import SimInstance
from kvpage.specs import CacheSpec
from kvpage.specs.engine_config import check_engine_field
from kvpage.specs.hf import hf_attention_shape
from kvpage.specs.moe import moe_parameter_count, moe_params_from_hf
from kvpage.stats import summarize
from kvpage.workload.traces import TokenMapper, Trace, TraceRequest


@dataclass
class SimResult:
    """Outcome of one simulation (times in seconds, utilizations in %)."""

    policy: str
    block_size: int
    num_slots: int
    requests: int
    finished: int
    rejected: dict[str, int]
    steps: int
    makespan_s: float
    throughput_tok_s: float
    total_throughput_tok_s: float
    effective_kv_util_pct: float
    peak_kv_usage_pct: float
    peak_batch: int
    mean_batch: float
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    preemptions: int
    allocation_failures: int
    prefix_hit_pct: float
    evictions: int
    extra: dict[str, Any] = field(default_factory=dict)
    #: finished requests by cache-miss reason (``kvpage.cache.explain.aggregate_misses``;
    #: empty for the contiguous policies, which have no prefix cache)
    miss_reasons: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_setup(cfg: SimConfig) -> tuple[CacheSpec, StepCostModel, int, int]:
    """Pool spec, cost model, max_model_len and pool slots for a config.

    Raises:
        SpecError: unknown policy/model/GPU, a pool that does not fit, a field shared
            with the engine that breaks the engine's rule (:data:`ENGINE_FIELDS`), or
            ``time_scale`` not a finite number > 0.
    """
    if cfg.policy not in POLICIES:
        raise SpecError(f"policy: expected one of {POLICIES}, got {cfg.policy!r}")
    _check_config(cfg)
    src = resolve_model(cfg.model)
    gpu = get_gpu(cfg.gpu)
    if cfg.kv_pool not in ("unified", "per_group"):
        raise SpecError(f"kv_pool: expected 'unified' or 'per_group', got {cfg.kv_pool!r}")
    tp = cfg.tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SpecError(f"tp: expected an int >= 1, got {tp!r}")
    spec = CacheSpec.from_hf_config(
        src.hf_config,
        block_size=cfg.block_size,
        kv_dtype=cfg.kv_dtype,  # type: ignore[arg-type]
        kv_pool=cfg.kv_pool,  # type: ignore[arg-type]
    )
    if tp > 1:  # one rank's layers (an MLA latent: the whole of it)
        spec = shard_cache_spec(spec, tp)
    plan = plan_capacity(
        cfg.model,
        device_bytes=gpu.memory_bytes,
        utilization=cfg.utilization,
        kv_dtype=cfg.kv_dtype,
        block_size=cfg.block_size,
        kv_pool=cfg.kv_pool,
        weight_bytes=cfg.weight_bytes,
        tp=tp,
    )
    if src.num_parameters is None:  # plan_capacity refuses this without weight bytes
        raise SpecError(f"model: expected a countable parameter count, got {src.param_error}")
    nb = cfg.num_blocks if cfg.num_blocks is not None else plan.num_blocks
    state_bytes = spec.state_bytes_per_sequence
    if state_bytes:
        _check_state_config(cfg)
        if cfg.num_blocks is None:
            nb = _hybrid_num_blocks(cfg, spec, plan.kv_budget_bytes)
    spec = spec.with_blocks(nb)
    if state_bytes and cfg.recurrent_state == "free":  # the attention-only bound
        spec = spec.model_copy(update={"state_layers": ()})
    a = spec.layers[0]
    active = cfg.active_parameters or active_parameters(src.hf_config, src.num_parameters)
    cost = StepCostModel(  # one rank: 1/tp of the weights, parameters and query heads
        num_parameters=-(-src.num_parameters // tp),
        weight_bytes=-(-plan.weight_bytes // tp),
        num_layers=spec.num_layers,
        num_q_heads=a.num_q_heads,
        head_dim=a.head_dim,
        kv_bytes_per_token=spec.bytes_per_token,
        gpu=gpu,
        flops_efficiency=cfg.flops_efficiency,
        bandwidth_efficiency=cfg.bandwidth_efficiency,
        step_overhead_s=cfg.step_overhead_s,
        active_parameters=-(-active // tp),
        state_bytes_per_sequence=state_bytes,
        layer_windows=tuple(
            (spec.layer_bytes_per_token(i), x.sliding_window) for i, x in enumerate(spec.layers)
        ),
    )
    mml = cfg.max_model_len or src.max_model_len
    # token slots: a unified pool's block holds one of its G groups' layers
    g = len(spec.kv_groups) if spec.kv_pool == "unified" else 1
    return spec, cost, mml, (nb - 1) * cfg.block_size // g


def _check_state_config(cfg: SimConfig) -> None:
    """Refuse, by name, what a simulated hybrid model does not support (the engine's
    rules: ``kvpage.engine.config``)."""
    if cfg.recurrent_state not in RECURRENT_STATE_MODES:
        raise SpecError(
            f"recurrent_state: expected one of {RECURRENT_STATE_MODES}, got {cfg.recurrent_state!r}"
        )
    if not cfg.policy.startswith("paged"):
        raise SpecError(
            f"policy: expected a paged policy for a model with recurrent state layers "
            f"(the contiguous allocators hold no state slots), got {cfg.policy!r}"
        )


def _hybrid_num_blocks(cfg: SimConfig, spec: CacheSpec, budget: int) -> int:
    """KV blocks (incl. the null block) of a hybrid model: the engine's rule for a byte
    budget (``kvpage.engine.config``): ``kvpage.cache.state_pool.split_state_memory``
    takes the live state slots' bytes (``max_num_seqs`` x state bytes) first and splits
    the rest ``state_snapshot_share : 1 - share`` between snapshots and KV blocks (the
    snapshot count: ``kvpage.sim.instance.snapshot_slots``).

    Raises:
        SpecError: fewer than 2 KV blocks fit.
    """
    sb = spec.state_bytes_per_sequence
    kv, _ = split_state_memory(budget, sb, cfg.max_num_seqs, cfg.state_snapshot_share)
    nb = (kv - spec.fixed_scale_bytes) // spec.bytes_per_block
    if nb < 2:
        raise SpecError(
            f"max_num_seqs: expected room for {cfg.max_num_seqs} live recurrent states "
            f"({sb:,} bytes each) and 2 KV blocks in {budget:,} bytes, got {nb} blocks"
        )
    return int(nb)


def active_parameters(hf_config: dict[str, Any], num_parameters: int) -> int:
    """Parameters one token passes: all of them for a dense model; a MoE model
    (``kvpage.specs.moe``) less, per sparse layer, the ``num_experts - top_k`` routed
    experts the token is not routed to (each ``moe_parameter_count`` of one expert less
    its router row). The router and a shared expert are counted (every token computes
    all the logits and runs the shared expert). DeepSeek-V3: 37.55e9 of 671.03e9 (the
    model card: 37B activated).

    Raises:
        SpecError: invalid MoE fields (``moe_params_from_hf``).
    """
    shape = hf_attention_shape(hf_config)
    moe = moe_params_from_hf(hf_config, shape.num_layers)
    if moe is None:
        return num_parameters
    h = shape.hidden_size
    # one routed expert: the count of a 1-expert layer without the shared expert (which
    # every token runs: DeepSeek-V3, Qwen3-Next) less its router row (h, + 1 bias)
    alone = replace(moe, num_experts=1, shared_intermediate_size=0, shared_expert_gate=False)
    row = h + (1 if moe.bias or moe.routing == "noaux_tc" else 0)
    one = moe_parameter_count(alone, h) - row
    idle = len(moe.sparse_layers) * (moe.num_experts - moe.top_k) * one
    return max(1, num_parameters - idle)


#: SimConfig fields that are engine fields: checked by the engine's rules
#: (``kvpage.specs.engine_config.FIELD_RULES``; ``kv_dtype`` is ``kv_cache_dtype``)
ENGINE_FIELDS = {
    "block_size": "block_size",
    "num_blocks": "num_blocks",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "seed": "seed",
    "kv_dtype": "kv_cache_dtype",
    "kv_host_tier_bytes": "kv_host_tier_bytes",
    "kv_disk_tier_bytes": "kv_disk_tier_bytes",
    "preemption_mode": "preemption_mode",
    "swap_space_bytes": "swap_space_bytes",
    "state_snapshot_share": "state_snapshot_share",
    "state_share_threshold": "state_share_threshold",
    "state_predicted_share": "state_predicted_share",
    "state_decode_snapshots": "state_decode_snapshots",
}


def _check_config(cfg: SimConfig) -> None:
    for sim_name, engine_name in ENGINE_FIELDS.items():
        try:
            check_engine_field(engine_name, getattr(cfg, sim_name))
        except SpecError as e:
            raise SpecError(str(e).replace(engine_name, sim_name, 1)) from None
    ts = cfg.time_scale
    if (
        isinstance(ts, bool)
        or not isinstance(ts, (int, float))
        or not (math.isfinite(ts) and ts > 0)
    ):
        raise SpecError(f"time_scale: expected a finite number > 0, got {ts!r}")


def simulate(trace: Trace | list[TraceRequest], cfg: SimConfig) -> SimResult:
    """Replay ``trace`` under ``cfg`` (see the module docstring).

    Raises:
        SpecError: bad config (see :func:`build_setup`).
    """
    reqs = list(trace.requests if isinstance(trace, Trace) else trace)
    spec, cost, mml, slots = build_setup(cfg)
    final = {r.request_id: r.prompt_tokens + max(r.output_tokens, 1) for r in reqs}
    hb = trace.hash_block_tokens if isinstance(trace, Trace) else 512
    mapper = TokenMapper(seed=cfg.seed, vocab_size=cfg.vocab_size, hash_block_tokens=hb)
    inst = SimInstance(cfg, spec, cost, mml, slots, mapper, final)
    arrivals = [(r.arrival_s * cfg.time_scale, i) for i, r in enumerate(reqs)]
    heapq.heapify(arrivals)
    t_first = arrivals[0][0] if arrivals else 0.0
    while arrivals or inst.has_unfinished():
        if cfg.max_steps is not None and inst.steps >= cfg.max_steps:
            break
        if not inst.has_unfinished() and arrivals and arrivals[0][0] > inst.t:
            inst.t = arrivals[0][0]
        while arrivals and arrivals[0][0] <= inst.t:
            at, i = heapq.heappop(arrivals)
            inst.submit(reqs[i], at)
        if not inst.step():
            if arrivals:
                inst.t = max(inst.t, arrivals[0][0])
                continue
            if inst.abort_unschedulable():  # cannot ever be admitted
                continue
            break
    return instance_result(inst, len(reqs), t_first, slots)


def instance_result(inst: SimInstance, num_requests: int, t_first: float, slots: int) -> SimResult:
    """The :class:`SimResult` of one instance whose first arrival was ``t_first``."""
    cfg = inst.cfg
    makespan = max(inst.t - t_first, 1e-12)
    st = inst.kv.stats
    hit_all = st.prefix_hits_tokens / st.prefix_queries_tokens if st.prefix_queries_tokens else 0.0
    steps = inst.steps
    return SimResult(
        policy=cfg.policy,
        block_size=cfg.block_size,
        num_slots=slots,
        requests=num_requests,
        finished=inst.finished,
        rejected=dict(inst.rejected),
        steps=steps,
        makespan_s=makespan,
        throughput_tok_s=inst.out_tokens / makespan,
        total_throughput_tok_s=(inst.out_tokens + inst.prompt_tokens) / makespan,
        effective_kv_util_pct=100.0 * inst.util_w / inst.busy if inst.busy else 0.0,
        peak_kv_usage_pct=100.0 * inst.peak_usage / slots,
        peak_batch=inst.peak_batch,
        mean_batch=inst.batch_sum / steps if steps else 0.0,
        ttft_s=summarize(inst.ttft),
        tpot_s=summarize(inst.tpot),
        preemptions=inst.sched.num_preemptions,
        allocation_failures=st.allocation_failures,
        prefix_hit_pct=100.0 * inst.first_hit / inst.first_query if inst.first_query else 0.0,
        evictions=st.evictions,
        extra={
            "prefix_hit_pct_incl_readmissions": 100.0 * hit_all,
            **_tier_extra(inst),
            **_state_extra(inst),
        },
        miss_reasons=aggregate_misses(inst.misses),
    )


def _state_extra(inst: SimInstance) -> dict[str, Any]:
    """Recurrent-state counters for ``SimResult.extra`` (empty without state layers):
    ``state`` = the pool's slot counts, ``StatePoolStats``, the snapshot memory share
    (device snapshot slots' bytes / (KV blocks + live state slots + snapshot slots
    bytes)), the host snapshot rows (``host_snapshot_rows`` and their bytes, host memory
    beside the host KV tier), snapshot hits by tier (``snapshot_hits_device``,
    ``snapshot_hits_host``: restores of a promoted host snapshot), and ``copies``: the
    state slot copies by kind with their seconds (``kvpage.sim.tiers.StateCopyMeter``)
    and ``copy_time_share_pct`` = their seconds / all steps' seconds."""
    from kvpage.cache import KVCacheManager

    kvm = inst.kv
    if not isinstance(kvm, KVCacheManager) or kvm.state is None:
        return {}
    pool, spec = kvm.state, kvm.spec
    sb = spec.state_bytes_per_sequence
    kv = (spec.num_blocks - 1) * spec.bytes_per_block
    snap = pool.num_snapshot_slots * sb
    total = kv + pool.num_live_slots * sb + snap
    st = pool.stats
    out: dict[str, Any] = {
        "live_slots": pool.num_live_slots,
        "snapshot_slots": pool.num_snapshot_slots,
        "state_bytes_per_sequence": sb,
        "snapshot_memory_share_pct": 100.0 * snap / total if total else 0.0,
        "host_snapshot_rows": pool.num_host_snapshots,
        "host_snapshot_bytes": pool.num_host_snapshots * sb,
        "snapshot_hits_device": st.snapshot_hits - st.host_snapshot_hits,
        "snapshot_hits_host": st.host_snapshot_hits,
        **asdict(st),
    }
    meter = inst.state_copies
    if meter is not None:
        out["copies"] = {
            "counts": dict(meter.counts),
            "seconds": dict(meter.seconds),
            "total_s": meter.total_s,
            "copy_time_share_pct": 100.0 * meter.total_s / inst.step_s if inst.step_s else 0.0,
        }
    return {"state": out}


def _tier_extra(inst: SimInstance) -> dict[str, Any]:
    """Tier and swap counters for ``SimResult.extra`` (empty without them)."""
    meter = inst.meter
    if meter is None:
        return {}
    out: dict[str, Any] = {"transfer_s": meter.total_s}
    tiers = getattr(inst.kv, "tiers", None)
    if tiers is not None:
        out["tiers"] = {k: asdict(v) for k, v in tiers.stats().items()}
    if inst.sched.swapper is not None:
        out["swap"] = asdict(inst.sched.swapper.stats)
    return out


__all__ = [
    "POLICIES",
    "SimConfig",
    "SimResult",
    "active_parameters",
    "build_setup",
    "instance_result",
    "simulate",
]
