"""The metrics of :class:`~kvpage.engine.engine.LLMEngine`: the metric names, the
step timing counters (:class:`StepStats`, fed by one :class:`StepTimer` per step) and
:func:`collect_metrics` (what ``LLMEngine.get_metrics`` returns).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpage.cache.explain import MISS_REASONS

if TYPE_CHECKING:
    from kvpage.cache import KVCacheManager
    from kvpage.cache.tiered import TieredCache
    from kvpage.engine.output_processor import RequestCounters
    from kvpage.engine.scheduler import Scheduler, SchedulerOutput
    from kvpage.engine.spec_decode import SpecDecodeStats

#: names of the engine metrics (the server exports the same; Prometheus style)
METRIC_NAMES = (
    "kvpage:kv_cache_usage_perc",
    "kvpage:num_requests_running",
    "kvpage:num_requests_waiting",
    "kvpage:prefix_cache_queries_total",
    "kvpage:prefix_cache_hits_total",
    "kvpage:num_preemptions_total",
    "kvpage:block_allocation_failures_total",
    "kvpage:evictions_total",
    "kvpage:prompt_tokens_total",
    "kvpage:generation_tokens_total",
    "kvpage:requests_rejected_total",
    "kvpage:kv_retained_blocks",
)
#: a hybrid model's recurrent-state metrics (``kvpage.cache.state_pool``), present in
#: ``get_metrics`` when the model has state layers
STATE_METRIC_NAMES = (
    "kvpage:state_slots_used",
    "kvpage:state_slots_total",
    "kvpage:state_live_slots_used",
    "kvpage:state_snapshots",
    "kvpage:state_snapshots_taken_total",
    "kvpage:state_snapshot_hits_total",
    "kvpage:state_snapshot_evictions_total",
    "kvpage:state_host_snapshots",
    "kvpage:state_host_snapshot_hits_total",
    "kvpage:state_disk_snapshots",
    "kvpage:state_disk_snapshot_hits_total",
    "kvpage:state_disk_snapshot_refusals_total",
)
#: the labelled counter of first admissions by cache-miss reason: ``get_metrics`` keys
#: are ``f'{CACHE_MISS_METRIC}{{reason="{r}"}}'`` for every r in ``kvpage.cache.MISS_REASONS``
CACHE_MISS_METRIC = "kvpage:cache_miss_reasons_total"
#: the ``get_metrics`` keys of :data:`CACHE_MISS_METRIC`, after :data:`METRIC_NAMES`
CACHE_MISS_KEYS = tuple(f'{CACHE_MISS_METRIC}{{reason="{r}"}}' for r in MISS_REASONS)

#: per-tier metric name templates (``{tier}`` = ``host`` or ``disk``), present in
#: ``get_metrics`` for each configured KV tier (``EngineConfig.kv_*_tier_bytes``)
TIER_METRIC_TEMPLATES = (
    "kvpage:kv_tier_{tier}_usage_bytes",
    "kvpage:kv_tier_{tier}_capacity_bytes",
    "kvpage:kv_tier_{tier}_blocks",
    "kvpage:kv_tier_{tier}_hit_tokens_total",
    "kvpage:kv_tier_{tier}_promotions_total",
    "kvpage:kv_tier_{tier}_demotions_total",
    "kvpage:kv_tier_{tier}_drops_total",
    "kvpage:kv_tier_{tier}_corrupt_total",
    "kvpage:kv_tier_{tier}_write_errors_total",
    "kvpage:kv_tier_{tier}_bytes_in_total",
    "kvpage:kv_tier_{tier}_bytes_out_total",
    "kvpage:kv_tier_{tier}_transfer_seconds_total",
)

#: speculative decoding's counters (vLLM's ``vllm:spec_decode_*_total`` counters with kvpage's
#: prefix), present in ``get_metrics`` when ``EngineConfig.speculative_config`` is set
SPEC_DECODE_METRIC_NAMES = (
    "kvpage:spec_decode_num_drafts_total",
    "kvpage:spec_decode_num_draft_tokens_total",
    "kvpage:spec_decode_num_accepted_tokens_total",
)


class StepTimer:
    """The laps of one step, in ``time.perf_counter`` seconds: started at creation,
    each :meth:`lap` closes one stage."""

    __slots__ = ("_last", "laps")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.laps: list[float] = []

    def lap(self) -> float:
        """Close the current stage; returns its seconds (also appended to ``laps``)."""
        now = time.perf_counter()
        d = now - self._last
        self._last = now
        self.laps.append(d)
        return d


@dataclass
class StepStats:
    """Cumulative timing and token counts of ``LLMEngine.step`` (wall seconds from
    ``time.perf_counter``).

    Attributes:
        schedule_s: in ``Scheduler.schedule`` (admission, allocation, preemption).
        model_s: in ``ModelRunner.execute`` (metadata tensors, plan, forward).
        sample_s: in the sampler.
        update_s: in ``Scheduler.update`` (commit, append, stop checks, fork, free).
        output_s: building the RequestOutputs (timings, stop strings, text).
        prefill_tokens / decode_tokens: tokens computed as prompt (or recompute) chunks
            and as decode tokens (one per sequence, or its last token and drafts with
            speculative decoding).
    """

    num_steps: int = 0
    num_seqs: int = 0
    schedule_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    output_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_batch_size: int = 0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.model_s + self.sample_s + self.update_s + self.output_s

    @property
    def bookkeeping_share(self) -> float:
        """Share of step time in scheduling and block bookkeeping: ``Scheduler.schedule``
        (admission, allocation, preemption) plus ``Scheduler.update`` (commit, append,
        free), over all step time."""
        t = self.total_s
        return (self.schedule_s + self.update_s) / t if t > 0 else 0.0

    def record(self, out: SchedulerOutput, laps: Sequence[float]) -> None:
        """Add one step: plan ``out`` and its stage laps (schedule, model, sample,
        update, output seconds, as :class:`StepTimer` measured them)."""
        decode = prefill = 0
        for s in out.scheduled:
            if s.num_tokens == 1 and s.start >= s.request.num_prompt_tokens:
                decode += 1
            elif s.draft_token_ids:
                decode += s.num_tokens
            else:
                prefill += s.num_tokens
        self.num_steps += 1
        self.schedule_s += laps[0]
        self.model_s += laps[1]
        self.sample_s += laps[2]
        self.update_s += laps[3]
        self.output_s += laps[4]
        self.num_seqs += len(out.scheduled)
        self.decode_tokens += decode
        self.prefill_tokens += prefill
        self.last_batch_size = len(out.scheduled)


def collect_metrics(
    kv: KVCacheManager,
    scheduler: Scheduler,
    tiers: TieredCache | None,
    counters: RequestCounters,
    spec: SpecDecodeStats | None = None,
) -> dict[str, float]:
    """Current values of :data:`METRIC_NAMES`: KV usage as a fraction in [0, 1]
    (cached-but-unreferenced blocks count as free), running/waiting sequences, and
    counters since the engine started (prefix cache queries/hits in tokens), the
    free blocks held at a raised retention priority, and first admissions by
    cache-miss reason (:data:`CACHE_MISS_METRIC`, one key per reason); plus, per
    configured KV tier, :data:`TIER_METRIC_TEMPLATES` (bytes, blocks, tokens,
    seconds), and with swap preemption ``kvpage:swap_*`` (space in use, swap-outs,
    swap-ins, victims recomputed instead, bytes moved: KV blocks and, on a hybrid model,
    live recurrent states; transfer seconds), and with
    speculative decoding (``spec``) :data:`SPEC_DECODE_METRIC_NAMES` (sequence-steps
    that drafted, draft tokens verified, draft tokens accepted), and for a hybrid model
    (recurrent state layers) :data:`STATE_METRIC_NAMES` (state slots used / total, live
    slots used, snapshots held, snapshots taken, prefix hits served from a snapshot,
    snapshots evicted; host rows and disk files holding snapshots, hits promoted from
    them, disk snapshot files refused on read)."""
    st = kv.stats
    reasons = scheduler.miss_reasons
    misses = {k: float(reasons.get(r, 0)) for k, r in zip(CACHE_MISS_KEYS, MISS_REASONS)}
    out = {
        "kvpage:kv_cache_usage_perc": float(kv.usage),
        "kvpage:num_requests_running": float(scheduler.num_running),
        "kvpage:num_requests_waiting": float(scheduler.num_waiting),
        "kvpage:prefix_cache_queries_total": float(st.prefix_queries_tokens),
        "kvpage:prefix_cache_hits_total": float(st.prefix_hits_tokens),
        "kvpage:num_preemptions_total": float(scheduler.num_preemptions),
        "kvpage:block_allocation_failures_total": float(st.allocation_failures),
        "kvpage:evictions_total": float(st.evictions),
        "kvpage:prompt_tokens_total": float(counters.prompt_tokens),
        "kvpage:generation_tokens_total": float(counters.generation_tokens),
        "kvpage:requests_rejected_total": float(counters.rejected),
        "kvpage:kv_retained_blocks": float(kv.num_retained_blocks),
        **misses,
    }
    pool = kv.state
    if pool is not None:
        ps = pool.stats
        out["kvpage:state_slots_used"] = float(pool.num_live_used + pool.num_snapshots)
        out["kvpage:state_slots_total"] = float(pool.num_slots)
        out["kvpage:state_live_slots_used"] = float(pool.num_live_used)
        out["kvpage:state_snapshots"] = float(pool.num_snapshots)
        out["kvpage:state_snapshots_taken_total"] = float(ps.snapshots_taken)
        out["kvpage:state_snapshot_hits_total"] = float(ps.snapshot_hits)
        out["kvpage:state_snapshot_evictions_total"] = float(ps.snapshot_evictions)
        out["kvpage:state_host_snapshots"] = float(pool.num_host_used)
        out["kvpage:state_host_snapshot_hits_total"] = float(ps.host_snapshot_hits)
        out["kvpage:state_disk_snapshots"] = float(pool.num_disk_used)
        out["kvpage:state_disk_snapshot_hits_total"] = float(ps.disk_snapshot_hits)
        out["kvpage:state_disk_snapshot_refusals_total"] = float(ps.disk_snapshot_refusals)
    if spec is not None:
        out["kvpage:spec_decode_num_drafts_total"] = float(spec.num_drafts)
        out["kvpage:spec_decode_num_draft_tokens_total"] = float(spec.num_draft_tokens)
        out["kvpage:spec_decode_num_accepted_tokens_total"] = float(spec.num_accepted_tokens)
    sw = scheduler.swapper
    if sw is not None:
        ss = sw.stats
        out["kvpage:swap_space_usage_bytes"] = float(sw.used_bytes)
        out["kvpage:swap_outs_total"] = float(ss.swap_outs)
        out["kvpage:swap_ins_total"] = float(ss.swap_ins)
        out["kvpage:swap_recomputed_total"] = float(ss.recomputed)
        out["kvpage:swap_bytes_total"] = float(ss.bytes_out + ss.bytes_in)
        out["kvpage:swap_transfer_seconds_total"] = float(ss.transfer_s)
    if tiers is not None:
        for t in tiers.tiers:
            ts = t.stats
            vals = (
                t.used_bytes,
                t.capacity_bytes,
                len(t),
                ts.hits_tokens,
                ts.promotions,
                ts.demotions,
                ts.drops,
                ts.corrupt,
                ts.write_errors,
                ts.bytes_in,
                ts.bytes_out,
                ts.transfer_s,
            )
            for tpl, v in zip(TIER_METRIC_TEMPLATES, vals):
                out[tpl.format(tier=t.name)] = float(v)
    return out


__all__ = [
    "CACHE_MISS_KEYS",
    "STATE_METRIC_NAMES",
    "CACHE_MISS_METRIC",
    "METRIC_NAMES",
    "SPEC_DECODE_METRIC_NAMES",
    "TIER_METRIC_TEMPLATES",
    "StepStats",
    "StepTimer",
    "collect_metrics",
]
