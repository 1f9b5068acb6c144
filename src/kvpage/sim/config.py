"""What one simulated instance runs: :class:`SimConfig` and the allocation policies
(:data:`POLICIES`); the simulator (:mod:`kvpage.sim.simulator`) documents both."""

from __future__ import annotations

from dataclasses import dataclass

#: SimConfig.recurrent_state values
RECURRENT_STATE_MODES = ("snapshots", "free")

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
        kv_pool: ``unified`` (one block pool for every KV group) or ``per_group``
            (``kvpage.specs.CacheSpec.kv_pool``).
        weight_bytes: bytes of the weights on the device (they size the KV budget and
            are read once per step by the cost model); None = ``num_parameters x`` the
            model dtype's bytes (``kvpage.capacity.plan_capacity``). Give it for
            quantized checkpoints (gpt-oss-120b's MXFP4 experts: ~65 GB).
        active_parameters: parameters one token passes, for the cost model's FLOPs; None
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
    kv_pool: str = "unified"
    weight_bytes: int | None = None
    active_parameters: int | None = None
    recurrent_state: str = "snapshots"
    state_snapshot_share: float = 0.1
    state_share_threshold: int = 2
    state_predicted_share: float = 0.25


__all__ = ["POLICIES", "RECURRENT_STATE_MODES", "SimConfig"]
