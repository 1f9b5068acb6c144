"""Moving whole KV blocks between the per-layer caches and host memory, and building the
engine's KV tiers (``kvpage.cache.tiered``) from an :class:`EngineConfig`.

:class:`TorchBlockMover` is the :class:`kvpage.cache.tiered.BlockMover` of the engine.
A block's *payload* is, for every layer in order, the raw bytes of ``kv[:, block]``
(``[2, block_size, num_kv_heads, head_dim]``, K then V) followed, for an int8 cache, by
its token scales ``token_scales[:, block]`` (``[2, block_size, num_kv_heads]`` float32):
the bit pattern, so a block written back is bit-identical. fp8 per-tensor / per-head
scales are per layer, not per block, and part of the tier fingerprint's cache layout.

On CPU a transfer is a gather (``index_select``) and a copy into a numpy array. On CUDA
the gathered blocks are copied into pinned host memory on a side stream and the call
waits for that stream before returning (so the copy is correct before the next step
overwrites the block). ``TieredCache.flush`` calls :meth:`TorchBlockMover.read_blocks`
once per step with all the blocks evicted while scheduling (one gather, one copy);
overlapping that copy with the step's forward is not done. The CUDA path is
short and untested here (no GPU on the development machine).

:class:`TorchStateMover` is the engine's ``kvpage.engine.swap.StateMover``: one state
slot's payload is, for every state layer in order, the raw bytes of ``conv[slot]``
(``[conv_dim, conv_kernel - 1]``) then ``ssm[slot]`` (``StateSpec.ssm_shape``), so a
slot written back is bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvpage.cache.tier_store import DiskTier, HostTier, Payload, tier_fingerprint
from kvpage.cache.tiered import TieredCache
from kvpage.engine.swap import HOST_BANDWIDTH, SwapCostModel, Swapper
from kvpage.errors import SpecError

if TYPE_CHECKING:
    from kvpage.attention.metadata import KVCache
    from kvpage.attention.state import StateCache
    from kvpage.cache import KVCacheManager
    from kvpage.specs import CacheSpec
    from kvpage.specs.engine_config import EngineConfig


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` as raw bytes: ``[..., last * itemsize]`` uint8 view (contiguous input)."""
    return x.contiguous().view(torch.uint8)


class TorchBlockMover:
    """Block copies over one KV group's per-layer caches (see the module docstring).

    Args:
        kv_caches: the layer caches of the group, in layer order.

    Attributes:
        block_nbytes: payload bytes of one block.
    """

    def __init__(self, kv_caches: Sequence[KVCache]) -> None:
        self.caches = list(kv_caches)
        self.device = self.caches[0].kv.device
        self._parts: list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]] = []
        for c in self.caches:
            for t in (c.kv, c.token_scales):
                if t is not None:
                    shape = (t.shape[0],) + tuple(t.shape[2:])
                    self._parts.append((t, shape, t.dtype))
        self._sizes = [
            int(np.prod(s)) * torch.empty((), dtype=d).element_size() for _, s, d in self._parts
        ]
        self.block_nbytes = sum(self._sizes)
        self._cuda = self.device.type == "cuda"
        self._stream: Any = (
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self._cuda
            else None
        )

    @torch.inference_mode()
    def read_blocks(self, block_ids: Sequence[int]) -> list[Payload]:
        """Copies of the blocks' payloads (1-D uint8 numpy arrays), in order."""
        n = len(block_ids)
        if n == 0:
            return []
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        cols = []
        for t, _, _ in self._parts:
            g = t.index_select(1, idx).transpose(0, 1)  # [n, 2, ...]
            cols.append(_bits(g).reshape(n, -1))
        flat = torch.cat(cols, dim=1)
        if self._cuda:  # pinned staging copy on a side stream, waited for here
            host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host.copy_(flat, non_blocking=True)
            self._stream.synchronize()
            arr = host.numpy()
        else:
            arr = flat.numpy()  # torch.cat made a new tensor: not a view of the cache
        return [arr[i] for i in range(n)]

    @torch.inference_mode()
    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[Payload]) -> None:
        """Overwrite the blocks with the payloads (each ``block_nbytes`` bytes).

        Raises:
            ValueError: a payload of the wrong size (nothing written).
        """
        n = len(block_ids)
        if n == 0:
            return
        for p in payloads:
            if memoryview(p).nbytes != self.block_nbytes:
                raise ValueError(
                    f"payload: expected {self.block_nbytes} bytes, got {memoryview(p).nbytes}"
                )
        host = np.stack([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in payloads])
        src = torch.from_numpy(host)
        if self._cuda:
            src = src.pin_memory().to(self.device, non_blocking=True)
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        off = 0
        for (t, shape, dtype), size in zip(self._parts, self._sizes):
            part = src[:, off : off + size].contiguous().view(dtype).reshape((n, *shape))
            t.index_copy_(1, idx, part.transpose(0, 1))
            off += size


