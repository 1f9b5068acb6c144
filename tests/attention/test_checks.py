"""The shared checks of ``kvpage.attention.checks`` called directly, each named error
at its boundary — in particular the launcher checks that only the plugin backends
call (the conformance contract tests reach them only through a plugin). Together with
``conformance/test_contract.py`` these are the tests of docs/mutation-testing.md."""

from __future__ import annotations

import pytest
import torch

from kvpage.attention import checks
from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_kv_cache
from kvpage.attention.plan import plan_step
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import make_attention_spec


def _cache(kv_dtype: str = "auto", **kw: object) -> KVCache:
    return allocate_kv_cache(4, 2, 2, 8, dtype=torch.float32, kv_dtype=kv_dtype, **kw)  # type: ignore[arg-type]


def test_check_cache_layout() -> None:
    checks.check_cache(_cache())
    with pytest.raises(ShapeError, match=r"cache.kv: expected \[2, num_blocks"):
        checks.check_cache(KVCache(kv=torch.zeros(3, 4, 2, 2, 8)))  # 5-D, 3 planes
    with pytest.raises(ShapeError, match=r"mine.kv: expected \[2, num_blocks"):
        checks.check_cache(KVCache(kv=torch.zeros(2, 4, 2, 16)), "mine")  # 4-D
    checks.check_cache(_cache("fp8_e4m3", kv_scale_granularity="per_head"))


def test_check_cache_scale_messages_name_both_shapes() -> None:
    """Scale errors state the expected and the actual shape in full (num_kv_heads = 2
    and head_dim = 8 differ, so a message naming the wrong dimension is caught)."""
    c = _cache("int8")
    c.token_scales = torch.zeros(2, 4, 2, 3)
    with pytest.raises(
        ShapeError, match=r"^cache.token_scales: expected \[2, 4, 2, 2\], got \[2, 4, 2, 3\]$"
    ):
        checks.check_cache(c)
    c.token_scales = None
    with pytest.raises(
        ShapeError, match=r"^cache.token_scales: expected \[2, 4, 2, 2\], got None$"
    ):
        checks.check_cache(c)
    f = _cache("fp8_e4m3", kv_scale_granularity="per_head")
    f.k_scale = torch.ones(3)
    with pytest.raises(ShapeError, match=r"^cache.k_scale: expected \[\] or \[2\], got \[3\]$"):
        checks.check_cache(f)
    f.k_scale, f.v_scale = torch.ones(()), None
    with pytest.raises(ShapeError, match=r"^cache.v_scale: expected \[\] or \[2\], got None$"):
        checks.check_cache(f)


def test_check_device_one_error_type() -> None:
    checks.check_device("x", torch.zeros(1), torch.device("cpu"))
    with pytest.raises(ShapeError, match="x.device: expected meta, got cpu"):
        checks.check_device("x", torch.zeros(1), torch.device("meta"))


def test_check_write_kv_index_dtypes() -> None:
    c, k = _cache(), torch.zeros(2, 2, 8)
    with pytest.raises(DTypeError, match="slot_mapping: expected int64, got torch.bool"):
        checks.check_write_kv(k, k, c, torch.tensor([True, False]))
    with pytest.raises(ShapeError, match=r"slot_mapping: expected \[2\], got \[1, 2\]"):
        checks.check_write_kv(k, k, c, torch.tensor([[0, 1]]))
    checks.check_write_kv(k, k, c, torch.tensor([-1, 7]))  # both ends of the range


def test_check_forward_plan_device() -> None:
    spec = make_attention_spec(num_q_heads=2, num_kv_heads=2, head_dim=8)
    plan = plan_step(AttentionMetadata.build([1], [3], [[1, 2]], 2, device="meta"))
    with pytest.raises(ShapeError, match="meta.device: expected cpu"):
        checks.check_forward(torch.zeros(1, 2, 8), _cache(), plan, spec, None)
    cpu = plan_step(AttentionMetadata.build([1], [3], [[1, 2]], 2))
    with pytest.raises(ShapeError, match="out.device"):
        checks.check_forward(torch.zeros(1, 2, 8), _cache(), cpu, spec, torch.zeros(1, 2, 8, device="meta"))  # fmt: skip
    assert checks.check_launch_forward(torch.zeros(1, 2, 8), _cache(), cpu, spec, None) == "auto"


