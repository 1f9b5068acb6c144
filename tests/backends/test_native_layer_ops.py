"""The native-cpu backend's ``LayerOps`` (RMSNorm with residual, RoPE of the fused
q/k/v projection, SiLU·mul) in float32 and bfloat16 against the torch formulas of
``kvpage.models`` they replace (and a float64 reference), its greedy argmax against
``torch.argmax``, and the engine's greedy tokens with and without them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kvpage_native_cpu import NativeCpuBackend, build
from kvpage_native_cpu import backend as native_backend
from kvpage_native_cpu.layer_ops import NativeLayerOps

from kvpage.attention.protocol import GreedyOps, LayerOps
from kvpage.errors import DTypeError, ShapeError
from kvpage.models.layers import RMSNorm
from kvpage.models.rope import RotaryEmbedding, apply_rope_qkv

pytestmark = pytest.mark.skipif(
    shutil.which(build.compiler().split()[0]) is None, reason="no C compiler"
)
CPU = torch.device("cpu")


BF = torch.bfloat16
#: bfloat16's unit roundoff (8 significant bits): one rounding to nearest is within
#: U of the exact value, relatively, for results in the normal range
U = 2.0**-8


def _ops(dtype: torch.dtype = torch.float32) -> NativeLayerOps:
    ops = NativeCpuBackend().layer_ops(dtype, CPU)
    assert ops is not None and isinstance(ops, LayerOps) and isinstance(ops, GreedyOps)
    return ops


def test_offered_for_float32_and_bfloat16_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    b = NativeCpuBackend()
    assert b.layer_ops(torch.float32, CPU) is not None
    ops = b.layer_ops(BF, CPU)
    assert ops is not None and ops.dtype == BF and b.layer_ops(BF, CPU) is ops
    assert b.layer_ops(torch.float16, CPU) is None
    assert b.layer_ops(torch.float32, torch.device("cuda")) is None
    monkeypatch.setattr(native_backend, "LAYER_OPS", False)
    assert b.layer_ops(torch.float32, CPU) is None
    assert b.layer_ops(BF, CPU) is None


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


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart ``a`` and ``b`` are, elementwise (same signs)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(_ulps(a, b).max()) if a.numel() else 0


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max relative error of ``got`` against the float64 ``ref`` where ``ref`` is in
    bfloat16's normal range."""
    normal = ref.abs() >= torch.finfo(BF).tiny
    return float(((got.double() - ref.detach()).abs() / ref.detach().abs())[normal].max())


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("n", [8, 100, 768])
def test_rms_norm_bf16_matches_llama_rmsnorm(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, n, generator=g) * 3).to(BF)
    res = torch.randn(rows, n, generator=g).to(BF)
    norm = RMSNorm(n, 1e-5).to(BF)
    norm.weight.data = torch.randn(n, generator=g).to(BF)
    x0, res0 = x.clone(), res.clone()
    s, y = _ops(BF).rms_norm(x, norm.weight, 1e-5, residual=res)
    s_ref, y_ref = norm.add_forward(x, res)  # the model's torch ops (LlamaRMSNorm form)
    assert s.dtype == y.dtype == BF
    assert torch.equal(s, s_ref)  # bf16(residual + x): one rounding, as torch's add
    # the mean of squares in another order: at most one bf16 step where the float32
    # value sits at a rounding boundary (none in these rows)
    assert _max_ulps(y, y_ref) <= 1
    s64 = s_ref.double()
    ref = norm.weight.double() * s64 / torch.sqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
    if rows:  # two bf16 roundings (the normalised row, the weight product): 2U + U^2
        assert _rel(y, ref) <= 2 * U + U * U
    assert _max_ulps(_ops(BF).rms_norm(x, norm.weight, 1e-5)[1], norm(x)) <= 1
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs not written


@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])
@pytest.mark.parametrize(("nq", "nkv"), [(8, 4), (12, 1)])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_rope_bf16_is_bit_identical_to_apply_rope_qkv(
    head_dim: int, nq: int, nkv: int, rows: int
) -> None:
    g = torch.Generator().manual_seed(head_dim * 100 + nq * 10 + rows)
    wide = (torch.randn(rows, (nq + 2 * nkv) * head_dim + 16, generator=g) * 4).to(BF)
    qkv = wide[:, : (nq + 2 * nkv) * head_dim]  # strided rows
    rot = RotaryEmbedding(head_dim, 10000.0, 64)
    pos = torch.randint(0, 3000, (rows,), generator=g)
    cos, sin = rot(pos, BF, signed=True)
    q, k = _ops(BF).rope_qk(qkv, nq, nkv, cos, sin)
    wq, wk = apply_rope_qkv(qkv, nq, nkv, cos, sin)
    assert q.dtype == k.dtype == BF
    assert torch.equal(q, wq) and torch.equal(k, wk)


