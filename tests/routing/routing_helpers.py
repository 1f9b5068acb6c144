"""Shared helpers of the routing tests: small managers with publishers, request driving."""

from __future__ import annotations

from collections.abc import Sequence

from kvpage.cache import KVCacheManager
from kvpage.cache.tier_store import DiskTier, HostTier
from kvpage.cache.tiered import TieredCache
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


class BytesMover:
    """A BlockMover over a dict: block 'K/V' is 8 bytes per block id (payload = copy)."""

    block_nbytes = 8

    def __init__(self, num_blocks: int) -> None:
        self.data = {i: bytes(8) for i in range(num_blocks)}

    def read_blocks(self, ids: Sequence[int]) -> list[bytes]:
        return [bytes(self.data[i]) for i in ids]

    def write_blocks(self, ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        for i, p in zip(ids, payloads):
            self.data[i] = bytes(p)


def make_tiered_replica(
    rid: str, num_blocks: int = 8, host_blocks: int = 3, disk: DiskTier | None = None
) -> tuple[KVCacheManager, KVEventPublisher]:
    """A manager with a host tier of ``host_blocks`` blocks (and ``disk`` when given)
    below its pool, and a publisher attached after the tiers (as the engine does)."""
    mgr = make_manager(num_blocks)
    host = HostTier(host_blocks * BytesMover.block_nbytes) if host_blocks else None
    tiers = TieredCache(mgr.pools[0], BytesMover(num_blocks), host=host, disk=disk)
    mgr.attach_tiers(tiers)
    pub = KVEventPublisher(rid)
    pub.attach(mgr)
    return mgr, pub


def tier_hashes(mgr: KVCacheManager, medium: str) -> frozenset[bytes]:
    """What the manager's tier ``medium`` holds now (empty without it)."""
    tiers = mgr.tiers
    t = None if tiers is None else (tiers.host if medium == "host" else tiers.disk)
    return frozenset() if t is None else frozenset(t.hashes())
