"""The numba backend against the float64 reference, on CPU under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, set by scripts/test.sh) or on a GPU when one is visible.

Shapes are tiny on purpose: every simulated thread is a Python thread
(ARCHITECTURE.md section 8).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.attention.reference import reference_attention, reference_write_kv
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import make_attention_spec, make_cache_spec
from kvpage.testing import make_case, run_plugin_case

numba = pytest.importorskip("numba")
from kvpage_numba import NumbaBackend  # noqa: E402
from kvpage_numba.fp8 import E4M3, E5M2, bf16_bits_to_float, fp8_decode, fp8_encode  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIM = bool(numba.config.ENABLE_CUDASIM)
if SIM:
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    DEVICE = None
needs_device = pytest.mark.skipif(
    DEVICE is None, reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU"
)
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, so comparisons are bit-exact (NaN payloads included)."""
    return t.contiguous().view(torch.uint8)


def _scenario(
    *,
    dtype=torch.float32,
    kv_dtype="auto",
    hq=4,
    hkv=2,
    hd=8,
    bs=4,
    query_lens=(3, 1),
    seq_lens=(7, 9),
    window=None,
    cap=None,
    seed=0,
):
    """Caches (backend + reference) holding every token of every sequence, NaN-poisoned
    elsewhere, with shuffled block ids; returns the pieces of one step."""
    g = torch.Generator().manual_seed(seed)
    spec = make_attention_spec(
        num_q_heads=hq, num_kv_heads=hkv, head_dim=hd, sliding_window=window, logits_soft_cap=cap
    )
    nb = sum(-(-s // bs) for s in seq_lens) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    tables, k = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(perm[k : k + n])
        k += n
    caches = [  # the backend's cache on its device, the reference's on the host
        allocate_kv_cache(
            nb, bs, hkv, hd, dtype=dtype, kv_dtype=kv_dtype, k_scale=0.25, v_scale=0.5,
            fill=float("nan"), device=dev,
        )
        for dev in (DEVICE or "cpu", "cpu")
    ]  # fmt: skip
    full = AttentionMetadata.build(list(seq_lens), list(seq_lens), tables, bs)
    key = (torch.randn(full.num_tokens, hkv, hd, generator=g) * 2).to(dtype)
    value = torch.randn(full.num_tokens, hkv, hd, generator=g).to(dtype)
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, bs)
    query = torch.randn(meta.num_tokens, hq, hd, generator=g).to(dtype)
    return spec, caches, full, key, value, meta, query


# ---- pure-Python conversions (no simulator needed) -------------------------------------
@pytest.mark.parametrize(
    ("fmt", "dt", "fmax"),
    [(E4M3, torch.float8_e4m3fn, 448.0), (E5M2, torch.float8_e5m2, 57344.0)],
)
def test_fp8_encode_decode_match_torch_bit_for_bit(fmt, dt, fmax):
    g = torch.Generator().manual_seed(1)
    vals = torch.arange(256, dtype=torch.uint8).view(dt).float()
    fin = torch.sort(vals[torch.isfinite(vals)].unique()).values
    mids = (fin[1:] + fin[:-1]) / 2  # every tie: round-half-even decides
    x = torch.cat(
        [
            fin,
            mids,
            torch.randn(3000, generator=g) * fmax / 8,
            torch.randn(3000, generator=g) * 1e-3,
            torch.tensor([0.0, -0.0, float("nan"), -float("nan"), fmax, -fmax]),
        ]
    ).clamp(-fmax, fmax)
    want = x.to(dt).view(torch.uint8).tolist()
    got = [fp8_encode(v, *fmt) for v in x.tolist()]
    assert got == want
    decoded = [fp8_decode(c, *fmt) for c in range(256)]
    ref = vals.tolist()
    assert all(a == b or (a != a and b != b) for a, b in zip(decoded, ref))


def test_bf16_bits_widen_exactly():
    x = torch.cat([torch.randn(500), torch.tensor([1e-40, -3e-39, float("inf"), -0.0])])
    b = x.to(torch.bfloat16)
    got = [bf16_bits_to_float(v) for v in b.view(torch.int16).tolist()]
    assert got == b.float().tolist()


def test_import_does_not_import_numba():
    code = "import sys, kvpage_numba; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- capability ----------------------------------------------------------------------------
def test_unsupported_reasons():
    be = NumbaBackend()
    spec = make_cache_spec(
        num_layers=1, num_blocks=4, layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=512)]
    )
    reasons = be.unsupported_reasons(spec, torch.device("cpu"))
    assert any("head_dim" in r and "512" in r for r in reasons)
    ok = spec.with_blocks(4).model_copy(
        update={"layers": (make_attention_spec(num_q_heads=4, num_kv_heads=2, head_dim=64),)}
    )
    if SIM:
        assert be.unsupported_reasons(ok, torch.device("cpu")) == []
        assert any("NUMBA_ENABLE_CUDASIM" in r for r in be.unsupported_reasons(ok, "cuda"))
    else:
        assert any("NUMBA_ENABLE_CUDASIM" in r for r in be.unsupported_reasons(ok, "cpu"))
    with pytest.raises(ValueError, match="threads"):
        NumbaBackend(threads=1000)


