"""KV tiers and swap in the simulator: a transfer-cost model, the real tier code with
data-free payloads, and a timing-free tiered prefix-cache study.

Transfer-cost model (:class:`TransferPreset`, presets in :data:`TRANSFER_PRESETS`): a
block moved between device and host memory costs ``bytes / host_bandwidth``; a block
read from the disk tier costs ``bytes / disk_read_bandwidth`` (the disk is the slower
link of disk -> host -> device). Demotions (device -> host copies of evicted blocks,
host -> disk writes; ``TieredCache.flush`` batches a step's evictions into one copy,
called once per step by ``kvpage.sim.instance`` as by the engine) are assumed
overlapped with compute (a side stream and a background
writer, as vLLM's offloading connector and LMCache store asynchronously) and cost no
step time. In :func:`kvpage.sim.simulator.simulate` the step time becomes
``cost_model.step_time + transfers of the step`` for promotions (host or disk),
swap-outs and swap-ins, not overlapped with compute (an upper bound: a real engine can
prefetch a waiting request's blocks while others compute).

The simulated tiers are the engine's own (``kvpage.cache.tiered.TieredCache`` over the
simulated ``KVCacheManager``, ``kvpage.engine.swap.Swapper`` for swap) with
:class:`NullMover` payloads: zero-copy numpy views of the right size, so byte accounting
is exact and nothing is allocated; the disk tier is :class:`SimDiskTier`, the same LRU
rules without files.

A hybrid model's state slot copies (snapshots taken and restored, host snapshot rows
demoted and promoted; ``kvpage.cache.state_pool``) are costed by
:class:`StateCopyMeter` and charged to the step whose copy queue runs them. With a host
KV tier the simulated ``StatePool`` has the engine's host snapshot rows
(``kvpage.capacity.host_snapshot_rows``; ``kvpage.sim.instance.make_allocator``).

:func:`simulate_tiered_eviction` extends ``kvpage.sim.eviction`` (timing-free, whole
trace, 512-token hash blocks) to a chain of LRU tiers: device (kvpage's order), host,
disk, exclusive (a block lives in one tier; a hit moves it to the device; each tier's
LRU victims go one tier down, the last tier's are dropped). It reports hits per tier
and a service-time TTFT per request (prefill of the missed tokens on the cost model +
the transfer of the hit blocks from their tiers; no queueing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpage.cache.hashing import BlockHash
from kvpage.cache.tier_store import DiskTier, Payload, _InMemoryTier, payload_nbytes
from kvpage.errors import SpecError
from kvpage.sim.costmodel import StepCostModel
from kvpage.workload.traces import Trace


@dataclass(frozen=True)
class TransferPreset:
    """Link speeds of the tiers, bytes/s.

    Attributes:
        name: preset name.
        host_bandwidth: one direction of a pinned host <-> device copy.
        disk_read_bandwidth: sequential read of the disk tier's device.
        disk_write_bandwidth: sequential write (background; reported, not charged).
        source: where the numbers come from.
    """

    name: str
    host_bandwidth: float
    disk_read_bandwidth: float
    disk_write_bandwidth: float
    source: str


TRANSFER_PRESETS: dict[str, TransferPreset] = {
    "pcie4-nvme": TransferPreset(
        "pcie4-nvme",
        25e9,
        6e9,
        4e9,
        "PCIe 4.0 x16 is 32 GB/s raw per direction; ~25 GB/s is the usual pinned-copy "
        "figure (A100 hosts). NVMe PCIe 4.0 SSDs are rated ~7 GB/s sequential read and "
        "~5 GB/s write (vendor datasheets); 6 / 4 GB/s assumed sustained.",
    ),
    "pcie5-nvme": TransferPreset(
        "pcie5-nvme",
        50e9,
        12e9,
        10e9,
        "PCIe 5.0 x16 (H100/H200 PCIe hosts) is 64 GB/s raw per direction, ~50 GB/s "
        "assumed; NVMe PCIe 5.0 SSDs are rated ~14 GB/s read / ~12 GB/s write, 12 / 10 "
        "assumed.",
    ),
    "nvlink-c2c-nvme": TransferPreset(
        "nvlink-c2c-nvme",
        400e9,
        12e9,
        10e9,
        "Grace Hopper NVLink-C2C is 900 GB/s total (450 per direction), 400 GB/s "
        "assumed; disk as pcie5-nvme.",
    ),
}


def get_transfer_preset(name: str) -> TransferPreset:
    """The preset ``name``.

    Raises:
        SpecError: unknown name (the message lists the presets).
    """
    p = TRANSFER_PRESETS.get(name)
    if p is None:
        raise SpecError(
            f"transfer preset: expected one of {sorted(TRANSFER_PRESETS)}, got {name!r}"
        )
    return p


class NullMover:
    """A BlockMover without data: payloads are zero-copy read-only views of
    ``block_nbytes`` bytes (exact byte accounting, nothing allocated)."""

    def __init__(self, block_nbytes: int) -> None:
        self.block_nbytes = block_nbytes
        self._payload = np.broadcast_to(np.zeros(1, np.uint8), (block_nbytes,))

    def read_blocks(self, block_ids: Sequence[int]) -> list[Payload]:
        return [self._payload for _ in block_ids]

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[Payload]) -> None:
        return None


class NullStateMover:
    """A ``kvpage.engine.swap.StateMover`` without data: a hybrid model's swapped live
    state slot is a zero-copy read-only view of ``slot_nbytes`` bytes
    (``CacheSpec.state_bytes_per_sequence``), so swap counts its bytes exactly. The
    queued state slot copies that swap preemption runs early (``copy_slots``) go to
    ``copies`` (a :class:`StateCopyMeter`, which costs them), when given."""

    def __init__(self, slot_nbytes: int, copies: StateCopyMeter | None = None) -> None:
        self.slot_nbytes = slot_nbytes
        self._payload = np.broadcast_to(np.zeros(1, np.uint8), (slot_nbytes,))
        self.copies = copies

    def read_slot(self, slot: int) -> Payload:
        return self._payload

    def write_slot(self, slot: int, payload: Payload) -> None:
        return None

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        if self.copies is not None:
            self.copies.add(pairs)


@dataclass
class StateCopyMeter:
    """Seconds of a hybrid model's recurrent-state slot copies (the ``StatePool``'s
    ordered copy queue, ``kvpage.cache.state_pool``: snapshots taken, prefix-hit
    restores, forks, host snapshot demotions and promotions), charged to the step in
    which the engine runs them (before its forward, in queue order, not overlapped).

    Cost of one copy of ``state_bytes`` (``CacheSpec.state_bytes_per_sequence``):

    * device -> device (both slots ``< num_slots``): ``2 x state_bytes /
      device_bandwidth`` (the slot read and written once, the cost model's memory
      roofline: ``device_bandwidth`` = the GPU preset's datasheet bandwidth x
      ``bandwidth_efficiency``, ``kvpage.sim.costmodel``);
    * device <-> host (a slot ``>= num_slots`` is host row ``slot - num_slots``):
      ``state_bytes / host_bandwidth`` (one direction of the pinned host link, the
      transfer preset's ``host_bandwidth`` and its source, :data:`TRANSFER_PRESETS`).
      Unlike the KV tier's batched demotions (free, on a side stream), a snapshot's
      demotion is charged: the engine runs it in the copy queue before the slot's reuse.

    Attributes:
        state_bytes: bytes of one slot.
        num_slots: the pool's device slots (live + snapshot).
        device_bandwidth, host_bandwidth: bytes/s.
        counts: copies by kind (``device``, ``host_in`` = host -> device,
            ``host_out`` = device -> host).
        seconds: their seconds by the same kinds.
    """

    state_bytes: int
    num_slots: int
    device_bandwidth: float
    host_bandwidth: float
    counts: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host_in": 0, "host_out": 0}
    )
    seconds: dict[str, float] = field(
        default_factory=lambda: {"device": 0.0, "host_in": 0.0, "host_out": 0.0}
    )
    _pending_s: float = 0.0

    def add(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Count and cost the copies ``pairs`` (``(src, dst)`` slots); their seconds go
        to the next :meth:`step_seconds`."""
        n, b = self.num_slots, self.state_bytes
        for src, dst in pairs:
            if src < n and dst < n:
                kind, s = "device", 2 * b / self.device_bandwidth
            else:
                kind, s = ("host_in" if src >= n else "host_out"), b / self.host_bandwidth
            self.counts[kind] += 1
            self.seconds[kind] += s
            self._pending_s += s

    def step_seconds(self) -> float:
        """Seconds of the copies added since the previous call."""
        s, self._pending_s = self._pending_s, 0.0
        return s

    @property
    def total_s(self) -> float:
        """Seconds of every copy added so far."""
        return sum(self.seconds.values())


class SimDiskTier(_InMemoryTier, DiskTier):
    """The disk tier's LRU and capacity rules in memory (no files): ``put`` stores,
    ``get`` returns the payload and keeps it (inclusive), never corrupt; ``discard`` is
    the host tier's (``_InMemoryTier``)."""

    def __init__(self, capacity_bytes: int) -> None:  # no directory, no fingerprint
        _InMemoryTier.__init__(self, capacity_bytes)
        self.writable = True
        self.last_write_error = ""

    def _shrink(self, need: int) -> None:
        while self._sizes and self.used_bytes + need > self.capacity_bytes:
            h, sz = self._sizes.popitem(last=False)
            self.used_bytes -= sz
            del self._data[h]
            self._emit_dropped(h, "capacity")

    def put(self, block_hash: BlockHash, payload: Payload) -> bool:
        if block_hash in self._sizes:
            self._sizes.move_to_end(block_hash)
            return True
        n = payload_nbytes(payload)
        if n > self.capacity_bytes:
            return False
        self._shrink(n)
        self._sizes[block_hash] = n
        self._data[block_hash] = payload
        self.used_bytes += n
        self.stats.bytes_in += n
        self._emit_demoted(block_hash)
        return True

    def get(self, block_hash: BlockHash) -> Any:
        sz = self._sizes.get(block_hash)
        if sz is None:
            return None
        self._sizes.move_to_end(block_hash)
        self.stats.bytes_out += sz
        self._emit_promoted(block_hash)
        return self._data[block_hash]


@dataclass
class TransferMeter:
    """Turns the tiers' and the swapper's byte counters into per-step transfer seconds
    (module docstring). Call :meth:`step_seconds` once per step."""

    preset: TransferPreset
    sources: list[Any] = field(default_factory=list)
    total_s: float = 0.0
    _last: dict[str, int] = field(default_factory=dict)

    def _counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for src in self.sources:
            name = getattr(src, "name", "swap")
            st = src.stats
            out[f"{name}_in"] = st.bytes_in
            out[f"{name}_out"] = st.bytes_out
        return out

    def step_seconds(self) -> float:
        """Seconds of the transfers since the previous call."""
        now = self._counters()
        d = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        p = self.preset
        # demotions (host_in, disk_in) run on a side stream / in the background: free
        host_bytes = d.get("host_out", 0) + d.get("swap_in", 0) + d.get("swap_out", 0)
        s = host_bytes / p.host_bandwidth + d.get("disk_out", 0) / p.disk_read_bandwidth
        self.total_s += s
        return s


# ---- timing-free tiered study ------------------------------------------------------------
@dataclass
class TieredEvictionResult:
    """Outcome of :func:`simulate_tiered_eviction`.

    Attributes:
        capacities_blocks: per tier (device, host, disk), hash blocks (None = unbounded).
        block_hit_pct: hit blocks / prompt blocks, %, all tiers.
        block_hit_pct_by_tier: the same split by the tier the block was found in.
        ttft_s: service-time TTFT ``p50``, ``p90``, ``p95``, ``mean`` in seconds (empty
            without a cost model).
        transfer_s: seconds of tier transfers in those TTFTs, summed.
    """

    capacities_blocks: list[int | None]
    block_hit_pct: float
    block_hit_pct_by_tier: dict[str, float]
    ttft_s: dict[str, float]
    transfer_s: float


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    p50, p90, p95 = np.percentile(a, [50, 90, 95])
    return {"p50": float(p50), "p90": float(p90), "p95": float(p95), "mean": float(a.mean())}


def simulate_tiered_eviction(
    trace: Trace,
    capacities_blocks: Sequence[int | None],
    *,
    cost: StepCostModel | None = None,
    block_bytes: int = 0,
    preset: TransferPreset | None = None,
) -> TieredEvictionResult:
    """The chain-of-LRU-tiers model (module docstring) over ``trace``.

    Args:
        trace: a trace with hash ids (Mooncake).
        capacities_blocks: one capacity per tier, device first (1 to 3 tiers; 0 = no
            such tier; None = unbounded).
        cost: step cost model for the TTFT; None = no TTFT.
        block_bytes: bytes of one hash block's KV (for transfers).
        preset: link speeds (needed with ``cost``).

    Raises:
        SpecError: no tiers, a negative capacity, or a trace without hash ids.
    """
    names = ["device", "host", "disk"][: len(capacities_blocks)]
    if not names or any(c is not None and c < 0 for c in capacities_blocks):
        raise SpecError(f"capacities_blocks: expected 1-3 capacities >= 0, got {capacities_blocks}")
    if not trace.has_hash_ids:
        raise SpecError(f"trace: expected hash ids (Mooncake format), got {trace.format!r}")
    caps = [(1 << 62) if c is None else c for c in capacities_blocks]
    tiers: list[OrderedDict[int, None]] = [OrderedDict() for _ in names]
    hb = trace.hash_block_tokens
    hits = [0] * len(names)
    total = 0
    ttfts: list[float] = []
    xfer_total = 0.0
    for r in trace.requests:
        h = r.hash_ids or ()
        found: list[int] = []
        for b in h:
            t = next((i for i, od in enumerate(tiers) if b in od), -1)
            if t < 0:
                break
            found.append(t)
        for t in found:
            hits[t] += 1
        total += len(h)
        if cost is not None and preset is not None:
            hit_tok = min(len(found) * hb, max(r.prompt_tokens - 1, 0))
            xfer = 0.0
            for t in found:
                if t == 1:
                    xfer += block_bytes / preset.host_bandwidth
                elif t == 2:
                    xfer += block_bytes / preset.disk_read_bandwidth
            xfer_total += xfer
            ttfts.append(cost.step_time([max(r.prompt_tokens - hit_tok, 1)], [hit_tok]) + xfer)
        # the request's blocks all go to the device (last block first: kvpage's order)
        dev = tiers[0]
        for b in reversed(h):
            for od in tiers[1:]:
                od.pop(b, None)
            if b in dev:
                dev.move_to_end(b)
            else:
                dev[b] = None
        protect = set(h)  # the device keeps the request's own blocks if it can
        for i, od in enumerate(tiers):
            while len(od) > caps[i]:
                b = next(iter(od))
                if i == 0 and b in protect:  # (the rule of kvpage.sim.eviction's LRU)
                    od.move_to_end(b)
                    if len(protect) < len(od):
                        continue
                b, _ = od.popitem(last=False)
                if i + 1 < len(tiers) and caps[i + 1] > 0:
                    tiers[i + 1][b] = None
    tot = max(total, 1)
    return TieredEvictionResult(
        list(capacities_blocks),
        100.0 * sum(hits) / tot,
        {n: 100.0 * k / tot for n, k in zip(names, hits)},
        _percentiles(ttfts),
        xfer_total,
    )


__all__ = [
    "TRANSFER_PRESETS",
    "NullMover",
    "NullStateMover",
    "SimDiskTier",
    "StateCopyMeter",
    "TieredEvictionResult",
    "TransferMeter",
    "TransferPreset",
    "get_transfer_preset",
    "simulate_tiered_eviction",
]


def attach_sim_tiers(
    cfg: Any,
    spec: Any,
    kv: Any,
    sched: Any,
    cost: StepCostModel,
    state_copies: StateCopyMeter | None = None,
) -> TransferMeter | None:
    """Put the engine's tiers and swapper (with :class:`NullMover` payloads of
    ``spec.bytes_per_block`` bytes) under a simulation's cache manager and scheduler, as
    ``cfg`` (a ``SimConfig``) asks; returns the meter of their transfers, or None when
    ``cfg`` asks for neither. Swap's prefill rate is the cost model's for one
    ``max_num_batched_tokens`` chunk; on a hybrid model swap also moves each victim's
    live state (:class:`NullStateMover` of ``spec.state_bytes_per_sequence`` bytes),
    counted in the swap bytes and their transfer time; the state copies swap runs early
    go to ``state_copies`` (:class:`StateCopyMeter`) when given.

    Raises:
        SpecError: tiers or swap with a contiguous policy (no block pool), swap on a
            model without attention layers, an unknown transfer preset (the tier fields' own rules are checked by ``build_setup``).
    """
    from kvpage.cache import KVCacheManager
    from kvpage.cache.tier_store import HostTier
    from kvpage.cache.tiered import TieredCache
    from kvpage.engine.swap import SwapCostModel, Swapper

    host_b, disk_b = cfg.kv_host_tier_bytes, cfg.kv_disk_tier_bytes
    swap = cfg.preemption_mode == "swap"
    if not (host_b or disk_b or swap):
        return None
    if not isinstance(kv, KVCacheManager):
        raise SpecError(
            f"policy: expected a paged policy with KV tiers or swap, got {cfg.policy!r}"
        )
    meter = TransferMeter(get_transfer_preset(cfg.transfer_preset))
    mover = NullMover(spec.bytes_per_block)
    if host_b or disk_b:
        tiers = TieredCache(
            kv.pools[0],
            mover,
            host=HostTier(host_b) if host_b else None,
            disk=SimDiskTier(disk_b) if disk_b else None,
        )
        tiers.admission_chunk_tokens = cfg.max_num_batched_tokens
        kv.attach_tiers(tiers)
        meter.sources.extend(tiers.tiers)
    if swap:
        if not spec.layers:
            raise SpecError(
                "preemption_mode: expected 'recompute' for a model of recurrent layers only "
                "(swap serves KV groups and their state), got 'swap'"
            )
        chunk = cfg.max_num_batched_tokens
        rate = chunk / cost.step_time([chunk], [0])
        state_b = spec.state_bytes_per_sequence
        # per KV group its layers' bytes per block (a unified pool: bytes_per_block)
        movers = [
            NullMover(spec.block_size * sum(spec.layer_bytes_per_token(i) for i in g.layer_ids))
            for g in spec.kv_groups
        ]
        sw = Swapper(
            movers,
            spec.block_size,
            cfg.swap_space_bytes,
            SwapCostModel(meter.preset.host_bandwidth, rate),
            state=NullStateMover(state_b, state_copies) if state_b else None,
        )
        sched.swapper = sw
        meter.sources.append(sw)
    return meter


__all__ += ["attach_sim_tiers"]
