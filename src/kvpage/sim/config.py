"""What one simulated instance runs: :class:`SimConfig` and the allocation policies
(:data:`POLICIES`); the simulator (:mod:`kvpage.sim.simulator`) documents both.

A field the simulator shares with the engine takes its default from the engine's
``EngineConfig`` (:data:`ENGINE_DEFAULTS`), so each default is written once, and is
checked by the engine's rule (``kvpage.specs.engine_config.FIELD_RULES``, applied by
the simulator). Two shared fields default differently on purpose: the simulator models
a GPU server, the engine's defaults are sized for a CPU machine (:data:`GPU_DEFAULTS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpage.specs.engine_config import EngineConfig

#: SimConfig.recurrent_state values
RECURRENT_STATE_MODES = ("snapshots", "free")

POLICIES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged", "paged-prefix")


def _engine_default(name: str) -> Any:
    """The default of engine field ``name`` (``EngineConfig.model_fields``)."""
    return EngineConfig.model_fields[name].default


#: SimConfig field -> the engine field whose default it takes (``kv_dtype`` is
#: ``kv_cache_dtype``)
ENGINE_DEFAULTS: dict[str, str] = {
    "block_size": "block_size",
    "kv_dtype": "kv_cache_dtype",
    "num_blocks": "num_blocks",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "seed": "seed",
    "kv_host_tier_bytes": "kv_host_tier_bytes",
    "kv_disk_tier_bytes": "kv_disk_tier_bytes",
    "preemption_mode": "preemption_mode",
    "kv_pool": "kv_pool",
    "state_snapshot_share": "state_snapshot_share",
    "state_share_threshold": "state_share_threshold",
    "state_predicted_share": "state_predicted_share",
    "state_decode_snapshots": "state_decode_snapshots",
}
#: shared fields whose simulator default is a GPU server's, not the engine's CPU one:
#: vLLM's defaults on a GPU (a step budget of 8192 tokens, ``swap_space`` 4 GiB)
GPU_DEFAULTS: dict[str, int] = {
    "max_num_batched_tokens": 8192,
    "swap_space_bytes": 4 << 30,
}


@dataclass
class SimConfig:
    """What to simulate.

    Attributes:
        model: preset name or config.json (see ``kvpage.capacity.resolve_model``).
        gpu: GPU preset name (``kvpage.sim.costmodel.GPU_PRESETS``).
        policy: one of :data:`POLICIES`.
        block_size: tokens per block (paged policies). The engine's default, like every
            field of :data:`ENGINE_DEFAULTS`.
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
            ``swap_space`` default; :data:`GPU_DEFAULTS`).
        kv_pool: ``unified`` (one block pool for every KV group) or ``per_group``
            (``kvpage.specs.CacheSpec.kv_pool``).
        weight_bytes: bytes of the model's weights, all ranks together (each rank holds
            ``weight_bytes / tp``: they size its KV budget and are read once per step by
            the cost model); None = ``num_parameters x`` the model dtype's bytes
            (``kvpage.capacity.plan_capacity``). Give it for quantized checkpoints
            (gpt-oss-120b's MXFP4 experts: ~65 GB; DeepSeek-V3 in FP8: 671e9).
        tp: tensor-parallel degree (>= 1). One rank is simulated: its KV cache is
            ``kvpage.capacity.shard_cache_spec``'s (KV heads split over the ranks; an
            MLA latent is not split: every rank holds all of it), its memory holds
            ``weight_bytes / tp``, and the cost model charges ``1 / tp`` of the
            parameters, active parameters, weight bytes and query heads. The ranks'
            all-reduces are not modelled (step times are a lower bound for ``tp > 1``).
        active_parameters: parameters one token passes (all ranks), for the cost
            model's FLOPs; None
            = ``kvpage.sim.simulator.active_parameters`` of the config (all of them for
            a family without MoE fields the spec compiler reads, e.g. ``qwen3_next``).
        recurrent_state: hybrid models (``CacheSpec.state_layers``) only:
            ``snapshots`` = live state slots and prefix-cache snapshots in a
            ``kvpage.cache.state_pool.StatePool`` (a hit needs a snapshot at its end);
            ``free`` = the attention-only bound (no state memory, no snapshots: every
            KV prefix hit counts, the KV blocks those of ``snapshots``).
        state_snapshot_share: fraction of the memory left after the live state slots
            that holds snapshots (the rest: KV blocks), in [0, 1).
        state_share_threshold, state_predicted_share: the snapshot policy's
            ``share_threshold`` and ``predicted_share``
            (``kvpage.cache.snapshot_policy.SnapshotPolicy``).
        state_decode_snapshots: the policy's ``decode_snapshots``.
    """

    model: str = "llama-3-8b"
    gpu: str = "H100-80GB"
    policy: str = "paged-prefix"
    block_size: int = _engine_default("block_size")
    kv_dtype: str = _engine_default("kv_cache_dtype")
    utilization: float = 0.9
    num_blocks: int | None = _engine_default("num_blocks")
    max_model_len: int | None = _engine_default("max_model_len")
    max_num_seqs: int = _engine_default("max_num_seqs")
    max_num_batched_tokens: int = GPU_DEFAULTS["max_num_batched_tokens"]
    time_scale: float = 1.0
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    seed: int = _engine_default("seed")
    vocab_size: int = 32000
    max_steps: int | None = None
    kv_host_tier_bytes: int = _engine_default("kv_host_tier_bytes")
    kv_disk_tier_bytes: int = _engine_default("kv_disk_tier_bytes")
    transfer_preset: str = "pcie5-nvme"
    preemption_mode: str = _engine_default("preemption_mode")
    swap_space_bytes: int = GPU_DEFAULTS["swap_space_bytes"]
    kv_pool: str = _engine_default("kv_pool")
    weight_bytes: int | None = None
    tp: int = 1
    active_parameters: int | None = None
    recurrent_state: str = "snapshots"
    state_snapshot_share: float = _engine_default("state_snapshot_share")
    state_share_threshold: int = _engine_default("state_share_threshold")
    state_predicted_share: float = _engine_default("state_predicted_share")
    state_decode_snapshots: bool = _engine_default("state_decode_snapshots")


__all__ = ["ENGINE_DEFAULTS", "GPU_DEFAULTS", "POLICIES", "RECURRENT_STATE_MODES", "SimConfig"]
