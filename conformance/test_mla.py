"""Conformance for MLA layers (multi-head latent attention, ``AttentionSpec.kv_lora_rank``).

Every backend that declares ``capabilities.mla`` is held to the float64 reference
(``kvpage.attention.reference``): ``write_kv(latent, None, ...)`` bit for bit (auto,
int8 token scales, fp8 with ``k_scale``), ``forward(q_absorbed)`` ->
``[num_tokens, num_q_heads, kv_lora_rank]`` within docs/tolerances.md (E = max|values|
* max(1, kappa / 8), the values being the latent's first ``kv_lora_rank`` elements),
for decode, prefill, chunked prefill over cached context and shuffled block tables;
the quantized caches' own error within ``QUANT_ERROR_BOUNDS``. Backends without MLA
must refuse it by name (``backend_reasons``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpage.attention.metadata import AttentionMetadata, KVCache, allocate_layer_cache
from kvpage.attention.reference import reference_attention, reference_write_kv
from kvpage.backends import available_backends, backend_reasons
from kvpage.errors import ShapeError
from kvpage.specs import CacheSpec, make_cache_spec
from kvpage.testing.cases import clone_cache
from kvpage.testing.runner import assert_cache_bits_equal
from kvpage.testing.tolerances import QUANT_ERROR_BOUNDS, assert_close, tolerance_for

RANK, ROPE, HEADS = 24, 8, 4
#: (query_lens, seq_lens): decode, prefill, chunked prefill over context, mixed
LAYOUTS = [
    ((1, 1, 1), (5, 17, 33)),
    ((7, 13), (7, 13)),
    ((5, 3), (12, 20)),
    ((1, 6, 2), (9, 6, 31)),
]
KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mla_spec(kv_dtype: str = "auto", dtype: str = "float32", block_size: int = 4) -> CacheSpec:
    """One MLA layer: kv_lora_rank 24 + rope 8 = head_dim 32, four query heads."""
    return make_cache_spec(
        num_layers=1,
        block_size=block_size,
        num_blocks=40,
        dtype=dtype,
        kv_dtype=kv_dtype,
        layers=[
            dict(
                num_q_heads=HEADS,
                num_kv_heads=1,
                head_dim=RANK + ROPE,
                scale=0.2,
                kv_lora_rank=RANK,
                qk_rope_head_dim=ROPE,
            )  # fmt: skip
        ],
    )


def _poisoned(spec: CacheSpec, device: torch.device) -> KVCache:
    c = allocate_layer_cache(spec, 0, device)
    if c.kv.dtype.is_floating_point:
        c.kv.fill_(float("nan"))
    if c.token_scales is not None:
        c.token_scales.fill_(float("nan"))
    if c.k_scale is not None:
        c.k_scale.fill_(0.05)
    return c


def _check_case(ctx, spec: CacheSpec, layout, seed: int) -> None:  # type: ignore[no-untyped-def]
    """write_kv bits and forward (and out=) against the reference for one step."""
    a = spec.layers[0]
    latent, slots, q, meta, lat = _step(spec, layout, seed, ctx.device)
    cache, want = _poisoned(spec, ctx.device), _poisoned(spec, torch.device("cpu"))
    ctx.backend.write_kv(latent, None, cache, slots)
    reference_write_kv(latent.cpu(), None, want, slots.cpu())
    assert_cache_bits_equal(cache, want, what="MLA write_kv")
    plan = ctx.backend.plan(meta)
    before = clone_cache(cache)
    out = ctx.backend.forward(q, cache, plan, a)
    assert tuple(out.shape) == (meta.num_tokens, HEADS, RANK) and out.dtype == q.dtype
    assert_cache_bits_equal(cache, before, what="MLA forward reads only")
    cpu_meta = AttentionMetadata.build(
        meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables.tolist(), spec.block_size
    )
    ref = reference_attention(q.cpu(), want, cpu_meta, a)
    # E = max|values| * max(1, kappa / 8), kappa = scale * max sum_d |q_d k_d|
    deq = torch.cat(lat).double()
    vmax = float(deq[..., :RANK].abs().max())
    kappa = a.scale * float((q.cpu().double().abs() @ deq.abs().view(-1, RANK + ROPE).T).max())
    e = vmax * max(1.0, kappa / 8)
    assert_close(out, ref, tolerance_for(q.dtype), what="MLA forward", scale=e)
    buf = torch.full_like(out, float("nan"))
    assert ctx.backend.forward(q, cache, plan, a, buf) is buf
    assert_close(buf, ref, tolerance_for(q.dtype), what="MLA forward out=", scale=e)
    if spec.kv_dtype != "auto":
        _check_quant_error(spec, lat, q, meta, ref)


def _step(spec: CacheSpec, layout, seed: int, device: torch.device):  # type: ignore[no-untyped-def]
    """Latents of every position, absorbed queries of the new tokens, shuffled tables."""
    qlens, slens = layout
    g = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    perm = (torch.randperm(spec.num_blocks - 1, generator=g) + 1).tolist()
    tables, slots, lat = [], [], []
    for s in slens:
        n = -(-s // bs)
        bt, perm = perm[:n], perm[n:]
        tables.append(bt)
        slots += [bt[p // bs] * bs + p % bs for p in range(s)]
        lat.append(torch.randn(s, 1, RANK + ROPE, generator=g))
    dt = DTYPES[spec.dtype]
    latent = torch.cat(lat).to(dt).to(device)
    q = torch.randn(sum(qlens), HEADS, RANK + ROPE, generator=g).to(dt).to(device)
    meta = AttentionMetadata.build(list(qlens), list(slens), tables, bs, device=device)
    return latent, torch.tensor(slots, dtype=torch.int64, device=device), q, meta, lat


def _mla_backend(ctx) -> None:  # type: ignore[no-untyped-def]
    if not getattr(ctx.backend.capabilities, "mla", False):
        pytest.skip(f"{ctx.name} does not declare capabilities.mla (refusal: test below)")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_mla_write_and_forward_match_reference(ctx, kv_dtype, dtype, layout) -> None:  # type: ignore[no-untyped-def]
    _mla_backend(ctx)
    spec = mla_spec(kv_dtype, dtype, block_size=4 if layout % 2 else 16)
    ctx.supports(ctx.backend.unsupported_reasons(spec, ctx.device))
    _check_case(ctx, spec, LAYOUTS[layout], 7 + layout)


@st.composite
def _mla_steps(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    """A random step: 1-3 sequences, each a decode, a prefill or a chunk over cached
    context (lengths up to 40), block size 1-16, any kv dtype and query dtype."""
    n = draw(st.integers(1, 3))
    slens = [draw(st.integers(1, 40)) for _ in range(n)]
    qlens = [draw(st.integers(1, s)) for s in slens]
    kv_dtype = draw(st.sampled_from(KV_DTYPES))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    bs = draw(st.sampled_from([1, 3, 4, 16]))
    return (tuple(qlens), tuple(slens)), kv_dtype, dtype, bs, draw(st.integers(0, 2**16))


def test_mla_random_steps_match_reference(ctx) -> None:  # type: ignore[no-untyped-def]
    _mla_backend(ctx)

    @ctx.settings()
    @given(_mla_steps())
    def run(step) -> None:  # type: ignore[no-untyped-def]
        layout, kv_dtype, dtype, bs, seed = step
        spec = mla_spec(kv_dtype, dtype, block_size=bs)
        if -(-40 // bs) * 3 >= spec.num_blocks:  # the pool must hold three 40-token tables
            spec = spec.with_blocks(3 * 40 + 2)
        if ctx.backend.unsupported_reasons(spec, ctx.device):
            return
        _check_case(ctx, spec, layout, seed)

    run()


def _check_quant_error(spec, lat, q, meta, ref_deq) -> None:  # type: ignore[no-untyped-def]
    """The reference on the dequantized latents vs exact float64 attention on the
    latents given to write_kv: ``min(exp(2d) - 1, 2) * max|V| + max dV`` with ``d =
    scale * max sum_d |q_d| dk_d`` (docs/tolerances.md, "Quantized KV")."""
    a, b = spec.layers[0], QUANT_ERROR_BOUNDS[spec.kv_dtype]
    start = 0
    for x, n, ql in zip(lat, meta.seq_lens_cpu, meta.query_lens_cpu):
        k = x.double()[:, 0]  # [n, head_dim]
        qs = q[start : start + ql].cpu().double()
        logits = torch.einsum("thd,nd->thn", qs, k) * a.scale
        ctx_len = n - ql
        mask = torch.arange(n).view(1, 1, -1) > (ctx_len + torch.arange(ql)).view(-1, 1, 1)
        p = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
        exact = p @ k[:, :RANK]
        xa = k.abs()
        s = 0.05 if spec.kv_dtype.startswith("fp8") else 0.0
        dk = b.rel * xa + b.row_rel * xa.amax(dim=-1, keepdim=True) + b.abs_min * s
        d = a.scale * float(torch.einsum("thd,nd->thn", qs.abs(), dk).max())
        vmax = float(k[:, :RANK].abs().max())
        factor = 2.0 if 2 * d >= math.log(3.0) else math.expm1(2 * d)
        bound = factor * vmax + float(dk[:, :RANK].max()) + 1e-6 * vmax
        if spec.kv_dtype.startswith("fp8") and float(xa.max()) / s > 448.0:
            continue  # saturated by design (the bound does not hold)
        err = float((ref_deq[start : start + ql] - exact).abs().max())
        assert err <= bound, f"MLA quantization error {spec.kv_dtype}: {err} > {bound}"
        start += ql


def test_mla_argument_checks_change_nothing(ctx) -> None:  # type: ignore[no-untyped-def]
    _mla_backend(ctx)
    spec = mla_spec()
    a = spec.layers[0]
    latent, slots, q, meta, _ = _step(spec, LAYOUTS[2], 3, ctx.device)
    cache = _poisoned(spec, ctx.device)
    ctx.backend.write_kv(latent, None, cache, slots)
    before = clone_cache(cache)
    with pytest.raises(ShapeError, match="value: expected None"):
        ctx.backend.write_kv(latent, latent, cache, slots)
    plan = ctx.backend.plan(meta)
    wrong = torch.empty(meta.num_tokens, HEADS, RANK + ROPE, dtype=q.dtype, device=ctx.device)
    with pytest.raises(ShapeError, match="out: expected"):
        ctx.backend.forward(q, cache, plan, a, wrong)
    with pytest.raises(ShapeError, match="query: expected"):
        ctx.backend.forward(q[..., :RANK], cache, plan, a)
    assert_cache_bits_equal(cache, before, what="rejected MLA calls")
    pairs = torch.tensor([[meta.block_tables[0, 0].item(), 39]], dtype=torch.int64)
    ctx.backend.copy_blocks([cache], pairs.to(ctx.device))
    src = int(pairs[0, 0])
    assert torch.equal(cache.kv[:, 39].cpu(), cache.kv[:, src].cpu())


@pytest.mark.parametrize("name", available_backends())
def test_backends_without_mla_refuse_it_by_name(name: str) -> None:
    from kvpage.backends import get_backend

    try:
        caps = get_backend(name).capabilities
    except Exception:  # a plugin that cannot load here is refused anyway
        caps = None
    why = backend_reasons(name, mla_spec(), "cpu")
    if caps is not None and getattr(caps, "mla", False):
        assert not any("kv_lora_rank" in w for w in why), why
    else:
        assert why, name
        if caps is not None:
            assert any("kv_lora_rank" in w and "multi-head latent attention" in w for w in why)


def test_mla_forward_is_thread_count_invariant(ctx) -> None:  # type: ignore[no-untyped-def]
    """The same outputs, bit for bit, planned for 1 and for 3 threads (the CPU
    kernels split a step into parts per thread)."""
    _mla_backend(ctx)
    spec = mla_spec(block_size=4)
    a = spec.layers[0]
    latent, slots, q, meta, _ = _step(spec, LAYOUTS[3], 11, ctx.device)
    cache = _poisoned(spec, ctx.device)
    ctx.backend.write_kv(latent, None, cache, slots)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            outs.append(ctx.backend.forward(q, cache, ctx.backend.plan(meta), a))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
