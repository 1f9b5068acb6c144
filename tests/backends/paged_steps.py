"""One random paged attention step for the CPU kernel tests (numba-cpu, native-cpu): the
same seed gives the same cache, block tables and queries in every test module."""

from __future__ import annotations

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_kv_cache
from kvpage.testing.cases import split_block_ids


def paged_step(
    seq_lens: list[int], query_lens: list[int], bs: int = 16, d: int = 32, seed: int = 0
) -> tuple[KVCache, AttentionMetadata, torch.Tensor, list[list[int]]]:
    """``(cache, metadata, query, block_tables)``: 4 KV heads of ``d`` dims in blocks of
    ``bs`` tokens, float32 random K/V, the blocks a seeded permutation of ids 1.. (block 0
    unused), 8 query heads."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // bs) for s in seq_lens]
    cache = allocate_kv_cache(sum(nblk) + 1, bs, 4, d, dtype=torch.float32)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    perm = (torch.randperm(sum(nblk), generator=g) + 1).tolist()
    tables = split_block_ids(perm, nblk)
    meta = AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=bs
    )
    q = torch.randn(sum(query_lens), 8, d, generator=g)
    return cache, meta, q, tables
