"""KVCacheManager.truncate: speculative decoding's KV rollback frees the blocks past the
accepted length (unhashed), never a committed block, and keeps the pool consistent."""

from __future__ import annotations

import pytest
from cache_helpers import make_spec

from kvpage.cache import KVCacheManager
from kvpage.errors import AllocationError


@pytest.mark.parametrize("windows", [(None,), (None, 8)])
def test_truncate_frees_tail_blocks_unhashed(windows: tuple[int | None, ...]) -> None:
    kvm = KVCacheManager(make_spec(32, 4, windows, kv_pool="unified"))
    toks = list(range(100, 110))
    assert kvm.allocate("r", toks, 9) is not None  # positions 0..8: 3 blocks
    kvm.commit("r", toks, 9)  # 2 full blocks hashed
    used = kvm.num_used_blocks
    # a verify step: the last token plus 5 drafts at positions 9..14 (4 blocks)
    assert kvm.allocate("r", toks + [1, 2, 3, 4, 5], 6) is not None
    assert kvm.num_used_blocks > used
    kvm.truncate("r", 11)  # accepted 1 draft: positions 0..10 stay, 3 blocks
    assert kvm.num_allocated_tokens("r") == 11
    assert all(len(t) == 3 for t in kvm.block_tables("r"))
    assert kvm.num_used_blocks == used
    kvm.check_integrity()
    # the next step allocates from the rolled-back length
    assert kvm.allocate("r", toks + [1, 7], 1) is not None
    assert kvm.num_allocated_tokens("r") == 12
    with pytest.raises(AllocationError, match=r"num_tokens: expected in \[8, 12\]"):
        kvm.truncate("r", 7)  # inside a committed block
    with pytest.raises(AllocationError, match=r"num_tokens: expected in \[8, 12\]"):
        kvm.truncate("r", 13)
    kvm.free("r")
    kvm.check_integrity()
    assert kvm.num_used_blocks == 0