# ---- write_kv ------------------------------------------------------------------------------
@needs_device
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.float32, "auto"),
        (torch.float16, "auto"),
        (torch.bfloat16, "auto"),
        (torch.float32, "int8"),
        (torch.bfloat16, "int8"),
        (torch.float16, "fp8_e4m3"),
        (torch.bfloat16, "fp8_e5m2"),
    ],
)
def test_write_kv_bit_exact_and_touches_only_mapped_slots(dtype, kv_dtype):
    spec, (mine, ref), full, key, value, _, _ = _scenario(dtype=dtype, kv_dtype=kv_dtype)
    slots = full.slot_mapping.clone()
    slots[2] = -1  # padding: never written
    dev = mine.kv.device
    NumbaBackend().write_kv(key.to(dev), value.to(dev), mine, slots.to(dev))
    reference_write_kv(key, value, ref, slots)
    assert torch.equal(_raw(mine.kv.cpu()), _raw(ref.kv))
    if kv_dtype == "int8":
        assert torch.equal(_raw(mine.token_scales.cpu()), _raw(ref.token_scales))


@needs_device
def test_write_kv_int8_case_c15_and_zero_token():
    c = allocate_kv_cache(2, 2, 1, 4, dtype=torch.float32, kv_dtype="int8", device=DEVICE)
    key = torch.tensor([[[0.02, -0.5, 0.25, 0.0]], [[0.0, 0.0, 0.0, 0.0]]])
    NumbaBackend().write_kv(key.to(DEVICE), key.to(DEVICE), c, torch.tensor([0, 1]).to(DEVICE))
    assert c.kv[0, 0, 0, 0].tolist() == [5, -127, 64, 0]
    assert c.token_scales[0, 0, 0, 0].item() == pytest.approx(0.5 / 127, rel=1e-7)
    assert c.kv[0, 0, 1, 0].tolist() == [0, 0, 0, 0] and c.token_scales[0, 0, 1, 0].item() == 0.0


@needs_device
def test_write_kv_fp8_saturates_case_c14():
    c = allocate_kv_cache(1, 1, 1, 6, dtype=torch.float32, kv_dtype="fp8_e4m3", device=DEVICE)
    x = torch.tensor([[[256.0, 300.0, 448.0, 464.0, 1000.0, -1000.0]]], device=DEVICE)
    NumbaBackend().write_kv(x, x, c, torch.tensor([0], device=DEVICE))
    assert c.kv[0, 0, 0, 0].float().tolist() == [256.0, 288.0, 448.0, 448.0, 448.0, -448.0]


