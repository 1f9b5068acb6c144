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
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvpage.cache.explain import CacheMissExplanation, aggregate_misses
from kvpage.cache.protocol import KVAllocator
from kvpage.capacity import plan_capacity, resolve_model
from kvpage.errors import RequestRejected, SpecError
from kvpage.sim.contiguous import ContiguousAllocator
from kvpage.sim.costmodel import StepCostModel, get_gpu
from kvpage.sim.tiers import TransferMeter, attach_sim_tiers
from kvpage.specs import CacheSpec
from kvpage.stats import summarize
from kvpage.workload.traces import TokenMapper, Trace, TraceRequest

if TYPE_CHECKING:
    from kvpage.engine.request import Request

POLICIES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged", "paged-prefix")


@dataclass
class SimConfig:
    """What to simulate.

    Attributes:
        model: preset name or config.json (see ``kvpage.capacity.resolve_model``).
        gpu: GPU preset name (``kvpage.sim.costmodel.GPU_PRESETS``).
        policy: one of :data:`POLICIES`.
        block_size: tokens per block (paged policies).
        kv_dtype: KV storage dtype.
        utilization: fraction of GPU memory for weights + KV.
        num_blocks: override the pool size (blocks incl. the null block); None = plan it
            from the GPU memory with ``kvpage.capacity.plan_capacity``.
        max_model_len: longest sequence; None = the model's.
        max_num_seqs, max_num_batched_tokens: scheduler limits.
        time_scale: arrival times are multiplied by this (< 1 = more load).
        flops_efficiency, bandwidth_efficiency, step_overhead_s: cost-model knobs.
        seed, vocab_size: the token mapping (``TokenMapper``).
        max_steps: stop after this many steps (None = run to completion).
        kv_host_tier_bytes, kv_disk_tier_bytes: KV tiers below the pool (paged
            policies; the engine's tier code, ``kvpage.sim.tiers``), 0 = none.
        transfer_preset: link speeds of tier and swap transfers
            (``kvpage.sim.tiers.TRANSFER_PRESETS``), charged to the step time.
        preemption_mode: ``recompute`` or ``swap`` (``kvpage.engine.swap``).
        swap_space_bytes: host bytes for swapped-out sequences (default 4 GiB, vLLM's
            ``swap_space`` default).
    """

    model: str = "llama-3-8b"
    gpu: str = "H100-80GB"
    policy: str = "paged-prefix"
    block_size: int = 16
    kv_dtype: str = "auto"
    utilization: float = 0.9
    num_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    time_scale: float = 1.0
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    seed: int = 0
    vocab_size: int = 32000
    max_steps: int | None = None
    kv_host_tier_bytes: int = 0
    kv_disk_tier_bytes: int = 0
    transfer_preset: str = "pcie5-nvme"
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 4 << 30


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
        SpecError: unknown policy/model/GPU, a pool that does not fit, or a bad knob
            (``block_size < 1``, ``num_blocks < 2``, ``max_model_len < 1``,
            ``time_scale`` not a finite number > 0).
    """
    if cfg.policy not in POLICIES:
        raise SpecError(f"policy: expected one of {POLICIES}, got {cfg.policy!r}")
    _check_config(cfg)
    src = resolve_model(cfg.model)
    gpu = get_gpu(cfg.gpu)
    spec = CacheSpec.from_hf_config(
        src.hf_config,
        block_size=cfg.block_size,
        kv_dtype=cfg.kv_dtype,  # type: ignore[arg-type]
    )
    plan = plan_capacity(
        cfg.model,
        device_bytes=gpu.memory_bytes,
        utilization=cfg.utilization,
        kv_dtype=cfg.kv_dtype,
        block_size=cfg.block_size,
    )
    if src.num_parameters is None:  # plan_capacity refuses this without weight bytes
        raise SpecError(f"model: expected a countable parameter count, got {src.param_error}")
    nb = cfg.num_blocks if cfg.num_blocks is not None else plan.num_blocks
    spec = spec.with_blocks(nb)
    a = spec.layers[0]
    cost = StepCostModel(
        num_parameters=src.num_parameters,
        weight_bytes=plan.weight_bytes,
        num_layers=spec.num_layers,
        num_q_heads=a.num_q_heads,
        head_dim=a.head_dim,
        kv_bytes_per_token=spec.bytes_per_token,
        gpu=gpu,
        flops_efficiency=cfg.flops_efficiency,
        bandwidth_efficiency=cfg.bandwidth_efficiency,
        step_overhead_s=cfg.step_overhead_s,
    )
    mml = cfg.max_model_len or src.max_model_len
    return spec, cost, mml, (nb - 1) * cfg.block_size


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_config(cfg: SimConfig) -> None:
    if not _is_int(cfg.block_size) or cfg.block_size < 1:
        raise SpecError(f"block_size: expected an int >= 1, got {cfg.block_size!r}")
    if cfg.num_blocks is not None and (not _is_int(cfg.num_blocks) or cfg.num_blocks < 2):
        raise SpecError(
            f"num_blocks: expected None or an int >= 2 (the null block + 1 usable block) at "
            f"block_size {cfg.block_size}, got {cfg.num_blocks!r}"
        )
    if cfg.max_model_len is not None and (not _is_int(cfg.max_model_len) or cfg.max_model_len < 1):
        raise SpecError(f"max_model_len: expected None or an int >= 1, got {cfg.max_model_len!r}")
    ts = cfg.time_scale
    if (
        isinstance(ts, bool)
        or not isinstance(ts, (int, float))
        or not (math.isfinite(ts) and ts > 0)
    ):
        raise SpecError(f"time_scale: expected a finite number > 0, got {ts!r}")


def _make_allocator(
    cfg: SimConfig, spec: CacheSpec, mml: int, slots: int, final: dict[str, int]
) -> KVAllocator:
    if cfg.policy.startswith("contiguous"):
        return ContiguousAllocator(slots, cfg.policy.split("-")[1], mml, final.__getitem__)
    from kvpage.cache import KVCacheManager

    return KVCacheManager(
        spec, enable_prefix_caching=cfg.policy == "paged-prefix", hash_seed=cfg.seed
    )


def _reserved_live(kv: KVAllocator, running: list[Request], bs: int) -> tuple[int, int]:
    if isinstance(kv, ContiguousAllocator):
        return kv.reserved_slots, kv.live_tokens()
    reserved = kv.num_used_blocks * bs
    slack = 0
    for r in running:
        if r.has_blocks:
            n = kv.num_allocated_tokens(r.request_id)
            slack += -(-n // bs) * bs - r.num_computed_tokens
    return reserved, reserved - slack


def simulate(trace: Trace | list[TraceRequest], cfg: SimConfig) -> SimResult:
    """Replay ``trace`` under ``cfg`` (see the module docstring).

    Raises:
        SpecError: bad config (see :func:`build_setup`).
    """
    from kvpage.engine.params import SamplingParams
    from kvpage.engine.request import Request
    from kvpage.engine.scheduler import Scheduler

    reqs = list(trace.requests if isinstance(trace, Trace) else trace)
    spec, cost, mml, slots = build_setup(cfg)
    final = {r.request_id: r.prompt_tokens + max(r.output_tokens, 1) for r in reqs}
    kv = _make_allocator(cfg, spec, mml, slots, final)
    sched = Scheduler(
        kv,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=mml,
    )
    meter = attach_sim_tiers(cfg, spec, kv, sched, cost)
    hb = trace.hash_block_tokens if isinstance(trace, Trace) else 512
    mapper = TokenMapper(seed=cfg.seed, vocab_size=cfg.vocab_size, hash_block_tokens=hb)
    bs = 1 if isinstance(kv, ContiguousAllocator) else cfg.block_size
    arrivals = [(r.arrival_s * cfg.time_scale, i) for i, r in enumerate(reqs)]
    heapq.heapify(arrivals)
    by_id = {r.request_id: r for r in reqs}
    arrival_t: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    first_tok: dict[str, float] = {}
    ttft: list[float] = []
    tpot: list[float] = []
    rejected: Counter[str] = Counter()
    t = 0.0
    steps = 0
    busy = util_w = 0.0
    peak_usage = peak_batch = 0
    batch_sum = 0
    out_tokens = prompt_tokens = 0
    first_hit = first_query = 0
    misses: list[CacheMissExplanation | None] = []
    finished = 0
    t_first = arrivals[0][0] if arrivals else 0.0
    while arrivals or sched.has_unfinished():
        if cfg.max_steps is not None and steps >= cfg.max_steps:
            break
        if not sched.has_unfinished() and arrivals and arrivals[0][0] > t:
            t = arrivals[0][0]
        while arrivals and arrivals[0][0] <= t:
            at, i = heapq.heappop(arrivals)
            tr = reqs[i]
            n_out = max(tr.output_tokens, 1)
            prompt = mapper.prompt(tr)
            req = Request(
                request_id=tr.request_id,
                parent_id=tr.request_id,
                sample_index=0,
                token_ids=prompt,
                num_prompt_tokens=len(prompt),
                params=SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True),
                max_tokens=min(n_out, max(mml - len(prompt), 0)),
            )
            try:
                sched.add_request(req)
            except RequestRejected as e:
                rejected[e.reason] += 1
                continue
            arrival_t[tr.request_id] = at
        out = sched.schedule()
        if out.is_empty:
            if arrivals:
                t = max(t, arrivals[0][0])
                continue
            if sched.waiting and not sched.running:  # cannot ever be admitted
                r = sched.waiting[0]
                sched.finish(r, "abort")
                rejected["unschedulable"] += 1
                continue
            break
        q = [s.num_tokens for s in out.scheduled]
        c = [s.start for s in out.scheduled]
        dt = cost.step_time(q, c)
        if meter is not None:  # tier promotions/demotions and swaps of this step
            dt += meter.step_seconds()
        t += dt
        steps += 1
        sampled: dict[str, list[int]] = {}
        for s in out.scheduled:
            if s.samples:
                rid = s.request_id
                toks = outputs.get(rid)
                if toks is None:
                    tr = by_id[rid]
                    # 0 output tokens in the trace: the request still generates 1
                    toks = outputs[rid] = mapper.output(
                        tr if tr.output_tokens else replace(tr, output_tokens=1)
                    )
                sampled[rid] = [toks[min(s.request.num_output_tokens, len(toks) - 1)]]
        _, done = sched.update(out, sampled)
        for s in out.scheduled:
            rid = s.request_id
            if s.samples and rid not in first_tok:
                first_tok[rid] = t
                ttft.append(t - arrival_t[rid])
        for r in done:
            rid = r.request_id
            n = r.num_output_tokens
            out_tokens += n
            prompt_tokens += r.num_prompt_tokens
            first_hit += max(0, r.num_cached_tokens)
            misses.append(r.cache_miss)
            first_query += r.num_prompt_tokens
            finished += 1
            if n > 1:
                tpot.append((t - first_tok[rid]) / (n - 1))
            outputs.pop(rid, None)
            sched.release(r.parent_id)
        reserved, live = _reserved_live(kv, sched.running, bs)
        if reserved:
            util_w += dt * live / reserved
            busy += dt
        peak_usage = max(peak_usage, reserved)
        peak_batch = max(peak_batch, len(q))
        batch_sum += len(q)
    makespan = max(t - t_first, 1e-12)
    st = kv.stats
    hit_all = st.prefix_hits_tokens / st.prefix_queries_tokens if st.prefix_queries_tokens else 0.0
    return SimResult(
        policy=cfg.policy,
        block_size=cfg.block_size,
        num_slots=slots,
        requests=len(reqs),
        finished=finished,
        rejected=dict(rejected),
        steps=steps,
        makespan_s=makespan,
        throughput_tok_s=out_tokens / makespan,
        total_throughput_tok_s=(out_tokens + prompt_tokens) / makespan,
        effective_kv_util_pct=100.0 * util_w / busy if busy else 0.0,
        peak_kv_usage_pct=100.0 * peak_usage / slots,
        peak_batch=peak_batch,
        mean_batch=batch_sum / steps if steps else 0.0,
        ttft_s=summarize(ttft),
        tpot_s=summarize(tpot),
        preemptions=sched.num_preemptions,
        allocation_failures=st.allocation_failures,
        prefix_hit_pct=100.0 * first_hit / first_query if first_query else 0.0,
        evictions=st.evictions,
        extra={
            "prefix_hit_pct_incl_readmissions": 100.0 * hit_all,
            **_tier_extra(kv, sched, meter),
        },
        miss_reasons=aggregate_misses(misses),
    )


def _tier_extra(kv: KVAllocator, sched: Any, meter: TransferMeter | None) -> dict[str, Any]:
    """Tier and swap counters for ``SimResult.extra`` (empty without them)."""
    if meter is None:
        return {}
    out: dict[str, Any] = {"transfer_s": meter.total_s}
    tiers = getattr(kv, "tiers", None)
    if tiers is not None:
        out["tiers"] = {k: asdict(v) for k, v in tiers.stats().items()}
    if sched.swapper is not None:
        out["swap"] = asdict(sched.swapper.stats)
    return out


__all__ = ["POLICIES", "SimConfig", "SimResult", "build_setup", "simulate"]
