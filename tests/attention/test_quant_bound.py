"""The quantization-error bound of the conformance harness stays finite (regression: a
Hypothesis draw with head_dim 256, scale 1 and magnitude 4 made ``exp(2d)`` overflow and
failed ``test_decode_matches_reference`` on every backend with an OverflowError)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpage.backends import get_backend
from kvpage.specs import AttentionSpec
from kvpage.testing import check_attention_case
from kvpage.testing.cases import make_case


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_large_logit_shift_bound_does_not_overflow(kv_dtype: str) -> None:
    case = make_case(
        (9, 6), hq=2, hk=2, hd=256, dtype="bfloat16", kv_dtype=kv_dtype,
        window=55, k_scale=(1.0, 2.0), v_scale=(0.25, 0.25), granularity="per_head",
    )  # fmt: skip
    s = case.spec
    spec = AttentionSpec(
        num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        scale=1.0,
        sliding_window=s.sliding_window,
    )
    check_attention_case(get_backend("torch"), replace(case, spec=spec, magnitude=4.0), "cpu")