@needs_device
def test_write_kv_rejects_bad_input_without_writing():
    spec, (mine, _), full, key, value, _, _ = _scenario()
    before = _raw(mine.kv).clone()
    be = NumbaBackend()
    dev = mine.kv.device
    bad_slots = full.slot_mapping.clone()
    bad_slots[0] = mine.num_blocks * mine.block_size
    if dev.type == "cpu":  # slot ranges are checked on the host only (no device sync)
        with pytest.raises(ShapeError, match="slot_mapping: expected values in"):
            be.write_kv(key.to(dev), value.to(dev), mine, bad_slots.to(dev))
    with pytest.raises(ShapeError, match="key: expected"):
        be.write_kv(key[:, :1].to(dev), value.to(dev), mine, full.slot_mapping.to(dev))
    with pytest.raises(DTypeError, match="key: expected the cache dtype"):
        be.write_kv(key.half().to(dev), value.half().to(dev), mine, full.slot_mapping.to(dev))
    assert torch.equal(_raw(mine.kv), before)


# ---- attention -----------------------------------------------------------------------------
def _attend(be, query, mine, meta, spec, decode=False):
    dev = mine.kv.device
    m = AttentionMetadata.build(
        meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables.tolist(), mine.block_size,
        device=dev,
    )  # fmt: skip
    plan = be.plan(m)
    assert plan.is_decode or not decode, "a decode call must plan as a decode step"
    return be.forward(query.to(dev), mine, plan, spec).cpu()


@needs_device
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "hq", "hkv", "window", "cap", "threads", "splits"),
    [
        (torch.float32, "auto", 4, 2, None, None, 4, None),
        (torch.float32, "auto", 2, 1, 3, None, 2, 3),  # MQA + window + forced splits
        (torch.float16, "auto", 4, 4, None, 5.0, 1, 2),  # soft cap
        (torch.bfloat16, "auto", 4, 2, 5, None, 4, None),
        (torch.float32, "int8", 4, 2, None, None, 3, 2),
        (torch.bfloat16, "fp8_e4m3", 4, 2, None, 2.0, 4, None),
        (torch.float16, "fp8_e5m2", 2, 1, 4, None, 4, 2),
    ],
)
def test_prefill_matches_reference(dtype, kv_dtype, hq, hkv, window, cap, threads, splits):
    """Through the shared plugin harness (``kvpage.testing.run_plugin_case``): write_kv
    bit-exact over poisoned slots, then plan + forward into a poisoned strided out."""
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    case = make_case(
        (7, 9), (3, 1), hq=hq, hk=hkv, hd=8, bs=4, dtype=name[dtype], kv_dtype=kv_dtype,
        window=window, cap=cap, k_scale=(0.5,), v_scale=(0.25,),
    )  # fmt: skip
    be = NumbaBackend(threads=threads, num_splits=splits)
    got, want = run_plugin_case(be, case, DEVICE)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@needs_device
def test_decode_split_kv_equals_unsplit_and_reference():
    spec, (mine, ref), full, key, value, _, _ = _scenario(
        hq=2, hkv=1, hd=4, bs=2, query_lens=(1, 1), seq_lens=(11, 6)
    )
    reference_write_kv(key, value, ref, full.slot_mapping)
    dev = mine.kv.device
    NumbaBackend().write_kv(key.to(dev), value.to(dev), mine, full.slot_mapping.to(dev))
    meta = AttentionMetadata.build([1, 1], [11, 6], full.block_tables.tolist(), 2)
    q = torch.randn(2, 2, 4)
    outs = [
        _attend(NumbaBackend(threads=2, num_splits=s), q, mine, meta, spec, decode=True)
        for s in (1, 4)
    ]
    want = reference_attention(q, ref, meta, spec)
    for o in outs:
        torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)


