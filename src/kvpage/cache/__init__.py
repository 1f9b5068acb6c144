"""Host-side bookkeeping of the paged KV cache.

``KVCacheManager`` is the one allocator the scheduler uses (contract:
``KVAllocator``); it drives one ``GroupManager`` per KV group (``FullAttentionManager``
or ``SlidingWindowManager``), each over the ``BlockPool`` holding that group's blocks; ``hash_block_tokens``/``hash_request_blocks`` compute the
prefix-cache keys (stable across processes, so a router can compute them too);
``slot_mapping``/``batch_block_tables`` turn block tables into step arrays.
Pure Python + numpy: no torch kernels, no engine imports.
"""

from kvpage.cache.block_pool import (
    NULL_BLOCK_ID,
    BlockPool,
    FreeBlockQueue,
    GroupPool,
    KVBlock,
    PoolListener,
)
from kvpage.cache.explain import (
    MISS_REASONS,
    CacheMissExplanation,
    EvictionRecord,
    PoolEvictionRecorder,
)
from kvpage.cache.free_queue import (
    NUM_PRIORITY_LEVELS,
    PRIORITY_DEFAULT,
    PRIORITY_HIGH,
    PRIORITY_LOW,
    PRIORITY_MAX,
    PriorityFreeQueue,
)
from kvpage.cache.group_managers import FullAttentionManager, GroupManager, SlidingWindowManager
from kvpage.cache.hashing import (
    BlockHash,
    encode_extra_keys,
    hash_block_tokens,
    hash_request_blocks,
    root_hash,
)
from kvpage.cache.manager import Allocation, CacheStats, KVCacheManager
from kvpage.cache.protocol import AllocatorStats, KVAllocator
from kvpage.cache.retention import KVRetention, RetentionRange, max_retained_blocks
from kvpage.cache.tables import batch_block_tables, slot_mapping

__all__ = [
    "MISS_REASONS",
    "NULL_BLOCK_ID",
    "NUM_PRIORITY_LEVELS",
    "PRIORITY_DEFAULT",
    "PRIORITY_HIGH",
    "PRIORITY_LOW",
    "PRIORITY_MAX",
    "CacheMissExplanation",
    "EvictionRecord",
    "KVRetention",
    "PoolEvictionRecorder",
    "PriorityFreeQueue",
    "RetentionRange",
    "max_retained_blocks",
    "Allocation",
    "AllocatorStats",
    "BlockHash",
    "BlockPool",
    "GroupPool",
    "CacheStats",
    "FreeBlockQueue",
    "FullAttentionManager",
    "GroupManager",
    "KVAllocator",
    "KVBlock",
    "KVCacheManager",
    "PoolListener",
    "SlidingWindowManager",
    "batch_block_tables",
    "encode_extra_keys",
    "hash_block_tokens",
    "hash_request_blocks",
    "root_hash",
    "slot_mapping",
]