class TorchStateMover:
    """Whole-slot copies over a hybrid model's state caches (module docstring).

    Args:
        state_caches: one ``StateCache`` per state layer, in order (mutated by
            :meth:`write_slot` and :meth:`copy_slots`).
        host_caches: the state pool's host snapshot rows (one host ``StateCache`` per
            state cache; copies address them as slots ``>= num_slots``), or None.

    Attributes:
        slot_nbytes: payload bytes of one slot.

    Raises:
        SpecError: no state cache.
    """

    def __init__(
        self,
        state_caches: Sequence[StateCache],
        host_caches: Sequence[StateCache] | None = None,
    ) -> None:
        if not state_caches:
            raise SpecError("state_caches: expected >= 1 state cache, got none")
        self.caches = list(state_caches)
        #: the state pool's host snapshot rows (slots >= num_slots in copies), or None
        self.host_caches = None if host_caches is None else list(host_caches)
        self._parts = [t for c in self.caches for t in (c.conv, c.ssm)]
        self._sizes = [t[0].numel() * t.element_size() for t in self._parts]
        self.slot_nbytes = sum(self._sizes)

    def _row(self, slot: int) -> tuple[list[torch.Tensor], int]:
        """The tensors (conv, ssm of every layer) and row index of ``slot``: a slot of
        the state caches, or ``>= num_slots`` host row ``slot - num_slots``.

        Raises:
            ValueError: a slot outside the caches and host rows.
        """
        n = self.caches[0].num_slots
        if 0 <= slot < n:
            return self._parts, slot
        host = self.host_caches
        if host is not None and 0 <= slot - n < host[0].num_slots:
            return [t for c in host for t in (c.conv, c.ssm)], slot - n
        nh = 0 if host is None else host[0].num_slots
        raise ValueError(f"slot: expected 0 <= slot < {n + nh}, got {slot}")

    @torch.inference_mode()
    def read_slot(self, slot: int) -> Payload:
        """A host copy (1-D uint8 numpy array) of slot ``slot`` of every state cache (a
        slot ``>= num_slots``: that host row).

        Raises:
            ValueError: a slot out of range.
        """
        parts, i = self._row(slot)
        flat = torch.cat([_bits(t[i]).reshape(-1) for t in parts])
        return flat.cpu().numpy()  # torch.cat made a new tensor: not a view of the cache

    @torch.inference_mode()
    def write_slot(self, slot: int, payload: Payload) -> None:
        """Overwrite slot ``slot`` of every state cache (a slot ``>= num_slots``: that
        host row) with ``payload``.

        Raises:
            ValueError: a payload of another size than ``slot_nbytes``, or a slot out of
                range (nothing written).
        """
        if memoryview(payload).nbytes != self.slot_nbytes:
            raise ValueError(
                f"payload: expected {self.slot_nbytes} bytes, got {memoryview(payload).nbytes}"
            )
        parts, i = self._row(slot)
        raw = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
        if not raw.flags.writeable:  # bytes (a disk tier read): torch wants a writable array
            raw = raw.copy()
        src = torch.from_numpy(raw)
        off = 0
        for t, size in zip(parts, self._sizes):
            row = src[off : off + size].view(t.dtype).reshape(t.shape[1:])
            t[i].copy_(row)
            off += size

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Run slot copies ``(src, dst)`` in order on every state cache
        (``kvpage.attention.state.run_slot_copies``)."""
        from kvpage.attention.state import run_slot_copies

        run_slot_copies(self.caches, list(pairs), self.host_caches)


def build_swapper(
    config: EngineConfig,
    kv_caches: Sequence[KVCache],
    kvm: KVCacheManager,
    state_caches: Sequence[StateCache] | None = None,
    state_host_caches: Sequence[StateCache] | None = None,
) -> Swapper | None:
    """The swapper of ``preemption_mode="swap"`` (None for ``recompute``), with the
    host-bandwidth preset of the cache's device (``kvpage.engine.swap.HOST_BANDWIDTH``):
    one :class:`TorchBlockMover` per KV group over that group's layers' caches (a
    unified pool: each group's views of the shared layer-slot tensors); on a hybrid
    model (``state_caches`` given) it also swaps the live state slot, and runs the
    queued state copies with ``state_host_caches`` (host snapshot rows, or None).

    Raises:
        SpecError: swap with several KV groups or a sliding window outside a unified
            pool (``kv_pool="per_group"``, or a lone sliding-window group: not built),
            or without an attention layer (a model of recurrent layers only);
            ``swap_space_bytes`` below one block's K/V (plus one sequence's recurrent
            state on a hybrid).
    """
    if config.preemption_mode != "swap":
        return None
    if not kvm.windows:
        raise SpecError(
            "preemption_mode: expected 'recompute' for a model of recurrent layers only "
            "(swap serves KV groups and their state), got 'swap'"
        )
    if not kvm.unified and kvm.windows != [None]:
        raise SpecError(
            f"preemption_mode: expected 'recompute' for KV groups {kvm.windows} outside a "
            f"unified pool (kv_pool={kvm.spec.kv_pool!r}; swap serves one full-attention "
            f"group or the groups of a unified pool), got 'swap'"
        )
    movers = [TorchBlockMover([kv_caches[i] for i in g.layer_ids]) for g in kvm.spec.kv_groups]
    state = TorchStateMover(state_caches, state_host_caches) if state_caches else None
    need = max(m.block_nbytes for m in movers) + (0 if state is None else state.slot_nbytes)
    if config.swap_space_bytes < need:
        what = "one block's K/V" if state is None else "one block's K/V and one recurrent state"
        raise SpecError(
            f"swap_space_bytes: expected (with swap) at least {what} ({need:,} bytes for "
            f"this model and block size), got {config.swap_space_bytes:,}"
        )
    bw = HOST_BANDWIDTH["cuda" if movers[0].device.type == "cuda" else "cpu"]
    return Swapper(movers, kvm.block_size, config.swap_space_bytes, SwapCostModel(bw), state=state)


def _check_holds_a_block(name: str, capacity: int, block_nbytes: int, off: str = "") -> None:
    """Refuse a capacity that cannot hold one block's K/V (it could never do anything).

    Args:
        off: how the option is turned off, named in the message (e.g. ``"0 (off) or "``).

    Raises:
        SpecError: ``capacity < block_nbytes``.
    """
    if capacity < block_nbytes:
        raise SpecError(
            f"{name}: expected {off}at least one block's K/V ({block_nbytes:,} bytes for "
            f"this model and block size), got {capacity:,}"
        )


#: the disk tier's layout versions (the fingerprint's ``format``): 1 = one KV group,
#: files keyed by block hash; 2 = several KV groups, files keyed by ``tier_key``; 3 = a
#: hybrid model's tier, KV files (either key form) and recurrent-state snapshot files
#: keyed by ``tier_store.state_key``. A directory of another format (or model, layout)
#: has another fingerprint, so its files are never listed.
DISK_FORMAT_ONE_GROUP, DISK_FORMAT_GROUPS, DISK_FORMAT_STATE = 1, 2, 3


def state_disk_bytes(config: EngineConfig) -> int:
    """Bytes of the disk tier that recurrent-state snapshot files may hold:
    ``floor(kv_disk_tier_bytes * state_snapshot_share)``, inside ``kv_disk_tier_bytes``
    (the host rule's share, ``engine.config.build_components``, but counted in the disk
    tier's own budget: the directory never holds more than ``kv_disk_tier_bytes``)."""
    return int(config.kv_disk_tier_bytes * config.state_snapshot_share)


def _disk_tier(config: EngineConfig, spec: CacheSpec, kvm: KVCacheManager, multi: bool) -> DiskTier:
    """The disk tier of ``config`` with the fingerprint of :func:`build_tiers` (``multi``:
    several KV groups of a unified pool)."""
    groups = spec.kv_groups
    assert config.kv_disk_tier_path is not None  # checked by EngineConfig
    model_id = config.model if isinstance(config.model, str) else type(config.model).__name__
    fields: dict[str, object] = {
        "model": model_id,
        "kv_cache_dtype": spec.kv_dtype,
        "dtype": spec.dtype,
        "block_size": spec.block_size,
        "hash_seed": kvm.hash_seed,
        "layers": [[a.num_kv_heads, a.head_dim] for a in spec.layers],
        "kv_scale_granularity": spec.kv_scale_granularity,
        "format": DISK_FORMAT_ONE_GROUP,
    }
    if multi:  # group-keyed files (tiered.tier_key): never listed by a 1-group layout
        fields["kv_groups"] = [[g.sliding_window, list(g.layer_ids)] for g in groups]
        fields["format"] = DISK_FORMAT_GROUPS
    state_b = 0
    if spec.state_layers:  # snapshot files beside the KV files (tier_store.state_key)
        fields["state_layers"] = [
            [
                s.kind,
                s.layer_id,
                s.conv_dim,
                s.conv_kernel,
                list(s.ssm_shape),
                s.dtype,
                s.ssm_dtype,
            ]  # fmt: skip
            for s in spec.state_layers
        ]
        fields["format"] = DISK_FORMAT_STATE
        state_b = state_disk_bytes(config)
    return DiskTier(
        config.kv_disk_tier_path,
        config.kv_disk_tier_bytes,
        tier_fingerprint(fields),
        state_capacity_bytes=state_b,
    )


def build_state_disk(config: EngineConfig, spec: CacheSpec, kvm: KVCacheManager) -> DiskTier | None:
    """The disk tier of a model of recurrent layers only (no KV block to tier, so no
    :class:`TieredCache`): snapshot files only, ``state_snapshot_share`` of
    ``kv_disk_tier_bytes`` (:func:`state_disk_bytes`), the fingerprint of
    :func:`build_tiers` (``format`` 3). None without ``kv_disk_tier_bytes``.

    Raises:
        SpecError: an unusable disk path.
    """
    if not config.kv_disk_tier_bytes:
        return None
    return _disk_tier(config, spec, kvm, False)


def build_tiers(
    config: EngineConfig, spec: CacheSpec, kv_caches: Sequence[KVCache], kvm: KVCacheManager
) -> TieredCache | None:
    """The engine's KV tiers from ``config`` (an ``EngineConfig``; None when both
    capacities are 0), attached to ``kvm``. The disk tier's fingerprint covers the model
    (its name or path and its config), the KV dtype, block size, hash seed and the cache
    geometry; with several KV groups (a unified pool) also the groups (window, layer
    ids) and ``format`` 2 (files keyed by ``kvpage.cache.tiered.tier_key``), so a disk
    tier written by a one-group layout is never listed by a multi-group one, nor the
    reverse. A hybrid model (``spec.state_layers``) adds the state layers' layout and
    ``format`` 3: its directory also holds snapshot files (``state_snapshot_share`` of
    the bytes at most, :func:`state_disk_bytes`). One :class:`TorchBlockMover` per KV
    group over its layers' caches. None too for a model of recurrent layers only (no KV
    block: its snapshots' disk tier is :func:`build_state_disk`; its host rows are the
    state pool's).

    Raises:
        SpecError: a layout tiers cannot serve (see ``KVCacheManager.attach_tiers``), or
            an unusable disk path.
    """
    host_b = config.kv_host_tier_bytes
    disk_b = config.kv_disk_tier_bytes
    if (not host_b and not disk_b) or not spec.layers:
        return None
    groups = spec.kv_groups
    multi = len(kvm.pools) > 1 and kvm.unified  # else attach_tiers refuses by name
    # several groups (a unified pool): one mover per group over its layers' caches
    movers = (
        [TorchBlockMover([kv_caches[i] for i in g.layer_ids]) for g in groups]
        if multi
        else [TorchBlockMover(kv_caches)]
    )
    mover = movers[0]
    for name, cap in (("kv_host_tier_bytes", host_b), ("kv_disk_tier_bytes", disk_b)):
        if cap:
            _check_holds_a_block(name, cap, mover.block_nbytes, "0 (off) or ")
    host = HostTier(host_b) if host_b else None
    disk = _disk_tier(config, spec, kvm, multi) if disk_b else None
    tiers = TieredCache(list(kvm.pools) if multi else kvm.pools[0], movers, host=host, disk=disk)
    tiers.admission_chunk_tokens = config.max_num_batched_tokens
    try:
        kvm.attach_tiers(tiers)
    except Exception:
        tiers.detach()
        raise
    return tiers


__all__ = [
    "DISK_FORMAT_GROUPS",
    "DISK_FORMAT_ONE_GROUP",
    "DISK_FORMAT_STATE",
    "TorchBlockMover",
    "TorchStateMover",
    "build_state_disk",
    "build_swapper",
    "build_tiers",
    "state_disk_bytes",
]
