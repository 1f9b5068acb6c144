"""Focused tests of the Triton backend (``backends/kvpage_triton``) against the float64
reference: exact cache writes (model dtype, int8, fp8 e4m3/e5m2 incl. rounding ties and
saturation), decode with and without split-KV, chunked prefill, GQA/MQA, sliding
window, soft cap, odd head sizes, block copies and input validation.

Runs on CPU under ``TRITON_INTERPRET=1`` (set by ``scripts/test.sh``; shapes are small
because the interpreter is slow) or on a CUDA device when one is present.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from kvpage_triton import TritonBackend
from kvpage_triton.backend import interpreter_enabled

from kvpage.attention.metadata import (
    AttentionMetadata,
    KVCache,
    allocate_kv_cache,
    allocate_layer_cache,
    kv_cache_shape,
    slots_of,
)
from kvpage.attention.reference import reference_attention, reference_write_kv
from kvpage.errors import BackendUnavailableError, DTypeError, ShapeError
from kvpage.specs import AttentionSpec, make_cache_spec
from kvpage.testing import make_case, run_plugin_case
from kvpage.testing.cases import AttentionCase, clone_cache, materialize
from kvpage.testing.tolerances import assert_bits_equal, assert_close, tolerance_for

if interpreter_enabled():
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    DEVICE = None

pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="triton needs CUDA or TRITON_INTERPRET=1 (scripts/test.sh sets it)"
)


def run_case(case: AttentionCase, *, num_splits: int | None = None, use_decode: bool = False):
    """The shared plugin harness (``kvpage.testing.run_plugin_case``); return (out, ref)."""
    be = TritonBackend(num_splits=num_splits)
    assert case.is_decode or not use_decode, "a decode case must plan as a decode step"
    return run_plugin_case(be, case, DEVICE)


def check(case: AttentionCase, **kw) -> None:
    out, ref = run_case(case, **kw)
    assert_close(out, ref, tolerance_for(case.torch_dtype), what=case.describe())


# ---- attention -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_matches_reference(dtype: str, splits: int | None) -> None:
    case = make_case((5, 17, 33), dtype=dtype, seed=1)
    check(case, num_splits=splits, use_decode=True)


def test_auto_split_long_context_single_sequence() -> None:
    # one sequence x one KV head would leave the device idle: the launcher splits
    from kvpage_triton.launch import choose_config

    case = make_case((75,), hq=4, hk=1, bs=16, seed=2)
    m = materialize(case, DEVICE)
    cfg = choose_config(case.spec, m.meta, DEVICE, decode=True)
    assert cfg.num_splits > 1
    check(case, use_decode=True)


@pytest.mark.parametrize(
    ("hq", "hk"), [(8, 8), (32, 8), (28, 4), (12, 2), (8, 1)], ids=lambda v: str(v)
)
def test_gqa_head_mapping_c12(hq: int, hk: int) -> None:
    """C12: constant, distinct V per KV head; output of head h = V of kv head h // group."""
    bs, n = 16, 37
    spec = AttentionSpec(num_q_heads=hq, num_kv_heads=hk, head_dim=16)
    nb = 4
    cache = allocate_kv_cache(nb, bs, hk, 16, dtype=torch.float32, device=DEVICE)
    keys = torch.randn(n, hk, 16, generator=torch.Generator().manual_seed(3))
    vals = torch.arange(hk, dtype=torch.float32).view(1, hk, 1).expand(n, hk, 16) + 1.0
    tables = [[3, 1, 2]]
    meta = AttentionMetadata.build([1], [n], tables, bs, device=DEVICE)
    slots = torch.tensor([tables[0][p // bs] * bs + p % bs for p in range(n)], device=DEVICE)
    be = TritonBackend()
    be.write_kv(keys.to(DEVICE), vals.contiguous().to(DEVICE), cache, slots)
    q = torch.randn(1, hq, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = be.forward(q, cache, be.plan(meta), spec).cpu()
    group = hq // hk
    want = (torch.arange(hq) // group + 1.0).view(1, hq, 1).expand(1, hq, 16)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_prefill_with_context_window_softcap_mqa(dtype: str) -> None:
    case = make_case((5, 17, 33), (3, 8, 20), hq=8, hk=1, window=5, cap=10.0, dtype=dtype, seed=5)
    check(case)


def test_prefill_forced_splits_and_odd_block_size() -> None:
    case = make_case((9, 40), (9, 13), hq=6, hk=2, bs=3, seed=6)
    check(case, num_splits=4)


def test_prefill_mixed_with_zero_length_queries() -> None:
    case = make_case((6, 1, 12), (0, 1, 12), bs=5, seed=7)
    check(case)


@pytest.mark.parametrize("hd", [8, 80, 96, 112])
def test_odd_head_dims_c13(hd: int) -> None:
    """C13: non-power-of-two head sizes (padded with masks); nothing past head_dim of a
    wider output buffer is written."""
    case = make_case((37,), (3,), hq=8, hk=2, hd=hd, bs=16, seed=8)
    m = materialize(case, DEVICE)
    be = TritonBackend()
    big = torch.full((3, 8, hd + 16), float("nan"), device=DEVICE)
    out = big[:, :, :hd]
    be.forward(m.query, m.cache, be.plan(m.meta), case.spec, out=out)
    assert torch.isnan(big[:, :, hd:]).all()
    ref = reference_attention(m.query.cpu(), m.cache, m.meta, case.spec)
    assert_close(out, ref, tolerance_for(torch.float32), what=f"head_dim {hd}")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_kv(kv_dtype: str, dtype: str) -> None:
    case = make_case((9, 40), (4, 1), kv_dtype=kv_dtype, dtype=dtype, seed=9)
    check(case)


def test_int8_small_values_float16() -> None:
    """float16 queries over an int8 cache of tiny values (per-token scales ~1e-5): the
    error relative to max|output| stays within the float16 tolerance."""
    case = replace(
        make_case((40,), (1,), hq=8, hk=2, kv_dtype="int8", dtype="float16", seed=14),
        magnitude=0.001,
    )
    out, ref = run_case(case, use_decode=True)
    vmax = float(ref.abs().max())
    assert_close(out, ref, tolerance_for(torch.float16), what="int8/fp16 small", scale=vmax)


def test_fp8_per_head_scales_decode_split() -> None:
    case = make_case(
        (20, 33),
        kv_dtype="fp8_e4m3",
        granularity="per_head",
        k_scale=(0.25, 2.0),
        v_scale=(0.5, 0.05),
        seed=10,
    )
    check(case, num_splits=2, use_decode=True)


def test_sliding_window_paths_agree_c10() -> None:
    """C10: W=4, block_size 2, 10 tokens: full prefill, token-by-token decode and
    chunked prefill (chunk 3) give identical outputs, and equal the reference."""
    spec = AttentionSpec(num_q_heads=2, num_kv_heads=1, head_dim=16, sliding_window=4)
    g = torch.Generator().manual_seed(11)
    k = torch.randn(10, 1, 16, generator=g)
    v = torch.randn(10, 1, 16, generator=g)
    q = torch.randn(10, 2, 16, generator=g)
    table = [4, 2, 6, 1, 3]
    slots = slots_of(table, 0, 10, 2)
    be = TritonBackend()
    results = {}
    for name, chunks in (("full", [10]), ("decode", [1] * 10), ("chunk3", [3, 3, 3, 1])):
        cache = allocate_kv_cache(
            7, 2, 1, 16, dtype=torch.float32, device=DEVICE, fill=float("nan")
        )
        outs, start = [], 0
        for c in chunks:
            end = start + c
            meta = AttentionMetadata.build([c], [end], [table], 2, device=DEVICE)
            sm = torch.tensor(slots[start:end], device=DEVICE)
            be.write_kv(k[start:end].to(DEVICE), v[start:end].to(DEVICE), cache, sm)
            outs.append(be.forward(q[start:end].to(DEVICE), cache, be.plan(meta), spec).cpu())
            start = end
        results[name] = torch.cat(outs)
    torch.testing.assert_close(results["decode"], results["full"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results["chunk3"], results["full"], rtol=1e-6, atol=1e-6)
    # query 9 attends keys 6..9 only: changing key 5 must not change it
    from kvpage.attention.reference import reference_contiguous

    ref = reference_contiguous(q, k, v, spec)
    assert_close(results["full"], ref, tolerance_for(torch.float32), what="C10 vs reference")


# ---- write_kv ------------------------------------------------------------------------
def test_int8_write_c15() -> None:
    """C15: [0.02, -0.5, 0.25, 0.0] -> scale 0.5/127, codes [5, -127, 64, 0]; zero row -> 0."""
    cache = allocate_kv_cache(2, 2, 1, 4, dtype=torch.float32, kv_dtype="int8", device=DEVICE)
    key = torch.tensor([[[0.02, -0.5, 0.25, 0.0]], [[0.0, 0.0, 0.0, 0.0]]], device=DEVICE)
    TritonBackend().write_kv(key, key.clone(), cache, torch.tensor([1, 2], device=DEVICE))
    kv, ts = cache.kv.cpu(), cache.token_scales.cpu()  # type: ignore[union-attr]
    assert kv[0, 0, 1, 0].tolist() == [5, -127, 64, 0]
    assert ts[0, 0, 1, 0].item() == pytest.approx(0.5 / 127)
    assert kv[0, 1, 0, 0].tolist() == [0, 0, 0, 0] and ts[0, 1, 0, 0].item() == 0.0


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_write_rounding_saturation_c14(fmt: str) -> None:
    """C14 conversions with scale 1 (256->256, 300->288, 464->448, 1000->448, ...), plus
    every rounding tie of the format (torch rounds ties to even; so must we)."""
    dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
    codes = torch.arange(0, 128, dtype=torch.int32).to(torch.uint8).view(dt).float()
    codes = codes[torch.isfinite(codes)]  # ascending, 0 .. fp8 max
    mids = (codes[:-1] + codes[1:]) / 2  # exact ties between neighbours
    vals = torch.cat(
        [torch.tensor([256.0, 300.0, 448.0, 464.0, 1000.0, -1000.0, 1e-9, 0.0]), mids, -mids]
    )
    vals = vals[: (vals.numel() // 16) * 16].view(-1, 1, 16)
    n = vals.shape[0]
    cache = allocate_kv_cache(n, 1, 1, 16, dtype=torch.float32, kv_dtype=fmt, device=DEVICE)
    ref = clone_cache(cache)
    slots = torch.arange(n, device=DEVICE)
    TritonBackend().write_kv(vals.to(DEVICE), vals.to(DEVICE), cache, slots)
    ref_cpu = clone_cache(
        KVCache(kv=ref.kv.cpu(), k_scale=ref.k_scale.cpu(), v_scale=ref.v_scale.cpu())
    )  # type: ignore[union-attr]
    reference_write_kv(vals, vals, ref_cpu, slots.cpu())
    assert_bits_equal(cache.kv.cpu(), ref_cpu.kv, what=f"{fmt} bytes")
    got = cache.kv[0, 0, 0, 0].float().cpu()
    if fmt == "fp8_e4m3":
        assert got[:6].tolist() == [256.0, 288.0, 448.0, 448.0, 448.0, -448.0]


def test_write_kv_skips_padding_slots_and_touches_nothing_else() -> None:
    cache = allocate_kv_cache(4, 2, 2, 16, dtype=torch.bfloat16, device=DEVICE, fill=float("nan"))
    before = cache.kv.clone()
    key = torch.randn(3, 2, 16, dtype=torch.bfloat16).to(DEVICE)
    TritonBackend().write_kv(key, key, cache, torch.tensor([-1, 5, -1], device=DEVICE))
    changed = (cache.kv.view(torch.int16) != before.view(torch.int16)).nonzero()[:, 1:3]
    assert {tuple(r) for r in changed.tolist()} == {(2, 1)}
    assert torch.equal(cache.kv[0, 2, 1], key[1])


# ---- copy_blocks ---------------------------------------------------------------------
def test_copy_blocks_bit_exact_with_scales_and_chains() -> None:
    be = TritonBackend()
    caches = [
        allocate_kv_cache(6, 3, 2, 8, dtype=torch.float16, device=DEVICE),
        allocate_kv_cache(6, 3, 2, 8, dtype=torch.float32, kv_dtype="int8", device=DEVICE),
    ]
    g = torch.Generator().manual_seed(12)
    caches[0].kv.copy_(torch.randn(caches[0].kv.shape, generator=g).half())
    caches[0].kv[0, 1, 0, 0, 0] = float("nan")
    caches[1].kv.copy_(torch.randint(-127, 128, caches[1].kv.shape, generator=g).to(torch.int8))
    caches[1].token_scales.copy_(torch.rand(caches[1].token_scales.shape, generator=g))  # type: ignore[union-attr]
    pairs = torch.tensor([[1, 4], [2, 5], [4, 3]], device=DEVICE)  # 4 is a dst then a src
    want = [clone_cache(c) for c in caches]
    for src, dst in pairs.tolist():  # sequential semantics
        for c in want:
            c.kv[:, dst] = c.kv[:, src]
            if c.token_scales is not None:
                c.token_scales[:, dst] = c.token_scales[:, src]
    be.copy_blocks(caches, pairs)
    for c, w in zip(caches, want):
        assert_bits_equal(c.kv, w.kv, what="copy kv")
        if w.token_scales is not None:
            assert_bits_equal(c.token_scales, w.token_scales, what="copy scales")  # type: ignore[arg-type]


# ---- validation and selection --------------------------------------------------------
def test_bad_inputs_raise_named_errors_and_change_nothing() -> None:
    be = TritonBackend()
    case = make_case((5, 9), (1, 1), seed=13)
    m = materialize(case, DEVICE)
    snap = clone_cache(m.cache)
    with pytest.raises(ShapeError, match="query"):
        be.forward(m.query[:, :3], m.cache, be.plan(m.meta), case.spec)
    with pytest.raises(DTypeError, match="dtype"):
        be.forward(m.query.half(), m.cache, be.plan(m.meta), case.spec)
    if DEVICE.type == "cpu":  # slot ranges are checked on the host only (no device sync)
        with pytest.raises(ShapeError, match="slot_mapping"):
            slots = torch.tensor([0, 10**6], device=DEVICE)
            be.write_kv(m.new_keys, m.new_values, m.cache, slots)
    with pytest.raises(ShapeError, match="pairs"):
        be.copy_blocks([m.cache], torch.tensor([[0, case.num_blocks]], device=DEVICE))
    with pytest.raises(ShapeError, match="block_tables"):
        bad = AttentionMetadata.build([1, 1], [5, 9], [[1, 2], [3, 4, 5]], 4, device=DEVICE)
        bad.block_tables[1, 2] = case.num_blocks + 7
        if DEVICE.type != "cpu":
            pytest.skip("block ids are range-checked only for CPU tensors")
        be.forward(m.query, m.cache, be.plan(bad), case.spec)
    assert_bits_equal(m.cache.kv, snap.kv, what="cache after rejected calls")
    with pytest.raises(ShapeError):
        TritonBackend(num_splits=0)


def test_unsupported_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    be = TritonBackend()
    spec = make_cache_spec(
        num_layers=1,
        block_size=16,
        num_blocks=8,
        dtype="bfloat16",
        kv_dtype="fp8_e4m3",
        layers=({"num_q_heads": 4, "num_kv_heads": 1, "head_dim": 512},),
    )
    reasons = be.unsupported_reasons(spec, torch.device("cpu"))
    assert any("head_dim" in r and "512" in r for r in reasons)
    ok = replace_head_dim(spec, 128)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert be.unsupported_reasons(ok, torch.device("cpu")) == []
    monkeypatch.delenv("TRITON_INTERPRET")
    assert any("TRITON_INTERPRET" in r for r in be.unsupported_reasons(ok, torch.device("cpu")))
    assert any("device" in r for r in be.unsupported_reasons(ok, torch.device("meta")))


def replace_head_dim(spec, hd: int):  # type: ignore[no-untyped-def]
    layers = tuple(replace_layer(a, hd) for a in spec.layers)
    return spec.model_copy(update={"layers": layers})


def replace_layer(a: AttentionSpec, hd: int) -> AttentionSpec:
    return AttentionSpec(num_q_heads=a.num_q_heads, num_kv_heads=a.num_kv_heads, head_dim=hd)


def test_registered_and_runs_without_triton_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin imports without triton (lazy import) and reports it as a reason; a
    kernel call then raises BackendUnavailableError instead of ImportError."""
    from kvpage.backends import available_backends

    assert "triton" in available_backends()
    for name in [
        m for m in sys.modules if m == "triton" or m.startswith(("triton.", "kvpage_triton"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    fresh = importlib.import_module("kvpage_triton")
    be = fresh.TritonBackend()
    spec = make_cache_spec(
        num_layers=1, layers=({"num_q_heads": 2, "num_kv_heads": 1, "head_dim": 8},)
    )
    assert any("triton is not installed" in r for r in be.unsupported_reasons(spec, DEVICE))
    cache = allocate_kv_cache(2, 2, 1, 8, dtype=torch.float32, device=DEVICE)
    x = torch.zeros(1, 1, 8, device=DEVICE)
    with pytest.raises(BackendUnavailableError, match="import"):
        be.write_kv(x, x, cache, torch.tensor([0], device=DEVICE))


def test_cache_helpers() -> None:
    spec = make_cache_spec(
        num_layers=1,
        block_size=4,
        num_blocks=3,
        dtype="float16",
        kv_dtype="int8",
        layers=({"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8},),
    )
    assert kv_cache_shape(spec, 0) == (2, 3, 4, 2, 8)
    c = allocate_layer_cache(spec, 0, DEVICE)
    assert isinstance(c, KVCache) and c.kv.dtype == torch.int8 and c.token_scales is not None


def test_kernels_compile_for_sm80_and_sm90_without_a_gpu() -> None:
    """Representative kernel variants lower to cubin for sm_80/sm_90 with triton's
    bundled ptxas (no driver needed): catches errors the interpreter cannot see. The
    full matrix: ``python -m kvpage_triton.aot`` (run in a process without
    TRITON_INTERPRET, since interpreted kernels cannot be compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        [sys.executable, "-m", "kvpage_triton.aot", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert res.stdout.count(": ok") == 6, res.stdout


@pytest.mark.slow
def test_engine_greedy_tokens_equal_torch_backend() -> None:
    """End to end (stories260K, block_size 4, chunked prefill with an 8-token budget,
    prefix caching on): greedy tokens with the Triton backend equal the torch
    backend's. ~50 s under the interpreter, hence slow."""
    from kvpage.engine import LLM, SamplingParams

    prompts = ["Once upon a time", "Lily and Tom went to the park and"]
    got = {}
    for name in ("torch", "triton"):
        llm = LLM(
            model="stories260K",
            backend=name,
            block_size=4,
            num_blocks=64,
            max_num_batched_tokens=8,
            device=str(DEVICE),
        )
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
        got[name] = [list(o.outputs[0].token_ids) for o in outs]
    assert got["triton"] == got["torch"]
