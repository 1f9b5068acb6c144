"""Attention test cases as plain data, and their materialization with poisoning.

An ``AttentionCase`` is everything needed to rebuild a step deterministically: the
layer spec, dtypes, pool geometry, per-sequence lengths, the physical block tables and
a seed for the data. ``materialize`` turns it into tensors: logical K/V per sequence,
queries, a poisoned cache (NaN everywhere) holding exactly the sequences' tokens
(written by the reference writer), the step metadata and a poisoned output buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_kv_cache, slot_of
from kvpage.attention.reference import reference_write_kv
from kvpage.specs import AttentionSpec, CacheSpec, make_cache_spec

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class AttentionCase:
    """One step of paged attention, as data.

    Attributes:
        spec: the layer (heads, head_dim, scale, window, soft cap).
        dtype: model/query dtype name (float32|float16|bfloat16).
        kv_dtype: auto|int8|fp8_e4m3|fp8_e5m2.
        scale_granularity: fp8 scales per_tensor or per_head.
        k_scale / v_scale: fp8 scales, one per KV head (per_tensor uses the first).
        block_size: tokens per block.
        num_blocks: blocks in the pool (block 0 is the null block, never used).
        seq_lens / query_lens: per sequence, tokens in the cache after the step / new
            tokens of the step (decode: all 1).
        block_tables: physical block ids per sequence (exactly enough blocks).
        seed: seed of the K/V/query data.
        magnitude: standard deviation of the K/V/query data.
        sinks: attention-sink logits, one per query head, exactly when
            ``spec.sinks`` (gpt-oss); None otherwise.
    """

    spec: AttentionSpec
    dtype: str
    kv_dtype: str
    block_size: int
    num_blocks: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    seed: int = 0
    magnitude: float = 1.0
    scale_granularity: str = "per_tensor"
    k_scale: tuple[float, ...] = (1.0,)
    v_scale: tuple[float, ...] = (1.0,)
    sinks: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = None if self.sinks is None else len(self.sinks)
        if self.spec.sinks != (n is not None) or (n is not None and n != self.spec.num_q_heads):
            raise ValueError(
                f"sinks: expected {self.spec.num_q_heads} values exactly when spec.sinks "
                f"({self.spec.sinks}), got {self.sinks}"
            )

    def sinks_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """``[num_q_heads]`` float32 sink logits on ``device`` (None without sinks)."""
        if self.sinks is None:
            return None
        return torch.tensor(self.sinks, dtype=torch.float32, device=device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def cache_spec(self) -> CacheSpec:
        """A one-layer CacheSpec of this case (what ``unsupported_reasons`` checks)."""
        return make_cache_spec(
            num_layers=1,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            kv_scale_granularity=self.scale_granularity,
            layers=(self.spec.model_dump(),),
        )

    def with_layout(
        self, block_size: int, block_tables: list[list[int]], num_blocks: int
    ) -> AttentionCase:
        """The same logical tokens under another block size / physical placement."""
        return replace(
            self,
            block_size=block_size,
            num_blocks=num_blocks,
            block_tables=tuple(tuple(b) for b in block_tables),
        )

    def describe(self) -> str:
        s = self.spec
        return (
            f"Hq={s.num_q_heads} Hkv={s.num_kv_heads} D={s.head_dim} scale={s.scale:.4g} "
            f"W={s.sliding_window} cap={s.logits_soft_cap} sinks={self.sinks} "
            f"{self.dtype}/{self.kv_dtype}"
            f"({self.scale_granularity}) bs={self.block_size} pool={self.num_blocks} "
            f"seq_lens={list(self.seq_lens)} query_lens={list(self.query_lens)}"
        )


@dataclass
class Materialized:
    """Tensors of a case on one device.

    Attributes:
        keys / values: per sequence ``[seq_len, num_kv_heads, head_dim]`` model dtype
            (the exact, unquantized values given to write_kv).
        query: ``[num_tokens, num_q_heads, head_dim]`` model dtype.
        cache: poisoned (NaN) cache holding every sequence's tokens.
        meta: the step's metadata (not yet planned).
        new_keys / new_values / slot_mapping: the step's new tokens, packed.
        sinks: ``[num_q_heads]`` float32 sink logits for ``forward(..., sinks=)``, or
            None.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    query: torch.Tensor
    cache: KVCache
    meta: AttentionMetadata
    new_keys: torch.Tensor
    new_values: torch.Tensor
    slot_mapping: torch.Tensor
    sinks: torch.Tensor | None = None
    extras: dict[str, object] = field(default_factory=dict)


def poisoned_cache(case: AttentionCase, device: torch.device | str) -> KVCache:
    """A cache for ``case`` whose every slot is NaN (int8: codes 0, scales NaN)."""
    h = case.spec.num_kv_heads
    scales = case.k_scale if case.scale_granularity == "per_head" else case.k_scale[:1]
    vsc = case.v_scale if case.scale_granularity == "per_head" else case.v_scale[:1]
    cache = allocate_kv_cache(
        case.num_blocks,
        case.block_size,
        h,
        case.spec.head_dim,
        dtype=case.torch_dtype,
        kv_dtype=case.kv_dtype,
        kv_scale_granularity=case.scale_granularity,
        device=device,
        fill=float("nan"),
    )
    if case.kv_dtype.startswith("fp8"):
        shape = () if case.scale_granularity == "per_tensor" else (h,)
        cache.k_scale = torch.tensor(scales, dtype=torch.float32, device=device).reshape(shape)
        cache.v_scale = torch.tensor(vsc, dtype=torch.float32, device=device).reshape(shape)
    return cache


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    """A NaN-filled tensor with ``x``'s shape, dtype and device (an output buffer)."""
    return torch.full_like(x, float("nan"))


