"""Shared helpers of the routing tests: small managers with publishers, request driving."""

from __future__ import annotations

from collections.abc import Sequence

from kvpage.cache import KVCacheManager
from kvpage.routing import KVEventPublisher, PrefixIndex
from kvpage.specs import make_cache_spec

BS = 4


def make_manager(num_blocks: int = 12, windows: Sequence[int | None] = (None,)) -> KVCacheManager:
    layers = [dict(num_q_heads=4, num_kv_heads=2, head_dim=8, sliding_window=w) for w in windows]
    spec = make_cache_spec(
        num_layers=len(layers), block_size=BS, num_blocks=num_blocks, layers=layers
    )
    return KVCacheManager(spec)


def make_replica(rid: str, num_blocks: int = 12) -> tuple[KVCacheManager, KVEventPublisher]:
    mgr = make_manager(num_blocks)
    pub = KVEventPublisher(rid)
    pub.attach(mgr)
    return mgr, pub


def run_request(mgr: KVCacheManager, rid: str, tokens: Sequence[int], *, free: bool = True) -> bool:
    """Allocate the whole prompt (taking the prefix hit), commit it, optionally free it;
    False (nothing held) when it does not fit."""
    hit = mgr.get_num_cached_tokens(tokens)
    alloc = mgr.allocate(rid, tokens, len(tokens) - hit, num_cached_tokens=hit)
    if alloc is None:
        return False
    mgr.commit(rid, tokens, len(tokens))
    if free:
        mgr.free(rid)
    return True


def sync(index: PrefixIndex, pub: KVEventPublisher) -> None:
    """Deliver the publisher's pending batch (a heartbeat when nothing is pending, so a
    batch lost earlier shows up as a gap); resync from a snapshot when refused."""
    batch = pub.drain(heartbeat=True)
    assert batch is not None
    if not index.apply(batch):
        index.resync(pub.snapshot())


def pool_hashes(mgr: KVCacheManager) -> frozenset[bytes]:
    return mgr.prefix_pools[0].cached_hashes()