@needs_device
def test_sliding_window_full_decode_and_chunked_agree_case_c10():
    """W 4, block_size 2, 10 tokens: one-shot prefill, chunks of 3 and token-by-token
    decode give the same outputs (query 9 sees keys 6..9)."""
    spec = make_attention_spec(num_q_heads=1, num_kv_heads=1, head_dim=4, sliding_window=4)
    g = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(10, 1, 4, generator=g) for _ in range(3))
    table = [[4, 0, 3, 1, 2]]
    be = NumbaBackend(threads=2)
    cache = allocate_kv_cache(5, 2, 1, 4, dtype=torch.float32, device=DEVICE)
    dev = cache.kv.device
    full = AttentionMetadata.build([10], [10], table, 2, device=dev)
    be.write_kv(k.to(dev), v.to(dev), cache, full.slot_mapping)
    one_shot = be.forward(q.to(dev), cache, be.plan(full), spec).cpu()
    chunks = []
    for start in range(0, 10, 3):
        n = min(3, 10 - start)
        m = AttentionMetadata.build([n], [start + n], table, 2, device=dev)
        chunks.append(be.forward(q[start : start + n].to(dev), cache, be.plan(m), spec).cpu())
    decoded = []
    for p in range(10):
        m = AttentionMetadata.build([1], [p + 1], table, 2, device=dev)
        decoded.append(be.forward(q[p : p + 1].to(dev), cache, be.plan(m), spec).cpu())
    torch.testing.assert_close(torch.cat(chunks), one_shot, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat(decoded), one_shot, atol=1e-6, rtol=1e-6)
    w = torch.softmax(k[6:10, 0] @ q[9, 0] * spec.scale, 0)
    torch.testing.assert_close(one_shot[9, 0], w @ v[6:10, 0], atol=1e-6, rtol=1e-6)


@needs_device
@pytest.mark.parametrize(("hq", "hkv"), [(8, 8), (8, 2), (12, 2), (8, 1)])
def test_gqa_head_mapping_case_c12(hq, hkv):
    """Constant, distinct V per KV head: query head h outputs V of KV head h // group."""
    spec = make_attention_spec(num_q_heads=hq, num_kv_heads=hkv, head_dim=4)
    cache = allocate_kv_cache(3, 4, hkv, 4, dtype=torch.float32, device=DEVICE)
    dev = cache.kv.device
    meta = AttentionMetadata.build([1], [9], [[2, 0, 1]], 4, device=dev)
    k = torch.randn(9, hkv, 4)
    v = torch.arange(hkv, dtype=torch.float32).view(1, hkv, 1).expand(9, hkv, 4).contiguous()
    be = NumbaBackend(threads=1)
    full = AttentionMetadata.build([9], [9], [[2, 0, 1]], 4, device=dev)
    be.write_kv(k.to(dev), v.to(dev), cache, full.slot_mapping)
    out = be.forward(torch.randn(1, hq, 4).to(dev), cache, be.plan(meta), spec).cpu()
    group = hq // hkv
    want = torch.tensor([h // group for h in range(hq)], dtype=torch.float32)
    torch.testing.assert_close(out[0, :, 0], want, atol=1e-6, rtol=0)


@needs_device
def test_out_buffer_and_validation():
    spec, (mine, _), full, key, value, meta, query = _scenario(dtype=torch.float16)
    be = NumbaBackend()
    dev = mine.kv.device
    be.write_kv(key.to(dev), value.to(dev), mine, full.slot_mapping.to(dev))
    out = torch.full(query.shape, float("nan"), dtype=torch.float16, device=dev)
    m = be.plan(AttentionMetadata.build([3, 1], [7, 9], meta.block_tables.tolist(), 4, device=dev))
    res = be.forward(query.to(dev), mine, m, spec, out=out)
    assert res is out and torch.isfinite(out).all()
    with pytest.raises(DTypeError, match="out: expected torch.float16"):
        be.forward(query.to(dev), mine, m, spec, out=out.float())
    with pytest.raises(ShapeError, match="query: expected"):
        be.forward(query[:2].to(dev), mine, m, spec)
    with pytest.raises(ShapeError, match="query: expected"):
        be.forward(query[:, :2].to(dev), mine, m, spec)


@needs_device
@pytest.mark.parametrize("hd", [80, 112])
def test_odd_head_sizes_and_default_scale_case_c13(hd):
    """GQA 4:1, block_size 16, context 37 (partial last block); no explicit scale means
    1/sqrt(head_dim)."""
    spec = make_attention_spec(num_q_heads=4, num_kv_heads=1, head_dim=hd)
    assert spec.scale == pytest.approx(hd**-0.5)
    spec_, (mine, ref), full, key, value, meta, query = _scenario(
        hq=4, hkv=1, hd=hd, bs=16, query_lens=(1,), seq_lens=(37,)
    )
    reference_write_kv(key, value, ref, full.slot_mapping)
    dev = mine.kv.device
    be = NumbaBackend(threads=2)
    be.write_kv(key.to(dev), value.to(dev), mine, full.slot_mapping.to(dev))
    got = _attend(be, query, mine, meta, spec, decode=True)
    torch.testing.assert_close(got.double(), reference_attention(query, ref, meta, spec), atol=2e-5, rtol=2e-5)  # fmt: skip


@needs_device
def test_selection_follows_the_model():
    """An explicit numba request for a head size it lacks fails with numba's reason."""
    from kvpage.backends import select_backend
    from kvpage.errors import BackendUnavailableError

    spec = make_cache_spec(
        num_layers=2, num_blocks=4,
        layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=64), dict(num_q_heads=4, num_kv_heads=2, head_dim=320)],
    )  # fmt: skip
    with pytest.raises(BackendUnavailableError, match="head_dim: expected <= 256, got 320"):
        select_backend(spec, DEVICE, prefer="numba")
    small = spec.model_copy(update={"layers": spec.layers[:1], "num_layers": 1})
    if SIM:
        assert select_backend(small, DEVICE, prefer="numba").name == "numba"


