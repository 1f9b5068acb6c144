"""Engine construction from an :class:`EngineConfig`: model -> CacheSpec -> backend ->
caches. The config model itself, and every field's rule, is
:mod:`kvpage.specs.engine_config` (torch-free; re-exported here).

Sizing rules (documented defaults):

* ``max_model_len`` = the model's ``max_position_embeddings`` (512 for stories260K)
  unless given.
* ``num_blocks`` (of the unified pool, or per KV group with per-group pools; including
  the reserved null block): given -> used as is; else ``kv_cache_memory_bytes`` given
  -> ``(kv_cache_memory_bytes - fixed scale bytes) // bytes_per_block``; else enough
  for every sequence at full length, ``ceil(max_num_seqs * max_model_len /
  block_size) x G + 1`` (``G`` = KV groups sharing a unified pool, else 1), capped at
  :data:`DEFAULT_KV_CACHE_BYTES_CAP` bytes of cache (and at least enough for one
  full-length sequence).
* Hybrid models (recurrent state layers, ``CacheSpec.state_layers``): one live state slot
  per ``max_num_seqs`` plus snapshot slots (``kvpage.cache.state_pool``). With
  ``kv_cache_memory_bytes`` the live slots' bytes come off the budget first and the rest
  splits ``state_snapshot_share`` : ``1 - state_snapshot_share`` between snapshots and KV
  blocks (``split_state_memory``); otherwise the KV blocks are sized as above and the
  snapshots get ``share / (1 - share)`` of their bytes; either way at most one snapshot
  per usable KV block, and ``state_snapshot_slots`` overrides the count. A model of
  recurrent layers only (``mamba2``) has no KV blocks (``num_blocks`` 2, no tensors):
  its snapshots get ``share`` of ``kv_cache_memory_bytes`` after the live states, or
  else ``share / (1 - share)`` of the live states' bytes.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpage.errors import SpecError
from kvpage.specs import CacheSpec
from kvpage.specs.engine_config import DEFAULT_RETENTION_MAX_SHARE, EngineConfig

if TYPE_CHECKING:
    from kvpage.attention.metadata import KVCache
    from kvpage.attention.protocol import AttentionBackend
    from kvpage.attention.state import StateCache
    from kvpage.cache import KVCacheManager
    from kvpage.cache.tiered import TieredCache
    from kvpage.engine.runner import ModelRunner
    from kvpage.engine.scheduler import Scheduler
    from kvpage.models.model import ModelRunnerModel

#: most bytes the default (unsized) KV cache takes: 1 GiB
DEFAULT_KV_CACHE_BYTES_CAP = 1 << 30
#: CPU threads when ``num_threads`` is None: 1, the configuration that is never the
#: pathological one on a small or shared machine (see ``EngineConfig.num_threads``)
DEFAULT_NUM_THREADS = 1


def resolve_generation_config(config: EngineConfig) -> tuple[str | None, dict[str, Any]]:
    """The generation config an engine uses for request defaults.

    Returns:
        ``(folder read or None, the fields its generation_config.json sets)``:
        ``"auto"`` reads ``config.model`` when that is a folder (the bundled model and
        in-memory models have none); ``"vllm"`` / ``"none"`` read nothing; a folder path
        reads it. ``kvpage.models.generation_config.sampling_defaults`` turns the
        fields into SamplingParams defaults.

    Raises:
        SpecError: the file is malformed (naming it).
    """
    from kvpage.models.generation_config import read_generation_config

    gc = config.generation_config
    if gc in ("vllm", "none"):
        return None, {}
    if gc == "auto":
        m = config.model
        if not isinstance(m, (str, Path)) or not Path(m).expanduser().is_dir():
            return None, {}
        folder = Path(m).expanduser()
    else:
        folder = Path(gc).expanduser()
    return str(folder), read_generation_config(folder)


def check_device(device: Any) -> torch.device:
    """Parse and check a torch device string: ``cpu``, or ``cuda``/``cuda:N`` with a
    CUDA build of torch and GPU N present.

    Raises:
        SpecError: ``"device: expected ..., got ..."`` for an unknown, unsupported or
            unavailable device.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SpecError(
            f"device: expected a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise SpecError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if not torch.cuda.is_available():
        why = "no CUDA device visible" if torch.version.cuda else "torch built without CUDA"
        raise SpecError(f"device: expected an available device, got {device!r} ({why})")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise SpecError(f"device: expected cuda:N with N < {count} (visible GPUs), got {device!r}")
    return dev


_fork_hook = False


def _one_thread_after_fork() -> None:
    """In a forked child: torch on one thread. GNU OpenMP's thread pool does not
    survive ``fork()``: after the parent ran parallel ops, a child's first parallel op
    can wait forever at a barrier for threads it does not have (seen with
    ``multiprocessing``'s fork start method after a 2-thread engine, and with plain
    torch matmuls); one thread never enters the pool."""
    torch.set_num_threads(1)


def apply_num_threads(num_threads: int | None) -> int:
    """Set torch's CPU thread count by the rule of ``EngineConfig.num_threads`` (None =
    :data:`DEFAULT_NUM_THREADS`, 0 = leave torch's current setting); process-wide.
    With more than one thread, a process forked from this one afterwards starts with
    torch on one thread (:func:`_one_thread_after_fork`: GNU OpenMP hangs a forked
    child's first parallel op otherwise). Returns the thread count now in effect."""
    global _fork_hook
    if num_threads is None:
        num_threads = DEFAULT_NUM_THREADS
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    n = torch.get_num_threads()
    if n > 1 and not _fork_hook:  # a forked child then starts on one thread
        os.register_at_fork(after_in_child=_one_thread_after_fork)
        _fork_hook = True
    return n


def resolve_num_blocks(
    config: EngineConfig,
    bytes_per_block: int,
    fixed_bytes: int,
    max_model_len: int,
    pool_groups: int = 1,
) -> int:
    """Blocks of the pool by the rules of the module docstring (``pool_groups``: the KV
    groups sharing one unified pool, 1 for per-group pools).

    Raises:
        SpecError: ``kv_cache_memory_bytes`` is too small for 2 blocks.
    """
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory_bytes is not None:
        n = (config.kv_cache_memory_bytes - fixed_bytes) // bytes_per_block
        if n < 2:
            raise SpecError(
                f"kv_cache_memory_bytes: expected >= {2 * bytes_per_block + fixed_bytes} "
                f"(2 blocks of {bytes_per_block} bytes), got {config.kv_cache_memory_bytes}"
            )
        return int(n)
    bs = config.block_size
    g = pool_groups
    want = -(-config.max_num_seqs * max_model_len // bs) * g + 1
    cap = max(DEFAULT_KV_CACHE_BYTES_CAP // bytes_per_block, -(-max_model_len // bs) * g + 1)
    return int(max(2, min(want, cap)))


@dataclass(frozen=True, slots=True)
class EngineComponents:
    """The parts ``build_components`` builds and ``LLMEngine`` runs.

    Attributes:
        model: the loaded model (weights on ``config.device``).
        cache_spec: the KV cache layout (block size, blocks per group, KV groups).
        backend: the attention backend running ``cache_spec``.
        kv_caches: one KV cache per layer (the backend's tensors).
        kv_cache_manager: the block allocator (prefix caching, CoW, windows).
        scheduler: the continuous-batching scheduler over ``kv_cache_manager``.
        runner: turns a SchedulerOutput into one forward pass over ``kv_caches``.
        max_model_len: longest sequence in tokens.
        tiers: the KV tiers below the pool (None = none configured).
        state_caches: hybrid models: one ``StateCache`` per ``cache_spec.state_layers``
            entry, ``kv_cache_manager.state.num_slots`` rows each (None = no state layers).
    """

    model: ModelRunnerModel
    cache_spec: CacheSpec
    backend: AttentionBackend[Any]
    kv_caches: list[KVCache]
    kv_cache_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    tiers: TieredCache | None = None
    state_caches: list[StateCache] | None = None


def _check_state_config(config: EngineConfig) -> None:
    """Refuse, by name, what a model with recurrent state layers does not support.

    Raises:
        SpecError: a ``speculative_config``.
    """
    if config.speculative_config is not None:
        raise SpecError(
            "speculative_config: expected None for a model with recurrent state layers "
            "(rejected drafts would need the recurrent state rolled back), got a config"
        )


def _check_recurrent_only_tiers(config: EngineConfig, state_bytes: int) -> None:
    """Refuse, by name, tiers that could hold nothing on a model of recurrent layers
    only (no KV block: its tiers hold state snapshots alone, ``state_snapshot_share`` of
    each tier's bytes, ``kvpage.cache.state_pool``).

    Raises:
        SpecError: a tier with ``state_snapshot_slots=0``, or a tier whose share
            cannot hold one snapshot of ``state_bytes``.
    """
    share = config.state_snapshot_share
    for name, cap in (
        ("kv_host_tier_bytes", config.kv_host_tier_bytes),
        ("kv_disk_tier_bytes", config.kv_disk_tier_bytes),
    ):
        if not cap:
            continue
        if config.state_snapshot_slots == 0:  # (prefix caching off: EngineConfig refuses)
            raise SpecError(
                f"{name}: expected 0 on a model of recurrent layers only with "
                f"state_snapshot_slots=0 (its tiers hold state snapshots alone), got {cap:,}"
            )
        if int(cap * share) < state_bytes:
            need = f"at least {math.ceil(state_bytes / share):,} bytes" if share > 0 else "a share > 0"  # fmt: skip
            raise SpecError(
                f"{name}: expected 0 (off) or room for one state snapshot "
                f"({state_bytes:,} bytes) in its state_snapshot_share={share}: {need}, "
                f"got {cap:,}"
            )


def build_components(config: EngineConfig) -> EngineComponents:
    """Load the model, size and allocate the cache, pick the backend.

    Returns:
        The components, ready to run.

    Raises:
        SpecError: bad sizes, a KV cache too big to allocate, a model with recurrent
            state layers and speculative decoding (``_check_state_config``), tiers that
            hold nothing on a model of recurrent layers only
            (``_check_recurrent_only_tiers``), or ``max_model_len`` above the model's
            ``max_position_embeddings``; BackendUnavailableError: no backend can run
            the spec.
    """
    from kvpage.attention.metadata import allocate_model_kv_caches
    from kvpage.attention.state import StateCache
    from kvpage.backends import select_backend
    from kvpage.cache import KVCacheManager, max_retained_blocks
    from kvpage.cache.snapshot_policy import SnapshotPolicy
    from kvpage.cache.state_pool import StatePool, snapshot_slots_for, split_state_memory
    from kvpage.capacity import host_snapshot_rows
    from kvpage.engine.kv_transfer import (
        TorchStateMover,
        build_state_disk,
        build_swapper,
        build_tiers,
    )
    from kvpage.engine.runner import ModelRunner
    from kvpage.engine.scheduler import Scheduler
    from kvpage.engine.spec_decode import make_draft_policy, make_proposer
    from kvpage.models import load_model
    from kvpage.specs.speculative import parse_speculative_config

    device = check_device(config.device)
    apply_num_threads(config.num_threads)
    model = load_model(config.model, dtype=config.dtype, device=config.device)
    cfg = model.config
    # max_position_embeddings (GPT-2: n_positions; dynamic RoPE: times its factor)
    mpe = (
        model.arch.max_context_len
        if cfg.get("max_position_embeddings") or cfg.get("n_positions")
        else None
    )
    if config.max_model_len is not None and mpe and config.max_model_len > int(mpe):
        raise SpecError(
            f"max_model_len: expected <= {int(mpe)} (the model's max_position_embeddings), "
            f"got {config.max_model_len}"
        )
    mml = config.max_model_len or int(mpe or 2048)
    probe = model.cache_spec(config.block_size, 0, config.kv_cache_dtype, kv_pool=config.kv_pool)
    groups = len(probe.kv_groups) if probe.kv_pool == "unified" else 1
    state_bytes = probe.state_bytes_per_sequence
    share = config.state_snapshot_share
    snap_bytes: int | None = None
    if state_bytes:
        _check_state_config(config)
    recurrent_only = bool(state_bytes) and not probe.layers
    if recurrent_only:
        _check_recurrent_only_tiers(config, state_bytes)
    if recurrent_only:  # no KV tensors: 2 blocks keep the (empty) block bookkeeping valid
        num_blocks = 2
        if config.kv_cache_memory_bytes is not None:
            _, snap_bytes = split_state_memory(
                config.kv_cache_memory_bytes, state_bytes, config.max_num_seqs, share
            )
    elif state_bytes and config.num_blocks is None and config.kv_cache_memory_bytes is not None:
        kv_bytes, snap_bytes = split_state_memory(
            config.kv_cache_memory_bytes, state_bytes, config.max_num_seqs, share
        )
        num_blocks = (kv_bytes - probe.fixed_scale_bytes) // probe.bytes_per_block
        if num_blocks < 2:
            raise SpecError(
                f"kv_cache_memory_bytes: expected room for {config.max_num_seqs} live "
                f"recurrent states ({state_bytes} bytes each) and 2 KV blocks of "
                f"{probe.bytes_per_block} bytes after a {share} snapshot share, got "
                f"{config.kv_cache_memory_bytes}"
            )
    else:
        num_blocks = resolve_num_blocks(
            config, probe.bytes_per_block, probe.fixed_scale_bytes, mml, groups
        )
    spec = model.cache_spec(
        config.block_size, num_blocks, config.kv_cache_dtype, kv_pool=config.kv_pool
    )
    backend = select_backend(spec, device, prefer=config.backend)
    try:
        kv_caches = allocate_model_kv_caches(spec, device)
    except (RuntimeError, MemoryError) as e:  # torch's CPU/CUDA out-of-memory errors
        total = spec.total_bytes
        raise SpecError(
            f"num_blocks: expected a KV cache that fits in {config.device} memory, got "
            f"{num_blocks} blocks of {config.block_size} tokens (~{total:,} bytes): "
            f"{str(e).splitlines()[0][:200]}"
        ) from None
    cap = max_retained_blocks(
        num_blocks - 1, config.kv_retention_max_share, -(-mml // config.block_size)
    )
    state_pool = None
    state_caches = None
    state_host: list[StateCache] | None = None
    if spec.state_layers:
        if config.state_snapshot_slots is not None:
            n_snap = config.state_snapshot_slots
        elif recurrent_only:  # bounded by memory only: no KV block to end at
            if snap_bytes is None:  # share / (1 - share) of the live states' bytes
                snap_bytes = int(config.max_num_seqs * state_bytes * share / (1.0 - share))
            n_snap = snapshot_slots_for(state_bytes, share, 1 << 40, snapshot_bytes=snap_bytes)
        elif snap_bytes is not None:
            n_snap = snapshot_slots_for(
                state_bytes, share, num_blocks - 1, snapshot_bytes=snap_bytes
            )
        else:
            kv_total = (num_blocks - 1) * spec.bytes_per_block
            n_snap = snapshot_slots_for(state_bytes, share, num_blocks - 1, kv_bytes=kv_total)
        policy = SnapshotPolicy(
            config.block_size,
            share_threshold=config.state_share_threshold,
            predicted_share=config.state_predicted_share,
            decode_snapshots=config.state_decode_snapshots,
        )
        # host snapshots: a state_snapshot_share of the host KV tier's bytes, in addition
        # to it (docs/architecture.md "Recurrent state"); none without a host tier
        n_host = host_snapshot_rows(
            config.kv_host_tier_bytes,
            state_bytes,
            share,
            num_snapshot_slots=n_snap,
            prefix_caching=config.enable_prefix_caching,
        )
        state_pool = StatePool(config.max_num_seqs, n_snap, policy, num_host_snapshots=n_host)
        try:
            state_caches = [
                StateCache.allocate(s, state_pool.num_slots, device) for s in spec.state_layers
            ]
            if n_host:
                state_host = [
                    StateCache.allocate(s, n_host, torch.device("cpu")) for s in spec.state_layers
                ]
        except (RuntimeError, MemoryError) as e:
            raise SpecError(
                f"state_snapshot_slots: expected recurrent state slots that fit in "
                f"{config.device} memory, got {state_pool.num_slots} slots of "
                f"{state_bytes:,} bytes: {str(e).splitlines()[0][:200]}"
            ) from None
    kvm = KVCacheManager(
        spec,
        enable_prefix_caching=config.enable_prefix_caching,
        max_retained_blocks=cap,
        max_alloc_tokens=config.max_num_batched_tokens,  # the scheduler's step budget
        state_pool=state_pool,
    )
    tiers = build_tiers(config, spec, kv_caches, kvm)
    if state_pool is not None and state_caches is not None and state_pool.num_snapshot_slots:
        # disk snapshots: in the disk tier's budget (kv_transfer.state_disk_bytes); a
        # model of recurrent layers only has a disk tier of snapshots alone
        disk = tiers.disk if tiers is not None else None
        if recurrent_only and config.enable_prefix_caching:
            disk = build_state_disk(config, spec, kvm)
        if disk is not None and disk.state_capacity_bytes >= state_bytes:
            state_pool.attach_disk(disk, TorchStateMover(state_caches, state_host))
        for name, cap, held in (
            ("kv_host_tier_bytes", config.kv_host_tier_bytes, state_pool.num_host_snapshots),
            ("kv_disk_tier_bytes", config.kv_disk_tier_bytes, state_pool.disk is not None),
        ):
            if cap and not held:  # KV tiers still work: said, not refused
                logging.getLogger("kvpage.cache").warning(
                    "kvpage: %s=%d: its state_snapshot_share=%s holds no recurrent-state "
                    "snapshot (%d bytes each): evicted snapshots are not kept there",
                    name,
                    cap,
                    share,
                    state_bytes,
                )
    spec_cfg = parse_speculative_config(config.speculative_config)
    scheduler = Scheduler(
        kvm,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=mml,
        policy=config.scheduling_policy,
        proposer=None if spec_cfg is None else make_proposer(spec_cfg),
        draft_policy=None if spec_cfg is None else make_draft_policy(spec_cfg),
    )
    scheduler.swapper = build_swapper(config, kv_caches, kvm, state_caches, state_host)
    runner = ModelRunner(
        model,
        backend,
        kv_caches,
        spec,
        device,
        state_caches=state_caches,
        state_host_caches=state_host,
    )
    return EngineComponents(
        model, spec, backend, kv_caches, kvm, scheduler, runner, mml, tiers, state_caches
    )


__all__ = [
    "DEFAULT_KV_CACHE_BYTES_CAP",
    "DEFAULT_NUM_THREADS",
    "DEFAULT_RETENTION_MAX_SHARE",
    "EngineComponents",
    "apply_num_threads",
    "EngineConfig",
    "check_device",
    "build_components",
    "resolve_num_blocks",
]
