"""Input validation shared by every backend (built-in or plugin).

Each check raises a ``kvpage.errors`` exception with a "name: expected X, got Y"
message *before* any state is touched, so a rejected call changes nothing.

``check_write_kv``, ``check_forward`` and ``check_block_pairs`` are what every backend
runs (the step itself is validated once, when the plan is built:
``kvpage.attention.plan.check_step``). In the engine the per-layer part of
``check_forward`` runs at plan time instead: :func:`check_layers` once for the
runner's caches and specs (they never change), :func:`check_step_layers` once per step
and KV group; it marks the plan (``StepPlan.layers_checked``) and the CPU backends'
``forward`` then runs no per-layer check. It also checks the step's slot mapping
against the group's pools and records it on the plan it belongs to
(``StepPlan.checked_slot_mapping``): ``write_kv(..., slot_mapping, plan=plan)`` with that
very tensor (the model passes each layer ``plan.meta.slot_mapping`` and its plan) skips
``check_write_kv``; any other slot mapping, or a call without the plan, is checked. No
module state: what was checked lives and dies with the step's plan.
``KVPAGE_CHECK_EVERY_LAYER=1`` in the environment (:data:`CHECK_EVERY_LAYER`) leaves the
plan unmarked and records nothing, so every layer checks its arguments again (debugging
a backend or a model). The ``check_launch_*`` functions run them first
and add what kernels that take raw memory need (storage and scale dtypes, index dtypes,
devices of every tensor, independent block copies); the triton, cupy and numba plugins
use them.
Checks that would read device memory (min/max of a CUDA tensor) are done for CPU tensors
only, so that validation never synchronizes a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from kvpage.attention.metadata import KV_STORAGE_DTYPES, KVCache
from kvpage.attention.plan import INDEX_DTYPES, StepPlan
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import AttentionSpec

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: ``KVPAGE_CHECK_EVERY_LAYER=1``: every layer's ``forward`` checks its arguments even
#: when the step's layers were validated at plan time (read at import)
CHECK_EVERY_LAYER = os.environ.get("KVPAGE_CHECK_EVERY_LAYER", "") not in ("", "0")


def check_cache(cache: KVCache, name: str = "cache") -> None:
    """The cache's tensors agree with its kv dtype (scales present, shapes right);
    ``name`` prefixes the messages."""
    kv = cache.kv
    if kv.dim() != 5 or kv.shape[0] not in (1, 2) or (kv.shape[0] == 1 and kv.shape[3] != 1):
        raise ShapeError(
            f"{name}.kv: expected [2, num_blocks, block_size, num_kv_heads, head_dim] (MLA "
            f"latent: [1, num_blocks, block_size, 1, head_dim]), got {list(kv.shape)}"
        )
    if cache.kv_dtype == "int8":
        ts = cache.token_scales
        if ts is None or tuple(ts.shape) != tuple(kv.shape[:4]):
            raise ShapeError(
                f"{name}.token_scales: expected {list(kv.shape[:4])}, got "
                f"{None if ts is None else list(ts.shape)}"
            )
    elif cache.kv_dtype.startswith("fp8"):
        scales = [("k_scale", cache.k_scale)]
        if cache.is_latent:  # one latent: one scale set
            if cache.v_scale is not None:
                raise ShapeError(f"{name}.v_scale: expected None for an MLA latent cache, got a tensor")  # fmt: skip
        else:
            scales.append(("v_scale", cache.v_scale))
        for sname, s in scales:
            if s is None or s.dim() > 1 or (s.dim() == 1 and s.shape[0] != kv.shape[3]):
                raise ShapeError(
                    f"{name}.{sname}: expected [] or [{kv.shape[3]}], got "
                    f"{None if s is None else list(s.shape)}"
                )


def check_write_kv(
    key: torch.Tensor, value: torch.Tensor | None, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Validate ``write_kv`` arguments (see ``AttentionBackend.write_kv``). An MLA latent
    cache (``cache.is_latent``) takes the latent as ``key`` and ``value=None``.

    The slot range is checked only for a slot mapping on the CPU: on CUDA, reading its
    min/max would synchronize the device on every ``write_kv`` of every layer. There the
    caller guarantees the precondition (every slot in ``[-1, num_blocks * block_size)``,
    as ``kvpage.cache.slot_mapping`` produces) and kernels skip slot -1.

    Raises:
        ShapeError: shapes disagree, or (CPU slot mapping) a slot is outside
            ``[-1, num_blocks * block_size)``.
        DTypeError: key/value not float32|float16|bfloat16, or slot_mapping not integer.
    """
    check_cache(cache)
    want = (cache.num_kv_heads, cache.head_dim)
    if (value is None) != cache.is_latent:
        raise ShapeError(
            "value: expected None for an MLA latent cache (the latent is the key), got a tensor"
            if cache.is_latent
            else "value: expected a tensor (a K/V cache), got None"
        )
    pairs = [("key", key)] if value is None else [("key", key), ("value", value)]
    for name, x in pairs:
        if x.dim() != 3 or tuple(x.shape[1:]) != want:
            raise ShapeError(
                f"{name}: expected [num_tokens, {want[0]}, {want[1]}], got {list(x.shape)}"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise DTypeError(f"{name}: expected float32|float16|bfloat16, got {x.dtype}")
        if x.device != cache.kv.device:  # check_device, inlined (hot path)
            raise ShapeError(f"{name}.device: expected {cache.kv.device}, got {x.device}")
    if value is not None and key.shape[0] != value.shape[0]:
        raise ShapeError(f"value: expected {key.shape[0]} tokens like key, got {value.shape[0]}")
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise DTypeError(f"slot_mapping: expected int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping: expected [{key.shape[0]}], got {list(slot_mapping.shape)}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        n = cache.num_blocks * cache.block_size
        if lo < -1 or hi >= n:
            raise ShapeError(f"slot_mapping: expected values in [-1, {n - 1}], got [{lo}, {hi}]")


def check_tables(plan: StepPlan, block_size: int, num_blocks: int) -> None:
    """The step's block tables against a pool of ``num_blocks`` blocks of
    ``block_size``: wide enough for every sequence, and (block tables on the CPU) every
    block id a sequence reads in ``[0, num_blocks)``. Runs once per
    ``(block_size, num_blocks)`` and step — all layers of a KV group share it — and is
    remembered in ``plan.tables_checked``.

    Raises:
        ShapeError: a table too narrow for its sequence, or a block id out of range.
    """
    key = (block_size, num_blocks)
    if key in plan.tables_checked:
        return
    meta = plan.meta
    bt = meta.block_tables
    need = -(-meta.max_seq_len // block_size)
    if bt.shape[1] < need:
        i = next(i for i, s in enumerate(meta.seq_lens_cpu) if -(-s // block_size) > bt.shape[1])
        s = meta.seq_lens_cpu[i]
        raise ShapeError(
            f"meta.block_tables[{i}]: expected >= {-(-s // block_size)} blocks for {s} tokens, "
            f"got {bt.shape[1]}"
        )
    if bt.device.type == "cpu" and bt.numel():
        # every row at once (a per-row loop cost ~1.4 ms per 200-sequence step); the
        # row named in the message is looked for only when something is wrong
        used_n = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64).add_(block_size - 1)
        used_n = used_n.div_(block_size, rounding_mode="floor")
        used = torch.arange(bt.shape[1]).unsqueeze(0) < used_n.unsqueeze(1)
        bad = used & ((bt < 0) | (bt >= num_blocks))
        if bool(bad.any()):
            i = int(bad.any(dim=1).nonzero()[0, 0])
            ids = bt[i, : int(used_n[i])].tolist()
            raise ShapeError(
                f"meta.block_tables[{i}]: expected ids in [0, {num_blocks}), got {ids}"
            )
    plan.tables_checked.add(key)


def check_sinks(sinks: torch.Tensor | None, spec: AttentionSpec, device: torch.device) -> None:
    """The ``sinks=`` argument of ``forward`` against ``spec.sinks``: ``[num_q_heads]``
    float32 on ``device`` exactly when the layer has sinks, None otherwise.

    Raises:
        ShapeError: sinks missing for a sink layer, given for a layer without, of the
            wrong shape or on another device.
        DTypeError: not float32.
    """
    if not spec.sinks:
        if sinks is not None:
            raise ShapeError(f"sinks: expected None (spec.sinks is False), got {list(sinks.shape)}")
        return
    hq = spec.num_q_heads
    if sinks is None:
        raise ShapeError(f"sinks: expected [{hq}] float32 (spec.sinks is True), got None")
    if sinks.dim() != 1 or sinks.shape[0] != hq:
        raise ShapeError(f"sinks: expected [{hq}], got {list(sinks.shape)}")
    if sinks.dtype != torch.float32:
        raise DTypeError(f"sinks: expected float32, got {sinks.dtype}")
    check_device("sinks", sinks, device)


def check_forward(
    query: torch.Tensor,
    cache: KVCache,
    plan: StepPlan,
    spec: AttentionSpec,
    out: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Validate one layer's ``forward`` arguments. The step itself was validated when
    ``plan`` was built (``kvpage.attention.plan.check_step``); the block tables are
    checked against this cache's pool once per step (``check_tables``).

    Raises:
        ShapeError: the cache layout, its heads/head_dim vs ``spec``, query
            ``[plan.num_tokens, num_q_heads, head_dim]``, ``out``'s shape, a tensor on
            another device than the cache, the block tables (``check_tables``), or
            ``sinks`` against ``spec.sinks`` (``check_sinks``); an MLA layer
            (``spec.kv_lora_rank``) needs a latent cache and ``out`` ``[rows,
            num_q_heads, kv_lora_rank]``.
        DTypeError: query or out not float32|float16|bfloat16, or out's dtype differs;
            sinks not float32.
    """
    check_cache(cache)
    hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    if cache.is_latent != spec.is_mla:
        raise ShapeError(
            f"cache: expected {'an MLA latent' if spec.is_mla else 'a K/V'} cache for this "
            f"layer, got kv {list(cache.kv.shape)}"
        )
    if cache.num_kv_heads != hkv or cache.head_dim != d:
        raise ShapeError(
            f"cache: expected num_kv_heads={hkv}, head_dim={d}, got "
            f"{cache.num_kv_heads}, {cache.head_dim}"
        )
    rows = plan.num_tokens
    if query.dim() != 3 or query.shape[0] != rows or query.shape[1] != hq or query.shape[2] != d:
        raise ShapeError(f"query: expected [{rows}, {hq}, {d}], got {list(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"query: expected float32|float16|bfloat16, got {query.dtype}")
    dev = cache.kv.device
    if query.device != dev:  # check_device, inlined (hot path)
        raise ShapeError(f"query.device: expected {dev}, got {query.device}")
    if plan.device != dev:
        raise ShapeError(f"meta.device: expected {dev} (the cache's), got {plan.device}")
    if out is not None:
        want = (rows, hq, spec.value_dim)
        if tuple(out.shape) != want:
            raise ShapeError(f"out: expected {list(want)}, got {list(out.shape)}")
        if out.dtype != query.dtype:
            raise DTypeError(f"out: expected {query.dtype}, got {out.dtype}")
        check_device("out", out, dev)
    if sinks is not None or spec.sinks:
        check_sinks(sinks, spec, dev)
    if (cache.block_size, cache.num_blocks) not in plan.tables_checked:
        check_tables(plan, cache.block_size, cache.num_blocks)


def check_layers(
    caches: Sequence[KVCache], specs: Sequence[AttentionSpec], device: torch.device
) -> None:
    """What ``check_forward`` checks of a layer that never changes, once for all layers
    (the engine's runner, at construction): each cache's layout, storage and scale
    dtypes and devices (``check_launch_cache``), its heads/head_dim against its spec,
    and that it lives on ``device``.

    Raises:
        ShapeError, DTypeError: named ``caches[i]...`` for the first bad layer.
    """
    if len(caches) != len(specs):
        raise ShapeError(f"caches: expected {len(specs)} (one per layer spec), got {len(caches)}")
    for i, (cache, spec) in enumerate(zip(caches, specs)):
        check_launch_cache(cache, f"caches[{i}]")
        if cache.is_latent != spec.is_mla:
            raise ShapeError(
                f"caches[{i}]: expected {'an MLA latent' if spec.is_mla else 'a K/V'} cache, "
                f"got kv {list(cache.kv.shape)}"
            )
        if cache.num_kv_heads != spec.num_kv_heads or cache.head_dim != spec.head_dim:
            raise ShapeError(
                f"caches[{i}]: expected num_kv_heads={spec.num_kv_heads}, "
                f"head_dim={spec.head_dim}, got {cache.num_kv_heads}, {cache.head_dim}"
            )
        check_device(f"caches[{i}].kv", cache.kv, device)


def check_step_layers(
    plan: StepPlan, pools: Iterable[tuple[int, int]], device: torch.device
) -> None:
    """What ``check_forward`` checks per step of the layers of one KV group, once, at
    plan time: the plan is on ``device`` (the caches', :func:`check_layers`) and the
    block tables fit every ``(block_size, num_blocks)`` pool of the group
    (``check_tables``). Marks ``plan.layers_checked`` (unless :data:`CHECK_EVERY_LAYER`),
    so the layers' ``forward`` skips its checks; the query, ``out`` and ``sinks`` are
    then the model's own tensors, shaped by the same specs. Likewise the step's slot
    mapping (its shape and dtype checked by ``check_step``): its slots are checked
    against every pool (CPU slot mappings, as in ``check_write_kv``) and it is recorded
    as ``plan.checked_slot_mapping``, so ``write_kv`` with it and the plan skips
    ``check_write_kv`` (key and value are the model's own, shaped by the same specs).

    Raises:
        ShapeError: a plan on another device, block tables that do not fit a pool, or
            a slot outside ``[-1, num_blocks * block_size)`` of a pool.
    """
    if plan.device != device:
        raise ShapeError(f"meta.device: expected {device} (the cache's), got {plan.device}")
    n = -1  # slots of the smallest pool (-1: no pool)
    for block_size, num_blocks in pools:
        check_tables(plan, block_size, num_blocks)
        n = block_size * num_blocks if n < 0 else min(n, block_size * num_blocks)
    if CHECK_EVERY_LAYER:
        return
    slots = plan.meta.slot_mapping
    if n >= 0 and slots.device.type == "cpu" and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= n:
            raise ShapeError(f"slot_mapping: expected values in [-1, {n - 1}], got [{lo}, {hi}]")
    object.__setattr__(plan, "layers_checked", True)
    if n >= 0:  # else no pool checked the slots: write_kv checks them
        object.__setattr__(plan, "checked_slot_mapping", slots)


def check_block_pairs(pairs: torch.Tensor, num_blocks: int) -> None:
    """``pairs``: ``[n, 2]`` integer block ids in ``[0, num_blocks)``."""
    if pairs.dtype.is_floating_point or pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ShapeError(f"pairs: expected [n, 2] int64, got {list(pairs.shape)} {pairs.dtype}")
    if pairs.numel():
        lo, hi = int(pairs.min()), int(pairs.max())
        if lo < 0 or hi >= num_blocks:
            raise ShapeError(
                f"pairs: expected block ids in [0, {num_blocks - 1}], got [{lo}, {hi}]"
            )


# ---- launcher checks (kernels that take raw memory) ------------------------------------
def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Raise ShapeError if ``t`` is not on ``device`` — the one error type for a
    misplaced tensor in every backend (placement is part of a tensor's layout)."""
    if t.device != device:
        raise ShapeError(f"{name}.device: expected {device}, got {t.device}")


def check_launch_cache(cache: KVCache, name: str = "cache") -> str:
    """``check_cache``, plus: the storage dtype is a model or kv storage dtype, and the
    scales are float32 on the cache's device. Returns ``cache.kv_dtype``.

    Raises:
        ShapeError: bad layout or scale shapes; a scale on another device.
        DTypeError: unsupported storage dtype, or scales not float32.
    """
    check_cache(cache, name)
    kv = cache.kv
    if kv.dtype not in FLOAT_DTYPES and kv.dtype not in KV_STORAGE_DTYPES.values():
        raise DTypeError(
            f"{name}.kv.dtype: expected float32|float16|bfloat16|int8|float8_e4m3fn|"
            f"float8_e5m2, got {kv.dtype}"
        )
    scales = {"token_scales": cache.token_scales, "k_scale": cache.k_scale, "v_scale": cache.v_scale}  # fmt: skip
    for sname, s in scales.items():
        if s is None:
            continue
        if s.dtype != torch.float32:
            raise DTypeError(f"{name}.{sname}.dtype: expected float32, got {s.dtype}")
        check_device(f"{name}.{sname}", s, kv.device)
    return cache.kv_dtype


def check_launch_write(
    key: torch.Tensor,
    value: torch.Tensor | None,
    cache: KVCache,
    slot_mapping: torch.Tensor,
    *,
    same_dtype: bool = False,
) -> str:
    """``check_write_kv`` and ``check_launch_cache``, plus: key and value in the cache
    dtype when ``kv_dtype == "auto"``, slot_mapping int64|int32 on the cache's device.
    Returns ``cache.kv_dtype``. The slot range is checked for a CPU slot mapping only
    (see ``check_write_kv``).

    Args:
        same_dtype: also require ``value.dtype == key.dtype`` (for kernels specialized
            on one source dtype).

    Raises:
        ShapeError, DTypeError: as named in the message.
    """
    if value is None or cache.is_latent:  # K/V-plane kernels only
        raise ShapeError(
            "cache: expected a K/V cache [2, ...] (this launcher writes K and V planes), got "
            f"an MLA latent cache {list(cache.kv.shape)} or value None"
        )
    check_write_kv(key, value, cache, slot_mapping)
    kind = check_launch_cache(cache)
    kv = cache.kv
    if same_dtype and value.dtype != key.dtype:
        raise DTypeError(f"value: expected {key.dtype} (the key dtype), got {value.dtype}")
    if kind == "auto":
        for name, x in (("key", key), ("value", value)):
            if x.dtype != kv.dtype:
                raise DTypeError(f"{name}: expected the cache dtype {kv.dtype}, got {x.dtype}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise DTypeError(f"slot_mapping: expected int64, got {slot_mapping.dtype}")
    check_device("slot_mapping", slot_mapping, kv.device)
    return kind


def check_launch_forward(
    query: torch.Tensor,
    cache: KVCache,
    plan: StepPlan,
    spec: AttentionSpec,
    out: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> str:
    """``check_forward`` and ``check_launch_cache``. Returns ``cache.kv_dtype``.

    Raises:
        ShapeError, DTypeError: as named in the message.
    """
    check_forward(query, cache, plan, spec, out, sinks)
    return check_launch_cache(cache)


def check_independent_pairs(caches: list[KVCache], pairs: torch.Tensor) -> torch.Tensor:
    """``check_block_pairs`` against every cache and ``check_launch_cache`` of each,
    plus: int64|int32 pairs whose destinations are distinct and never a source, so the
    copies do not depend on their order (what a parallel kernel does). Returns the pairs
    as a CPU int64 ``[n, 2]`` tensor (one host copy).

    Raises:
        ShapeError: not ``[n, 2]``, an id outside a cache's pool, a repeated
            destination, or a destination that is also a source.
        DTypeError: not int64|int32; a cache's storage or scale dtype.
    """
    for c in caches:
        check_block_pairs(pairs, c.num_blocks)
    if pairs.dtype not in INDEX_DTYPES:
        raise DTypeError(f"pairs: expected int64, got {pairs.dtype}")
    host = pairs.detach().to("cpu", torch.int64)
    rows = host.tolist()
    dsts = [d for _, d in rows]
    if len(set(dsts)) != len(dsts):
        raise ShapeError(f"pairs[:, 1]: expected distinct destination blocks, got {dsts}")
    overlap = set(dsts) & {s for s, _ in rows}
    if overlap:
        raise ShapeError(f"pairs: expected no block as both source and destination, got {sorted(overlap)}")  # fmt: skip
    for i, c in enumerate(caches):
        check_launch_cache(c, f"caches[{i}]")
    return host