# ---- copy_blocks ---------------------------------------------------------------------------
@needs_device
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_copy_blocks_bit_exact(kv_dtype):
    dtype = torch.bfloat16
    caches = [
        allocate_kv_cache(6, 2, 2, 4, dtype=dtype, kv_dtype=kv_dtype, device=DEVICE)
        for _ in range(2)
    ]
    g = torch.Generator().manual_seed(5)
    for c in caches:
        slots = torch.arange(12, device=c.kv.device)
        x = torch.randn(12, 2, 4, generator=g).to(dtype).to(c.kv.device)
        NumbaBackend().write_kv(x, -x, c, slots)
    before = [(_raw(c.kv).clone(), None if c.token_scales is None else c.token_scales.clone()) for c in caches]  # fmt: skip
    pairs = torch.tensor([[1, 4], [2, 0]])
    NumbaBackend().copy_blocks(caches, pairs)
    for c, (kv0, ts0) in zip(caches, before):
        want = kv0.clone()
        for s, d in pairs.tolist():
            want[:, d] = kv0[:, s]
        assert torch.equal(_raw(c.kv), want)
        if ts0 is not None:
            assert torch.equal(c.token_scales[:, 4], ts0[:, 1])
    snapshot = _raw(caches[0].kv).clone()
    for bad, msg in (
        (torch.tensor([[1, 6]]), r"block ids in \[0, 5\]"),
        (torch.tensor([[1, 3], [2, 3]]), "distinct destination"),
        (torch.tensor([[1, 3], [3, 4]]), "both source and destination"),
        (torch.tensor([1, 3]), r"expected \[n, 2\]"),
    ):
        with pytest.raises(ShapeError, match=msg):
            NumbaBackend().copy_blocks(caches, bad)
    assert torch.equal(_raw(caches[0].kv), snapshot)


# ---- real-GPU compilation without a GPU ---------------------------------------------------
def _have_nvvm() -> bool:
    return shutil.which("nvcc") is not None


@pytest.mark.skipif(not _have_nvvm(), reason="no CUDA toolkit (NVVM) on this machine")
@pytest.mark.parametrize("cc", ["8.0", pytest.param("9.0", marks=pytest.mark.slow)])
def test_every_kernel_variant_compiles_to_ptx(cc, tmp_path):
    """numba.cuda.compile_ptx type-checks each kernel for a real GPU (the simulator just
    runs Python and would not see a typing error)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)  # nothing is cached outside the tmp dir
    res = subprocess.run(
        [sys.executable, "-m", "kvpage_numba.ptx_check", cc],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if "CUDA driver library cannot be found" in res.stdout and "ok " not in res.stdout:
        pytest.skip("numba cannot reach NVVM here")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert res.stdout.count("ok   sm_") >= 28
