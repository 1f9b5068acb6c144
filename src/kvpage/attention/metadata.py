"""Per-step attention metadata and the per-layer KV cache container.

One ``AttentionMetadata`` describes a batch of sequences for one forward step; it is
built once per step (by the model runner) and shared by every layer. The same layout
serves decode (every ``query_len == 1``) and prefill with cached context (chunked
prefill, prefix-cache hits): for sequence ``i`` the step computes query tokens at
absolute positions ``context_lens[i] .. seq_lens[i]-1`` and attends to keys
``0 .. seq_lens[i]-1`` (causally, and within the layer's sliding window).

Layout of a layer's cache — one layout for every backend (``kv_cache_shape``):
``kv``: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` — index 0 = K, 1 = V.
Slot ``s`` is ``kv[:, s // block_size, s % block_size]``; the slot of the token at
position ``p`` is ``slot_of(block_table[p // block_size], p, block_size)`` (the one
definition of the formula, used by the cache manager, scheduler, runner and backends).

An MLA layer (``AttentionSpec.kv_lora_rank``; DeepSeek-V2/V3) caches one latent vector
per token instead of K and V: ``kv`` is ``[1, num_blocks, block_size, 1, head_dim]``
(``head_dim = kv_lora_rank + qk_rope_head_dim``), int8 token scales ``[1, num_blocks,
block_size, 1]``, fp8 one ``k_scale`` and no ``v_scale`` (``KVCache.is_latent``).

Block tables are padded with ``PAD_BLOCK`` (-1) past a sequence's last block, in every
producer (``AttentionMetadata.build``, ``kvpage.cache.batch_block_tables``, the runner);
padding is never read: kernels only read the ``ceil(seq_len / block_size)`` leading
entries, and -1 makes an accidental read an out-of-range error rather than a silent
read of block 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpage.slots import PAD_BLOCK, slot_of, slots_of  # re-exported (the one definition)

if TYPE_CHECKING:
    from kvpage.specs import CacheSpec

#: storage dtype of the cache per CacheSpec.kv_dtype ("auto" = model dtype)
KV_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: largest finite value of each fp8 format (OCP 8-bit floating point spec, 2023)
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: int8 codes are symmetric in [-127, 127]
INT8_MAX = 127.0

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _kv_dtype_name(dtype: torch.dtype) -> str:
    for name, dt in KV_STORAGE_DTYPES.items():
        if dtype == dt:
            return name
    return "auto"


@dataclass
class KVCache:
    """The paged K/V storage of one layer.

    ``num_blocks``, ``block_size``, ``num_kv_heads``, ``head_dim`` and ``kv_dtype`` are
    read from ``kv`` once, at construction (0 / ``"auto"`` for a ``kv`` that is not
    5-D, which ``kvpage.attention.checks.check_cache`` rejects): ``kv`` must not be
    reassigned afterwards (make a new KVCache); the scales may be.

    Attributes:
        kv: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (an MLA layer's
            latent cache: ``[1, num_blocks, block_size, 1, head_dim]``); dtype is the model
            dtype (float32|float16|bfloat16) for ``kv_dtype="auto"``, else int8,
            float8_e4m3fn or float8_e5m2.
        token_scales: int8 only: ``[2, num_blocks, block_size, num_kv_heads]`` float32,
            the dequantization scale of each stored token and head (K at 0, V at 1);
            ``None`` otherwise.
        k_scale: fp8 only: float32 ``[]`` (per tensor) or ``[num_kv_heads]`` (per head);
            stored = fp8(clamp(k / k_scale)); dequantized = stored * k_scale.
        v_scale: fp8 only: as ``k_scale`` for V.
    """

    kv: torch.Tensor
    token_scales: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    num_blocks: int = field(init=False)
    block_size: int = field(init=False)
    num_kv_heads: int = field(init=False)
    head_dim: int = field(init=False)
    #: ``auto``, ``int8``, ``fp8_e4m3`` or ``fp8_e5m2`` (from ``kv.dtype``)
    kv_dtype: str = field(init=False)

    def __post_init__(self) -> None:
        shape = tuple(self.kv.shape) if self.kv.dim() == 5 else (0, 0, 0, 0, 0)
        _, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = shape
        self.kv_dtype = _kv_dtype_name(self.kv.dtype)

    @property
    def is_latent(self) -> bool:
        """An MLA latent cache (``kv.shape[0] == 1``: one latent per token, no V)."""
        return self.kv.dim() == 5 and self.kv.shape[0] == 1


def kv_cache_shape(spec: CacheSpec, layer_id: int) -> tuple[int, int, int, int, int]:
    """``(2, num_blocks, block_size, num_kv_heads, head_dim)`` of layer ``layer_id``
    (an MLA layer: ``(1, num_blocks, block_size, 1, head_dim)``, the latent): the
    layout of every backend (why there is one layout: docs/backend-authoring.md).

    Raises:
        IndexError: ``layer_id`` is not a layer of ``spec``.
    """
    a = spec.layers[layer_id]
    return (a.kv_planes, spec.num_blocks, spec.block_size, a.num_kv_heads, a.head_dim)


def allocate_layer_cache(spec: CacheSpec, layer_id: int, device: torch.device | str) -> KVCache:
    """A zeroed cache of layer ``layer_id`` of ``spec`` on ``device`` (``allocate_kv_cache``
    with the spec's dtype, kv dtype and fp8 scale granularity; int8 token scales start
    at 0, fp8 scales at 1.0).

    Raises:
        IndexError: ``layer_id`` is not a layer of ``spec``.
    """
    planes, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_shape(spec, layer_id)
    return allocate_kv_cache(
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        dtype=MODEL_DTYPES[spec.dtype],
        kv_dtype=spec.kv_dtype,
        kv_scale_granularity=spec.kv_scale_granularity,
        device=device,
        latent=planes == 1,
    )


def allocate_model_kv_caches(spec: CacheSpec, device: torch.device | str) -> list[KVCache]:
    """The caches of every layer of ``spec``, one KVCache per layer (index = layer id).

    ``kv_pool="per_group"`` (and any one-group model): each layer its own zeroed tensor
    of ``spec.num_blocks`` blocks (:func:`allocate_layer_cache`). ``"unified"`` with
    several KV groups: one tensor per layer slot (``spec.pool_tensor_layers``: the
    layers of group 0), and layer ``l`` of any group gets a KVCache over the tensor of
    slot ``spec.layer_slot(l)`` (``kv`` and int8 ``token_scales`` shared, fp8
    ``k_scale``/``v_scale`` its own). A block id belongs to one group at a time
    (``kvpage.cache.block_pool``), so layers of different groups never write the same
    block; every layer keeps the canonical ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]`` view, and the backends' contract is unchanged. Bytes allocated:
    ``spec.total_bytes`` (:func:`kv_caches_nbytes`).
    """
    if spec.kv_pool != "unified" or len(spec.kv_groups) == 1:
        return [allocate_layer_cache(spec, i, device) for i in range(spec.num_layers)]
    slots = [allocate_layer_cache(spec, i, device) for i in spec.pool_tensor_layers]
    out: list[KVCache] = []
    for i in range(spec.num_layers):
        base = slots[spec.layer_slot(i)]
        a = spec.layers[i]
        if (a.num_kv_heads, a.head_dim) == (base.num_kv_heads, base.head_dim):
            kv, ts = base.kv, base.token_scales
        else:  # equal bytes per token (CacheSpec checks), another head shape
            shape = (2, base.num_blocks, base.block_size, a.num_kv_heads, a.head_dim)
            kv = base.kv.view(-1).view(shape)
            ts = None
            if base.token_scales is not None:
                ts = base.token_scales.view(-1).view(shape[:4])
        c = KVCache(kv=kv, token_scales=ts)
        if base.k_scale is not None and base.v_scale is not None:
            per = a.num_kv_heads if spec.kv_scale_granularity == "per_head" else None
            c.k_scale = torch.ones((per,) if per else (), dtype=torch.float32, device=kv.device)
            c.v_scale = torch.ones_like(c.k_scale)
        out.append(c)
    return out


def kv_caches_nbytes(caches: list[KVCache]) -> int:
    """Bytes of the distinct tensors behind ``caches`` (K/V, int8 token scales, fp8
    scales; a tensor shared by several layers counted once)."""
    seen: dict[int, int] = {}
    for c in caches:
        for t in (c.kv, c.token_scales, c.k_scale, c.v_scale):
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    kv_dtype: str = "auto",
    kv_scale_granularity: str = "per_tensor",
    device: torch.device | str = "cpu",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    fill: float | None = None,
    latent: bool = False,
) -> KVCache:
    """Allocate one layer's cache in the canonical layout.

    Args:
        dtype: the model dtype (used when ``kv_dtype == "auto"``).
        kv_dtype: ``auto``, ``int8``, ``fp8_e4m3`` or ``fp8_e5m2``.
        kv_scale_granularity: fp8 scales ``per_tensor`` (shape ``[]``) or ``per_head``.
        k_scale, v_scale: initial fp8 scales (broadcast to the granularity's shape).
        fill: value to fill K/V with (NaN for poisoning in tests); default zeros.
        latent: an MLA latent cache: ``kv`` ``[1, ...]`` (``num_kv_heads`` must be 1),
            int8 token scales ``[1, ...]``, fp8 ``k_scale`` only (``v_scale`` None).

    Returns:
        A zero-filled (or ``fill``-filled) KVCache on ``device``.
    """
    planes = 1 if latent else 2
    shape = (planes, num_blocks, block_size, num_kv_heads, head_dim)
    store = KV_STORAGE_DTYPES.get(kv_dtype, dtype)
    if fill is None:
        kv = torch.zeros(shape, dtype=store, device=device)
    elif store.is_floating_point:
        kv = torch.full(shape, fill, dtype=torch.float32, device=device).to(store)
    else:
        kv = torch.full(shape, int(fill) if fill == fill else 0, dtype=store, device=device)
    cache = KVCache(kv=kv)
    if kv_dtype == "int8":
        f = float("nan") if fill is not None and fill != fill else 0.0
        cache.token_scales = torch.full(
            (planes, num_blocks, block_size, num_kv_heads), f, dtype=torch.float32, device=device
        )
    elif kv_dtype.startswith("fp8"):
        sshape: tuple[int, ...] = () if kv_scale_granularity == "per_tensor" else (num_kv_heads,)
        cache.k_scale = torch.broadcast_to(
            torch.as_tensor(k_scale, dtype=torch.float32, device=device), sshape
        ).clone()
        if not latent:
            cache.v_scale = torch.broadcast_to(
                torch.as_tensor(v_scale, dtype=torch.float32, device=device), sshape
            ).clone()
    return cache


@dataclass
class AttentionMetadata:
    """What one forward step computes, for every layer.

    Attributes:
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query tokens; sequence
            ``i``'s new tokens are rows ``query_start_loc[i]:query_start_loc[i+1]``.
        seq_lens: ``[num_seqs]`` int32, tokens in the KV cache for each sequence once
            this step's K/V are written (context + new tokens).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 physical block ids;
            entries past a sequence's last block are padding (``PAD_BLOCK`` = -1) and
            are never read.
        slot_mapping: ``[num_tokens]`` int64, the slot each new token's K/V is written
            to; -1 = padding, never written.
        max_query_len: max over sequences of the query length (1 for pure decode).
        max_seq_len: max over sequences of ``seq_lens``.
        query_lens_cpu / seq_lens_cpu: the same numbers as Python lists (host side),
            so launchers need no device sync.

    Per-backend data derived from a step lives in the backend's typed plan
    (``AttentionBackend.plan`` -> ``kvpage.attention.plan.StepPlan``), not here.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        *,
        device: torch.device | str = "cpu",
        slot_mapping: list[int] | None = None,
    ) -> AttentionMetadata:
        """Build metadata from host lists; the slot mapping is derived from the block
        tables unless given (``slots_of`` the new positions ``seq_len - query_len ..
        seq_len - 1``); block tables are padded with ``PAD_BLOCK``.

        Raises:
            ShapeError: lengths disagree, a query is longer than its sequence, or a
                block table is too short for its sequence.
        """
        from kvpage.errors import ShapeError

        n = len(seq_lens)
        if len(query_lens) != n or len(block_tables) != n:
            raise ShapeError(
                f"query_lens/block_tables: expected {n} entries each, got "
                f"{len(query_lens)}/{len(block_tables)}"
            )
        slots: list[int] = []
        for i in range(n):
            q, s, bt = query_lens[i], seq_lens[i], block_tables[i]
            if q < 0 or s < q:
                raise ShapeError(f"query_lens[{i}]: expected 0 <= q <= seq_len={s}, got {q}")
            need = -(-s // block_size)
            if len(bt) < need:
                raise ShapeError(
                    f"block_tables[{i}]: expected >= {need} blocks for {s} tokens, got {len(bt)}"
                )
            if slot_mapping is None:
                slots.extend(slots_of(bt, s - q, s, block_size))
        if slot_mapping is not None:
            slots = list(slot_mapping)
        width = max([len(b) for b in block_tables] + [1])
        bt_t = torch.full((n, width), PAD_BLOCK, dtype=torch.int32)
        for i, b in enumerate(block_tables):
            if b:
                bt_t[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=bt_t.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "KV_STORAGE_DTYPES",
    "MODEL_DTYPES",
    "PAD_BLOCK",
    "AttentionMetadata",
    "KVCache",
    "allocate_kv_cache",
    "allocate_model_kv_caches",
    "kv_caches_nbytes",
    "allocate_layer_cache",
    "kv_cache_shape",
    "slot_of",
    "slots_of",
]