def test_check_block_pairs_range_ends() -> None:
    checks.check_block_pairs(torch.tensor([[0, 3]]), 4)  # ids 0 and num_blocks - 1
    checks.check_block_pairs(torch.zeros(0, 2, dtype=torch.int64), 4)
    with pytest.raises(ShapeError, match=r"pairs: expected block ids in \[0, 3\], got \[0, 4\]"):
        checks.check_block_pairs(torch.tensor([[0, 4]]), 4)


def test_check_launch_cache() -> None:
    assert checks.check_launch_cache(_cache("int8")) == "int8"
    assert checks.check_launch_cache(_cache("fp8_e5m2")) == "fp8_e5m2"
    with pytest.raises(DTypeError, match=r"cache.kv.dtype: expected float32\|"):
        checks.check_launch_cache(KVCache(kv=torch.zeros(2, 4, 2, 2, 8, dtype=torch.int32)))
    c = _cache("int8")
    c.token_scales = c.token_scales.half()  # type: ignore[union-attr]
    with pytest.raises(DTypeError, match="cache.token_scales.dtype: expected float32, got torch.float16"):  # fmt: skip
        checks.check_launch_cache(c)
    f = _cache("fp8_e4m3")
    f.v_scale = torch.ones((), device="meta")
    with pytest.raises(ShapeError, match="cache.v_scale.device: expected cpu, got meta"):
        checks.check_launch_cache(f)


def test_check_launch_write() -> None:
    c, k = _cache(), torch.zeros(2, 2, 8)
    slots = torch.tensor([0, 1])
    assert checks.check_launch_write(k, k, c, slots) == "auto"
    assert checks.check_launch_write(k, k, c, slots.int(), same_dtype=True) == "auto"
    with pytest.raises(DTypeError, match="value: expected torch.float32 .the key dtype., got torch.float16"):  # fmt: skip
        checks.check_launch_write(k, k.half(), _cache("int8"), slots, same_dtype=True)
    checks.check_launch_write(k, k.half(), _cache("int8"), slots)  # mixed dtypes allowed
    with pytest.raises(DTypeError, match="value: expected the cache dtype torch.float32, got torch.float16"):  # fmt: skip
        checks.check_launch_write(k, k.half(), c, slots)
    with pytest.raises(DTypeError, match="key: expected the cache dtype torch.float32, got torch.bfloat16"):  # fmt: skip
        checks.check_launch_write(k.bfloat16(), k, c, slots)
    assert checks.check_launch_write(k.half(), k.half(), _cache("int8"), slots) == "int8"
    with pytest.raises(DTypeError, match="slot_mapping: expected int64, got torch.int16"):
        checks.check_launch_write(k, k, c, slots.to(torch.int16))
    with pytest.raises(ShapeError, match="slot_mapping.device: expected cpu, got meta"):
        checks.check_launch_write(k, k, c, slots.to("meta"))


def test_check_independent_pairs() -> None:
    caches = [_cache(), _cache("int8")]
    host = checks.check_independent_pairs(caches, torch.tensor([[0, 1], [0, 2]], dtype=torch.int32))  # fmt: skip
    assert host.dtype == torch.int64 and host.tolist() == [[0, 1], [0, 2]]
    with pytest.raises(DTypeError, match="pairs: expected int64, got torch.int16"):
        checks.check_independent_pairs(caches, torch.tensor([[0, 1]], dtype=torch.int16))
    with pytest.raises(ShapeError, match=r"pairs\[:, 1\]: expected distinct destination blocks, got \[2, 2\]"):  # fmt: skip
        checks.check_independent_pairs(caches, torch.tensor([[0, 2], [1, 2]]))
    with pytest.raises(ShapeError, match=r"expected no block as both source and destination, got \[1\]"):  # fmt: skip
        checks.check_independent_pairs(caches, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ShapeError, match=r"pairs: expected block ids in \[0, 3\]"):
        checks.check_independent_pairs(caches, torch.tensor([[0, 4]]))
    bad = _cache("int8")
    bad.token_scales = bad.token_scales.double()  # type: ignore[union-attr]
    with pytest.raises(DTypeError, match=r"caches\[1\].token_scales.dtype"):
        checks.check_independent_pairs([_cache(), bad], torch.tensor([[0, 1]]))
