"""Fused and oneDNN-prepacked projections (``kvpage.models.linears``) equal the plain
linears, and follow the weights when they are replaced or modified in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpage.models import linears as L
from kvpage.models import rope as R


@pytest.fixture(autouse=True)
def _pack_small_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests use tiny weights: let them take the oneDNN path when the MACs rule
    says so (the weight-size floor and the per-dtype rules have their own tests)."""
    monkeypatch.setattr(L, "PACK_MIN_WEIGHT", 0)
    monkeypatch.setattr(L, "PACK_MIN_ROWS_FP32", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_weight_equals_f_linear(
    dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not L.onednn_packs(dtype):
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype} weights")
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)  # the oneDNN path even for tiny shapes
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    got = L.PackedWeight()(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)


def test_a_dtype_onednn_cannot_pack_takes_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU whose oneDNN refuses a dtype (bfloat16 without AVX-512), the weight is
    never packed and the call is plain ``F.linear`` instead of a RuntimeError."""
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)
    monkeypatch.setattr(L, "onednn_packs", lambda dtype: False)
    x, w = torch.randn(4, 48).bfloat16(), torch.randn(40, 48).bfloat16()
    assert L.pack_min_rows(w) == L.NEVER_PACK
    pw = L.PackedWeight()
    assert torch.equal(pw(x, w, None), F.linear(x, w))
    assert pw.packed is None


def test_onednn_packs_float32_where_onednn_exists() -> None:
    assert L.onednn_packs(torch.float32) == torch.backends.mkldnn.is_available()


def test_packed_weight_follows_in_place_and_replaced_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)
    lin = nn.Linear(16, 8, bias=False)
    pw = L.PackedWeight()
    x = torch.randn(3, 16)
    first = pw(x, lin.weight, None)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: version counter moves
    torch.testing.assert_close(pw(x, lin.weight, None), 2 * first, rtol=1e-5, atol=1e-5)
    lin.weight = nn.Parameter(torch.zeros(8, 16))  # replaced: new storage
    assert pw(x, lin.weight, None).abs().max().item() == 0.0


def test_fused_linear_keeps_hf_names_and_follows_load_state_dict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)
    parts = [nn.Linear(12, n, bias=True) for n in (8, 4, 4)]
    fused = L.FusedLinear(parts)
    x = torch.randn(5, 12)
    want = torch.cat([F.linear(x, m.weight, m.bias) for m in parts], dim=-1)
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)
    assert [tuple(m.weight.shape) for m in parts] == [(8, 12), (4, 12), (4, 12)]
    new = {"weight": torch.randn(4, 12), "bias": torch.randn(4)}
    parts[1].load_state_dict(new, assign=True)  # a new tensor: fused again
    got = fused(x)[:, 8:12]
    torch.testing.assert_close(got, F.linear(x, new["weight"], new["bias"]), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        parts[2].weight.zero_()  # in place through the fused view
        parts[2].bias.zero_()
    assert fused(x)[:, 12:].abs().max().item() == 0.0


def test_pack_linears_off_is_plain_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "PACK_LINEARS", False)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    assert torch.equal(L.PackedWeight()(x, w, None), F.linear(x, w))


def test_fused_linear_with_some_parts_bias_free() -> None:
    parts = [nn.Linear(6, 4, bias=True), nn.Linear(6, 3, bias=False)]
    x = torch.randn(2, 6)
    want = torch.cat([parts[0](x), parts[1](x)], dim=-1)
    torch.testing.assert_close(L.FusedLinear(parts)(x), want, rtol=1e-5, atol=1e-5)


def test_packed_weight_decision_follows_dtype_and_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-weight decision (``pack_min_rows``) is kept between calls but follows a
    weight of another dtype or shape and a change of the module settings."""
    calls: list[int] = []
    real = L.pack_min_rows

    def counting(w: torch.Tensor) -> int:
        calls.append(1)
        return real(w)

    monkeypatch.setattr(L, "pack_min_rows", counting)
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)
    pw = L.PackedWeight()
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    for _ in range(3):
        torch.testing.assert_close(pw(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 and pw.min_rows == 0 and pw.key is not None  # decided once, packed
    monkeypatch.setattr(L, "PACK_MIN_MACS", 10**9)  # settings changed: decided again
    pw.key = None
    assert torch.equal(pw(x, w, None), F.linear(x, w)) and len(calls) == 2
    assert pw.key is None  # the plain path: nothing packed
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)
    w16 = w.to(torch.float16)  # another dtype: never packed
    x16 = x.to(torch.float16)
    assert torch.equal(pw(x16, w16, None), F.linear(x16, w16)) and len(calls) == 3
    assert pw.min_rows == L.NEVER_PACK and pw.key is None


@pytest.mark.parametrize(
    ("macs", "shape", "rows"),
    [(0, (6, 8), 0), (48, (6, 8), 1), (49, (6, 8), 2), (96, (6, 8), 2), (97, (6, 8), 3)],
)
def test_pack_min_rows_is_the_smallest_row_count(
    macs: int, shape: tuple[int, int], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rows * out * in >= PACK_MIN_MACS`` exactly from ``pack_min_rows`` rows on."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN (mkldnn) not available in this torch build")
    monkeypatch.setattr(L, "PACK_MIN_MACS", macs)
    assert L.pack_min_rows(torch.zeros(shape)) == rows
    assert L.pack_min_rows(torch.zeros(shape, dtype=torch.float16)) == L.NEVER_PACK
    monkeypatch.setattr(L, "PACK_LINEARS", False)
    assert L.pack_min_rows(torch.zeros(shape)) == L.NEVER_PACK


@pytest.mark.parametrize("rows_fp32", [0, 3])
def test_pack_min_rows_per_dtype(rows_fp32: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 follows ``PACK_MIN_MACS_BF16`` (packed from the first row by default),
    float32 ``PACK_MIN_MACS`` and never fewer than ``PACK_MIN_ROWS_FP32`` rows."""
    if not (L.onednn_packs(torch.float32) and L.onednn_packs(torch.bfloat16)):
        pytest.skip("this CPU's oneDNN cannot pack both float32 and bfloat16 weights")
    monkeypatch.setattr(L, "PACK_MIN_WEIGHT", 1 << 16)
    monkeypatch.setattr(L, "PACK_MIN_MACS", 1 << 20)
    monkeypatch.setattr(L, "PACK_MIN_ROWS_FP32", rows_fp32)
    big = torch.zeros(4096, 768)  # 3.1M multiply-adds per row
    assert L.pack_min_rows(big) == max(rows_fp32, 1)
    assert L.pack_min_rows(torch.zeros(768, 768)) == max(rows_fp32, 2)  # 590k per row
    assert L.pack_min_rows(torch.zeros(768, 768, dtype=torch.bfloat16)) == 0
    monkeypatch.setattr(L, "PACK_MIN_MACS_BF16", 1 << 20)
    assert L.pack_min_rows(torch.zeros(768, 768, dtype=torch.bfloat16)) == 2
    assert L.pack_min_rows(torch.zeros(64, 64, dtype=torch.bfloat16)) == L.NEVER_PACK
    x = torch.randn(1, 768, dtype=torch.bfloat16)
    w = torch.randn(768, 768, dtype=torch.bfloat16)
    pw = L.PackedWeight()
    monkeypatch.setattr(L, "PACK_MIN_MACS_BF16", 0)
    torch.testing.assert_close(pw(x, w, None), F.linear(x, w), rtol=2e-2, atol=2e-2)
    assert pw.key is not None  # one bf16 row: the oneDNN path


def test_fused_linear_follows_settings_after_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused weight's decision is re-made when the settings change after use."""
    parts = [nn.Linear(8, 4, bias=False), nn.Linear(8, 2, bias=False)]
    fused = L.FusedLinear(parts)
    x = torch.randn(3, 8)
    want = torch.cat([F.linear(x, m.weight) for m in parts], dim=-1)
    monkeypatch.setattr(L, "PACK_MIN_MACS", 10**9)
    torch.testing.assert_close(fused(x), want)
    assert fused._packed.key is None  # plain F.linear
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)
    if torch.backends.mkldnn.is_available():
        assert fused._packed.key is not None  # now the oneDNN path


def test_apply_rope_qk_equals_apply_rope_of_each() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    cos, sin = torch.randn(5, 1, 8, generator=g), torch.randn(5, 1, 8, generator=g)
    rq, rk = R.apply_rope_qk(q, k, cos, sin)
    assert torch.equal(rq, R.apply_rope(q, cos, sin))
    assert torch.equal(rk, R.apply_rope(k, cos, sin))


def test_apply_rope_qkv_bit_identical_to_apply_rope_qk() -> None:
    """The fused-projection rotation (signed sine table, one swap for q and k) rounds
    exactly as the rotate-half form, through the real tables."""
    g = torch.Generator().manual_seed(1)
    hq, hk, d, t = 4, 2, 8, 7
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    rot = R.RotaryEmbedding(d, 10000.0, max_positions=4)
    pos = torch.tensor([0, 3, 5, 9, 1, 2, 40])
    cos, sin = rot(pos, torch.float32)
    cos2, sin_signed = rot(pos, torch.float32, signed=True)
    assert torch.equal(cos, cos2)
    assert torch.equal(sin_signed[..., d // 2 :], sin[..., d // 2 :])
    assert torch.equal(sin_signed[..., : d // 2], -sin[..., : d // 2])
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    want_q, want_k = R.apply_rope_qk(q, k, cos, sin)
    got_q, got_k = R.apply_rope_qkv(qkv, hq, hk, cos, sin_signed)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)


def test_pack_min_weight_keeps_small_weights_on_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights under ``PACK_MIN_WEIGHT`` elements never take the oneDNN path, whatever
    the row count; the decision is re-made when the setting changes."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN (mkldnn) not available in this torch build")
    monkeypatch.setattr(L, "PACK_MIN_MACS", 0)
    monkeypatch.setattr(L, "PACK_MIN_WEIGHT", 6 * 8 + 1)
    assert L.pack_min_rows(torch.zeros(6, 8)) == L.NEVER_PACK
    monkeypatch.setattr(L, "PACK_MIN_WEIGHT", 6 * 8)
    assert L.pack_min_rows(torch.zeros(6, 8)) == 0
    pw, x, w = L.PackedWeight(), torch.randn(4, 8), torch.randn(6, 8)
    monkeypatch.setattr(L, "PACK_MIN_WEIGHT", 10**9)
    torch.testing.assert_close(pw(x, w, None), F.linear(x, w))
    assert pw.key is None  # F.linear
    monkeypatch.setattr(L, "PACK_MIN_WEIGHT", 0)
    torch.testing.assert_close(pw(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert pw.key is not None  # oneDNN now