def slot_at(block_table: tuple[int, ...] | list[int], pos: int, block_size: int) -> int:
    """The slot of position ``pos`` of a sequence (``kvpage.attention.metadata.slot_of``
    of its block)."""
    return slot_of(block_table[pos // block_size], pos, block_size)


def make_data(case: AttentionCase) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Deterministic logical K/V per sequence and the step's queries (CPU, model dtype).

    The data depend only on the seed, the heads and the lengths, not on the layout, so
    layout variants of a case see identical tokens.
    """
    g = torch.Generator().manual_seed(case.seed)
    s, dt, m = case.spec, case.torch_dtype, case.magnitude
    keys, values = [], []
    for n in case.seq_lens:
        keys.append((torch.randn(n, s.num_kv_heads, s.head_dim, generator=g) * m).to(dt))
        values.append((torch.randn(n, s.num_kv_heads, s.head_dim, generator=g) * m).to(dt))
    nt = sum(case.query_lens)
    query = (torch.randn(nt, s.num_q_heads, s.head_dim, generator=g) * m).to(dt)
    return keys, values, query


def materialize(
    case: AttentionCase, device: torch.device | str = "cpu", *, write_context: bool = True
) -> Materialized:
    """Build the case's tensors on ``device``.

    Args:
        write_context: write every token of every sequence (context and new tokens)
            with the reference writer; False leaves the whole cache poisoned.
    """
    keys, values, query = make_data(case)
    cache = poisoned_cache(case, device)
    bs = case.block_size
    meta = AttentionMetadata.build(
        list(case.query_lens),
        list(case.seq_lens),
        [list(b) for b in case.block_tables],
        bs,
        device=device,
    )
    if write_context:
        all_slots = [
            slot_at(bt, p, bs) for bt, n in zip(case.block_tables, case.seq_lens) for p in range(n)
        ]
        if all_slots:
            reference_write_kv(
                torch.cat(keys).to(device),
                torch.cat(values).to(device),
                cache,
                torch.tensor(all_slots, dtype=torch.int64, device=device),
            )
    new_k = [k[n - q :] for k, n, q in zip(keys, case.seq_lens, case.query_lens)]
    new_v = [v[n - q :] for v, n, q in zip(values, case.seq_lens, case.query_lens)]
    hk = (0, case.spec.num_kv_heads, case.spec.head_dim)
    return Materialized(
        keys=keys,
        values=values,
        query=query.to(device),
        cache=cache,
        meta=meta,
        new_keys=(torch.cat(new_k) if new_k else torch.zeros(hk, dtype=case.torch_dtype)).to(
            device
        ),
        new_values=(torch.cat(new_v) if new_v else torch.zeros(hk, dtype=case.torch_dtype)).to(
            device
        ),
        slot_mapping=meta.slot_mapping,
        sinks=case.sinks_tensor(device),
    )


def clone_cache(cache: KVCache) -> KVCache:
    """A deep copy of ``cache`` (all tensors cloned)."""
    return KVCache(
        kv=cache.kv.clone(),
        token_scales=None if cache.token_scales is None else cache.token_scales.clone(),
        k_scale=None if cache.k_scale is None else cache.k_scale.clone(),
        v_scale=None if cache.v_scale is None else cache.v_scale.clone(),
    )


def split_block_ids(ids: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Consecutive runs of ``ids``, ``counts[i]`` ids for sequence ``i`` (block tables
    from one list of physical block ids)."""
    tables, k = [], 0
    for n in counts:
        tables.append(list(ids[k : k + n]))
        k += n
    return tables


def make_case(
    seq_lens: tuple[int, ...],
    query_lens: tuple[int, ...] | None = None,
    *,
    hq: int = 4,
    hk: int = 2,
    hd: int = 16,
    bs: int = 4,
    dtype: str = "float32",
    kv_dtype: str = "auto",
    window: int | None = None,
    cap: float | None = None,
    seed: int = 0,
    k_scale: tuple[float, ...] = (0.25,),
    v_scale: tuple[float, ...] = (0.5,),
    granularity: str = "per_tensor",
    sinks: tuple[float, ...] | None = None,
) -> AttentionCase:
    """A hand-written case (for plugin tests, with ``run_plugin_case``): ``seq_lens``
    tokens per sequence of which ``query_lens`` (default 1 each: decode) are new; the
    blocks are a seeded random permutation of a pool with 3 spare blocks (block 0
    unused); fp8 scales ``k_scale``/``v_scale`` (one, or one per KV head with
    ``granularity="per_head"``); ``sinks``: one attention-sink logit per query head."""
    query_lens = query_lens or tuple(1 for _ in seq_lens)
    need = [-(-n // bs) for n in seq_lens]
    nb = sum(need) + 3
    perm = (torch.randperm(nb - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables = [tuple(t) for t in split_block_ids(perm, need)]
    spec = AttentionSpec(
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=hd,
        sliding_window=window,
        logits_soft_cap=cap,
        sinks=sinks is not None,
    )
    return AttentionCase(
        spec=spec,
        dtype=dtype,
        kv_dtype=kv_dtype,
        block_size=bs,
        num_blocks=nb,
        seq_lens=tuple(seq_lens),
        query_lens=tuple(query_lens),
        block_tables=tuple(tables),
        seed=seed,
        scale_granularity=granularity,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )
