"""The native-cpu backend's ``LayerOps`` (RMSNorm with residual, RoPE of the fused
q/k/v projection, SiLU·mul) against the torch formulas of ``kvpage.models`` they
replace, and the engine's greedy tokens with and without them."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from kvpage_native_cpu import NativeCpuBackend, build
from kvpage_native_cpu import backend as native_backend

from kvpage.attention.protocol import LayerOps
from kvpage.errors import DTypeError, ShapeError
from kvpage.models.rope import RotaryEmbedding, apply_rope_qkv

pytestmark = pytest.mark.skipif(
    shutil.which(build.compiler().split()[0]) is None, reason="no C compiler"
)
CPU = torch.device("cpu")


def _ops() -> LayerOps:
    ops = NativeCpuBackend().layer_ops(torch.float32, CPU)
    assert ops is not None and isinstance(ops, LayerOps)
    return ops


def test_offered_for_float32_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    b = NativeCpuBackend()
    assert b.layer_ops(torch.float32, CPU) is not None
    assert b.layer_ops(torch.bfloat16, CPU) is None
    assert b.layer_ops(torch.float32, torch.device("cuda")) is None
    monkeypatch.setattr(native_backend, "LAYER_OPS", False)
    assert b.layer_ops(torch.float32, CPU) is None


@pytest.mark.parametrize("rows", [0, 1, 7, 33])
@pytest.mark.parametrize("n", [8, 64, 100, 768])
def test_rms_norm_matches_torch(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, generator=g) * 3
    res = torch.randn(rows, n, generator=g)
    w = torch.randn(n, generator=g)
    x0, res0 = x.clone(), res.clone()
    s, y = _ops().rms_norm(x, w, 1e-5)
    assert s is x
    torch.testing.assert_close(y, F.rms_norm(x, (n,), w, 1e-5), rtol=2e-6, atol=2e-6)
    s, y = _ops().rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(s, res + x)  # one rounding, as torch's add
    torch.testing.assert_close(y, F.rms_norm(res + x, (n,), w, 1e-6), rtol=2e-6, atol=2e-6)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs not written


@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])
@pytest.mark.parametrize(("nq", "nkv"), [(8, 4), (4, 4), (12, 1)])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_rope_is_bit_identical_to_apply_rope_qkv(
    head_dim: int, nq: int, nkv: int, rows: int
) -> None:
    g = torch.Generator().manual_seed(head_dim * 100 + nq * 10 + rows)
    # a fused projection's rows: q, k, v columns, then an unrelated column block (strided)
    wide = torch.randn(rows, (nq + 2 * nkv) * head_dim + 16, generator=g) * 4
    qkv = wide[:, : (nq + 2 * nkv) * head_dim]
    rot = RotaryEmbedding(head_dim, 10000.0, 64)
    pos = torch.randint(0, 3000, (rows,), generator=g)
    cos, sin = rot(pos, torch.float32, signed=True)
    q, k = _ops().rope_qk(qkv, nq, nkv, cos, sin)
    wq, wk = apply_rope_qkv(qkv, nq, nkv, cos, sin)
    assert torch.equal(q, wq) and torch.equal(k, wk)
    assert q.is_contiguous() and k.is_contiguous()


@pytest.mark.parametrize("i", [1, 16, 172, 1376])
def test_silu_mul_matches_torch(i: int) -> None:
    g = torch.Generator().manual_seed(i)
    gu = torch.randn(9, 2 * i, generator=g) * 6
    gu[0, : min(i, 4)] = torch.tensor([-100.0, 100.0, 0.0, -0.0])[: min(i, 4)]
    got = _ops().silu_mul(gu)
    want = F.silu(gu[:, :i]) * gu[:, i:]
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)
    assert torch.isfinite(got).all()


def test_refusals_by_name() -> None:
    ops = _ops()
    with pytest.raises(DTypeError, match="x: expected float32, got torch.bfloat16"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(ShapeError, match=r"x, weight: expected \[rows, n\] and \[n\]"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ShapeError, match="residual: expected"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5, residual=torch.ones(3, 8))
    with pytest.raises(ShapeError, match="gate_up: expected"):
        ops.silu_mul(torch.ones(2, 7))
    with pytest.raises(ShapeError, match="qkv.device: expected cpu, got meta"):
        ops.rope_qk(
            torch.ones(2, 24, device="meta"), 1, 1, torch.ones(2, 1, 8), torch.ones(2, 1, 8)
        )
    with pytest.raises(ShapeError, match="qkv: expected"):
        ops.rope_qk(torch.ones(2, 10), 1, 1, torch.ones(2, 1, 8), torch.ones(2, 1, 8))


def test_engine_tokens_equal_with_and_without_layer_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpage.engine import LLM, SamplingParams

    prompts = ["Once upon a time", "The little dog", "Lily and Ben went to the park and"]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = {}
    for on in (False, True):
        monkeypatch.setattr(native_backend, "LAYER_OPS", on)
        llm = LLM(backend="native-cpu", num_threads=1)
        got[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got[True] == got[False]