@pytest.mark.parametrize("i", [1, 16, 172, 2048])
def test_silu_mul_bf16_matches_torch(i: int) -> None:
    g = torch.Generator().manual_seed(i)
    gu = (torch.randn(9, 2 * i, generator=g) * 6).to(BF)
    gu[0, : min(i, 4)] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(BF)[: min(i, 4)]
    got = _ops(BF).silu_mul(gu)
    want = F.silu(gu[:, :i]) * gu[:, i:]  # the model's torch ops: two bf16 roundings
    assert got.dtype == BF and torch.isfinite(got).all()
    # exp by another polynomial: one bf16 step at most, where silu(g) in float32 sits
    # at a rounding boundary; a result below bf16's normal range may be a signed zero
    tiny = torch.finfo(BF).tiny
    close = (_ulps(got, want) <= 1) | ((got.float().abs() < tiny) & (want.float().abs() < tiny))
    assert bool(close.all())
    d = gu.double()
    assert _rel(got, F.silu(d[:, :i]) * d[:, i:]) <= 2 * U + U * U


def test_bf16_ops_against_transformers_llama() -> None:
    """transformers' LlamaRMSNorm, apply_rotary_pos_emb and LlamaMLP's act(gate) * up
    on bf16 tensors: RoPE bit-identical, the norm and SiLU·mul within one bf16 step."""
    from transformers.models.llama import modeling_llama as hf

    g = torch.Generator().manual_seed(11)
    rows, nq, nkv, d, n, i = 6, 4, 2, 64, 256, 512
    norm = hf.LlamaRMSNorm(n, eps=1e-6).to(BF)
    norm.weight.data = torch.randn(n, generator=g).to(BF)
    x = (torch.randn(rows, n, generator=g) * 2).to(BF)
    assert _max_ulps(_ops(BF).rms_norm(x, norm.weight, 1e-6)[1], norm(x)) <= 1
    qkv = torch.randn(rows, (nq + 2 * nkv) * d, generator=g).to(BF)
    cos, sin = RotaryEmbedding(d, 10000.0, 64)(torch.arange(rows) * 31, BF, signed=True)
    plain_sin = torch.cat([-sin[..., : d // 2], sin[..., d // 2 :]], dim=-1)  # exact
    q = qkv[:, : nq * d].view(rows, nq, d).transpose(0, 1)[None]  # [1, heads, rows, d]
    k = qkv[:, nq * d : (nq + nkv) * d].view(rows, nkv, d).transpose(0, 1)[None]
    wq, wk = hf.apply_rotary_pos_emb(q, k, cos[:, 0][None], plain_sin[:, 0][None])
    gq, gk = _ops(BF).rope_qk(qkv, nq, nkv, cos, sin)
    assert torch.equal(gq, wq[0].transpose(0, 1)) and torch.equal(gk, wk[0].transpose(0, 1))
    gu = (torch.randn(rows, 2 * i, generator=g) * 4).to(BF)
    want = F.silu(gu[:, :i]) * gu[:, i:]  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    assert _max_ulps(_ops(BF).silu_mul(gu), want) <= 1


def _argmax_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 1000, generator=g)
    x[1, [3, 700]] = 50.0  # a tie: the first
    x[2] = float("-inf")  # all -inf: 0
    x[3, [10, 900]] = float("nan")  # the first NaN, whatever the maximum
    x[3, 20] = 1e9
    x[4] = -x[4].abs() - 1.0
    x[4, 5], x[4, 6] = -0.0, 0.0  # -0 equals +0: the first zero
    x[5, 999] = 77.0  # in the tail after the 16-lane part
    x[6, 0] = 77.0
    x[7, 998], x[7, 999] = 9.0, 9.0  # a tie inside the tail
    x[8, 17], x[8, 33] = 9.0, 9.0  # a tie in one lane's later index vs another's
    return x


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("n", [5, 16, 1000])
def test_argmax_rows_is_torch_argmax(dtype: torch.dtype, n: int) -> None:
    x = _argmax_rows().to(dtype)[:, :n]  # strided rows when n < 1000
    got = _ops(dtype).argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == torch.argmax(x, dim=-1).tolist()
    assert got.tolist() == x.float().max(dim=-1).indices.tolist()
    assert _ops(dtype).argmax_rows(x[:0]).shape == (0,)


def test_both_bf16_rounding_paths_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The integer rounding (CPUs without AVX512-BF16) against the default build: equal
    except results below bf16's normal range (signed zeros with vcvtneps2bf16)."""
    # -O1: the same arithmetic (no reassociation at any level), a third of the build time
    base = tuple("-O1" if f == "-O3" else f for f in build.flags())
    monkeypatch.setenv("KVPAGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "flags", lambda: (*base, "-mno-avx512bf16"))
    lib, why = build.load()
    assert lib is not None, why
    plain, fast = NativeLayerOps(lib, BF), _ops(BF)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 768, generator=g) * 3).to(BF)
    x[0, :4] = torch.tensor([1e-39, -1e-39, 0.0, float("nan")]).to(BF)
    w = torch.randn(768, generator=g).to(BF)
    gu = (torch.randn(5, 600, generator=g) * 30).to(BF)
    rot = RotaryEmbedding(64, 10000.0, 64)
    cos, sin = rot(torch.arange(5) * 97, BF, signed=True)
    qkv = torch.randn(5, 6 * 64, generator=g).to(BF)
    tiny = torch.finfo(BF).tiny
    for a, b in [
        (plain.rms_norm(x, w, 1e-5, residual=x)[1], fast.rms_norm(x, w, 1e-5, residual=x)[1]),
        (plain.silu_mul(gu), fast.silu_mul(gu)),
        (plain.rope_qk(qkv, 4, 1, cos, sin)[0], fast.rope_qk(qkv, 4, 1, cos, sin)[0]),
    ]:
        af, bf = a.float(), b.float()
        same = (af == bf) | (af.isnan() & bf.isnan()) | ((af.abs() < tiny) & (bf.abs() < tiny))
        assert bool(same.all())


def test_refusals_by_name() -> None:
    ops = _ops()
    with pytest.raises(DTypeError, match="x: expected float32, got torch.bfloat16"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(DTypeError, match="weight: expected bfloat16, got torch.float32"):
        _ops(BF).rms_norm(torch.ones(2, 8, dtype=BF), torch.ones(8), 1e-5)
    with pytest.raises(DTypeError, match="gate_up: expected bfloat16"):
        _ops(BF).silu_mul(torch.ones(2, 8))
    with pytest.raises(DTypeError, match="dtype: expected float32 or bfloat16"):
        NativeLayerOps(build.load()[0], torch.float16)  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="logits: expected"):
        ops.argmax_rows(torch.ones(2, 0))
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_equal_with_and_without_layer_ops(
    monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """Greedy tokens of the engine: torch ops with float32 logits (the path before the
    C ops and uncast bf16 logits), torch ops with the runner's logits, the C ops (and
    the C argmax)."""
    from kvpage.engine import LLM, SamplingParams
    from kvpage.models.model import ModelRunnerModel

    prompts = ["Once upon a time", "The little dog", "Lily and Ben went to the park and"]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    forward = ModelRunnerModel.forward
    seen: list[torch.dtype] = []

    def float_forward(self: ModelRunnerModel, *a: object, **kw: object) -> torch.Tensor:
        kw["float_logits"] = True
        return forward(self, *a, **kw)  # type: ignore[arg-type]

    def watch_forward(self: ModelRunnerModel, *a: object, **kw: object) -> torch.Tensor:
        out = forward(self, *a, **kw)  # type: ignore[arg-type]
        seen.append(out.dtype)
        return out

    got = {}
    for name, on, fwd in [("old", False, float_forward), ("torch", False, watch_forward), ("C", True, watch_forward)]:  # fmt: skip
        monkeypatch.setattr(native_backend, "LAYER_OPS", on)
        monkeypatch.setattr(ModelRunnerModel, "forward", fwd)
        llm = LLM(backend="native-cpu", num_threads=1, dtype=dtype)
        assert (llm.llm_engine.sampler._greedy is not None) == on
        got[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got["old"] == got["torch"] == got["C"]
    assert set(seen) == {getattr(torch, dtype)}  # the runner's logits: not cast


def test_sampler_with_the_native_argmax_is_the_torch_one() -> None:
    from kvpage.engine.params import SamplingParams
    from kvpage.engine.sampler import Sampler, SamplingRows, greedy_ops

    p = SamplingParams(temperature=0.0)
    p.validate()
    for dtype in (torch.float32, BF):
        fast = greedy_ops(NativeCpuBackend(), dtype, "cpu")
        assert fast is not None and fast.dtype == dtype
        x = _argmax_rows().to(dtype)
        rows = SamplingRows([p] * 9, [None] * 9)
        want = Sampler().sample(x, rows).token_ids
        assert Sampler(fast).sample(x, rows).token_ids == want == torch.argmax(x, -1).tolist()
        # logits of another dtype than the kernel's: the torch path
        assert Sampler(fast).sample(x.double(), rows).token_ids == want
    assert greedy_ops(object(), BF, "cpu") is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deferred_residual_adds_give_the_same_logits(
    monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """``DecoderLayer.forward_deferred`` (each layer's last residual add done by the next
    norm's fused add) against ``forward``: every step's logits bit for bit."""
    from kvpage.engine import LLM, SamplingParams
    from kvpage.models.model import ModelRunnerModel

    llm = LLM(backend="native-cpu", num_threads=1, dtype=dtype, enable_prefix_caching=False)
    model = llm.llm_engine.model
    assert model._defer_residual  # stories260K: Llama blocks
    forward = ModelRunnerModel.forward
    got: dict[bool, list[torch.Tensor]] = {True: [], False: []}

    def watch(self: ModelRunnerModel, *a: object, **kw: object) -> torch.Tensor:
        out = forward(self, *a, **kw)  # type: ignore[arg-type]
        got[self._defer_residual].append(out)
        return out

    monkeypatch.setattr(ModelRunnerModel, "forward", watch)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for flag in (True, False):
        model._defer_residual = flag
        llm.generate(["Once upon a time", "The little dog ran"], sp, use_tqdm=False)
    assert len(got[True]) == len(got[False]) > 5
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))
