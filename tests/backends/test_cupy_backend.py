"""The CuPy backend without a GPU: the CUDA sources compile with nvcc for sm_80 and
sm_90, the launcher picks the right template instances, passes arguments in the order
and C types of each kernel's parameter list, and validates input before touching cupy.
With a CUDA GPU (``-m gpu``) it is also compared with the float64 reference.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from kvpage_cupy import CupyBackend, templates
from kvpage_cupy.backend import attention_args, copy_args, reduce_args, write_args

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.errors import DTypeError, ShapeError
from kvpage.specs import make_attention_spec, make_cache_spec
from kvpage.testing import make_case, run_plugin_case

NVCC = shutil.which("nvcc")


# ---- compilation ---------------------------------------------------------------------------
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sources_compile_with_nvcc(arch, tmp_path):
    """Every source, with representative template instances (each dtype, kv kind, GT and
    boundary head sizes), compiles to a cubin: a syntax or type error fails here."""
    unit = tmp_path / "instances.cu"
    unit.write_text(templates.instantiation_unit(templates.representative_instances()))
    cmd = [NVCC, f"-arch={arch}", "-cubin", "-std=c++17", "-o", str(tmp_path / "k.cubin")]
    cmd += [f"-I{d}" for d in templates.include_dirs()] + [str(unit)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (tmp_path / "k.cubin").stat().st_size > 0


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
def test_compile_test_would_catch_an_error(tmp_path):
    """The instantiation trick really type-checks template bodies."""
    bad = templates.read_source("copy_blocks.cu").replace(
        "plane[dst * block_stride + e] = plane[src * block_stride + e];",
        "plane[dst * block_stride + e] = undefined_name;",
    )
    (tmp_path / "copy_blocks.cu").write_text(bad)
    unit = tmp_path / "u.cu"
    unit.write_text(templates.instantiation_unit([templates.copy_instance(64)[:2]]))
    res = subprocess.run(
        [NVCC, "-arch=sm_80", "-cubin", "-std=c++17", f"-I{tmp_path}", "-o", str(tmp_path / "u.cubin"), str(unit)],  # fmt: skip
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode != 0 and "undefined_name" in res.stderr


# ---- template selection ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("group", "head_dim", "gt"),
    [(1, 128, 1), (4, 128, 4), (8, 128, 4), (16, 64, 8), (6, 64, 2), (8, 256, 2), (3, 80, 1),
     (32, 16, 8), (4, 200, 2), (8, 96, 4)],
)  # fmt: skip
def test_heads_per_block(group, head_dim, gt):
    assert templates.heads_per_block(group, head_dim) == gt


def test_attention_instance_names():
    src, expr, gt = templates.attention_instance(
        torch.bfloat16, "fp8_e4m3", torch.float8_e4m3fn, 128, 4
    )
    assert (src, gt) == ("attention.cu", 4)
    assert expr == "kvpage::paged_attention<__nv_bfloat16, unsigned char, 2, 128, 4>"
    _, expr, _ = templates.attention_instance(torch.float16, "int8", torch.int8, 80, 2)
    assert expr == "kvpage::paged_attention<__half, signed char, 1, 80, 2>"
    _, expr, _ = templates.attention_instance(torch.float32, "auto", torch.float32, 64, 1)
    assert expr == "kvpage::paged_attention<float, float, 0, 64, 1>"
    assert templates.write_instance(torch.bfloat16, "auto")[1] == (
        "kvpage::write_kv<__nv_bfloat16, __nv_bfloat16, 0>"
    )
    assert templates.write_instance(torch.float16, "fp8_e5m2")[1] == (
        "kvpage::write_kv<__half, unsigned char, 3>"
    )
    assert templates.copy_instance(6)[2] == 1 and templates.copy_instance(8)[2] == 4
    with pytest.raises(ValueError, match="head_dim: expected 1..256, got 320"):
        templates.attention_instance(torch.float16, "auto", torch.float16, 320, 1)
    with pytest.raises(ValueError, match="query.dtype"):
        templates.attention_instance(torch.float64, "auto", torch.float16, 64, 1)


def test_benchmark_instances_are_compile_tested():
    """The Llama-3-8B shapes of the GPU benchmark (bf16 and fp8 KV, head_dim 128, GQA 4)
    are among the instances the nvcc test compiles."""
    compiled = {e for _, e in templates.representative_instances()}
    for kv_dtype, store in (("auto", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        _, expr, _ = templates.attention_instance(torch.bfloat16, kv_dtype, store, 128, 4)
        assert expr in compiled
        assert templates.write_instance(torch.bfloat16, kv_dtype)[1] in compiled


# ---- argument lists match the kernels' C parameter lists ---------------------------------
def _c_params(source: str, kernel: str) -> list[str]:
    text = re.sub(r"//[^\n]*", "", templates.read_source(source))
    m = re.search(rf"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?{kernel}\((.*?)\)\s*\{{", text, re.S)  # fmt: skip
    assert m, kernel
    return [p.strip() for p in m.group(1).split(",")]


def _kind(param: str) -> type:
    if "*" in param:
        return np.uint64
    if param.startswith("long long"):
        return np.int64
    if param.startswith("int "):
        return np.int32
    assert param.startswith("float "), param
    return np.float32


def _assert_abi(args: tuple, source: str, kernel: str) -> None:
    params = _c_params(source, kernel)
    assert len(args) == len(params), (len(args), params)
    for a, p in zip(args, params):
        assert type(a) is _kind(p), (p, type(a))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_launcher_arguments_match_kernel_signatures(kv_dtype):
    spec = make_attention_spec(num_q_heads=4, num_kv_heads=2, head_dim=8, sliding_window=3)
    cache = allocate_kv_cache(4, 4, 2, 8, dtype=torch.float16, kv_dtype=kv_dtype)
    ts = cache.token_scales if cache.token_scales is not None else torch.zeros(1, 1, 1, 1)
    fsc = torch.ones(2, 2)
    k = torch.zeros(3, 2, 8, dtype=torch.float16)
    _assert_abi(write_args(k, k, cache, torch.zeros(3, dtype=torch.int64), ts, fsc), "write_kv.cu", "write_kv")  # fmt: skip
    q = torch.zeros(3, 4, 8, dtype=torch.float16)
    i32 = torch.zeros(3, dtype=torch.int32)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    part = torch.zeros(1)
    args = attention_args(q, cache, ts, fsc, bt, i32, i32, q, part, part, spec, 16, 1)
    _assert_abi(args, "attention.cu", "paged_attention")
    _assert_abi((*args, np.int32(3)), "attention.cu", "paged_attention_rows")
    _assert_abi(reduce_args(part, part, q, 2, 8), "attention.cu", "split_reduce")
    pairs = torch.zeros(1, 2, dtype=torch.int64)
    _assert_abi(copy_args(cache.kv, 4, pairs), "copy_blocks.cu", "copy_blocks")
    # words of one block and the stride between K and V planes, in 4-byte words
    words = copy_args(cache.kv, 4, pairs)
    per_block = 4 * 2 * 8 * cache.kv.element_size() // 4
    assert int(words[2]) == int(words[3]) == per_block and int(words[1]) == 4 * per_block


def test_split_heuristic():
    be = CupyBackend()
    assert be.choose_splits(blocks=2048, max_keys=4096, sms=132) == 1
    assert be.choose_splits(blocks=8, max_keys=32768, sms=132) == 33
    assert be.choose_splits(blocks=8, max_keys=300, sms=132) == 1
    assert CupyBackend(num_splits=4).choose_splits(blocks=2048, max_keys=3, sms=132) == 3
    assert CupyBackend(num_splits=500).choose_splits(blocks=1, max_keys=10**6, sms=132) == 64
    with pytest.raises(ValueError, match="num_splits"):
        CupyBackend(num_splits=0)
    with pytest.raises(ValueError, match="prefill_kernel"):
        CupyBackend(prefill_kernel="tiles")


# ---- capability and validation, before cupy is touched -------------------------------------
def test_import_does_not_import_cupy():
    code = "import sys, kvpage_cupy; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unsupported_reasons_on_cpu_and_big_heads():
    spec = make_cache_spec(
        num_layers=1, num_blocks=4, layers=[dict(num_q_heads=4, num_kv_heads=1, head_dim=512)]
    )
    why = CupyBackend().unsupported_reasons(spec, torch.device("cpu"))
    assert any("expected cuda, got cpu" in r for r in why)
    assert any("head_dim: expected <= 256, got 512" in r for r in why)


def test_validation_runs_before_any_launch():
    be = CupyBackend()
    cache = allocate_kv_cache(4, 4, 2, 8, dtype=torch.float16)
    before = cache.kv.clone()
    k = torch.randn(3, 2, 8, dtype=torch.float16)
    with pytest.raises(ShapeError, match="key: expected"):
        be.write_kv(k[:, :1], k, cache, torch.arange(3))
    with pytest.raises(DTypeError, match="key: expected the cache dtype"):
        be.write_kv(k.float(), k.float(), cache, torch.arange(3))
    with pytest.raises(ShapeError, match="slot_mapping"):
        be.write_kv(k, k, cache, torch.tensor([0, 1, 99]))
    with pytest.raises(ShapeError, match="expected cuda, got cpu"):
        be.write_kv(k, k, cache, torch.arange(3))
    spec = make_attention_spec(num_q_heads=4, num_kv_heads=2, head_dim=8)
    meta = AttentionMetadata.build([2], [5], [[1, 2]], 4)
    with pytest.raises(ShapeError, match="query: expected"):
        be.forward(torch.randn(2, 3, 8, dtype=torch.float16), cache, be.plan(meta), spec)
    with pytest.raises(ShapeError, match=r"query: expected \[2, 4, 8\], got \[1, 4, 8\]"):
        be.forward(torch.randn(1, 4, 8, dtype=torch.float16), cache, be.plan(meta), spec)
    with pytest.raises(ShapeError, match="cache.kv.device: expected cuda, got cpu"):
        be.forward(torch.randn(2, 4, 8, dtype=torch.float16), cache, be.plan(meta), spec)
    with pytest.raises(ShapeError, match="distinct destination"):
        be.copy_blocks([cache], torch.tensor([[1, 3], [2, 3]]))
    assert torch.equal(cache.kv, before)


# ---- on a GPU ------------------------------------------------------------------------------
def _gpu_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    spec = make_cache_spec(
        num_layers=1, num_blocks=4, layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=64)]
    )
    return not CupyBackend().unsupported_reasons(spec, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU that cupy can use")
@pytest.mark.parametrize("prefill_kernel", ["rows", "block"])
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "hd", "window", "splits"),
    [
        (torch.bfloat16, "auto", 128, None, None),
        (torch.float16, "int8", 80, 7, 3),
        (torch.bfloat16, "fp8_e4m3", 64, None, 4),
        (torch.float32, "fp8_e5m2", 96, None, None),
    ],
)
def test_gpu_matches_reference(dtype, kv_dtype, hd, window, splits, prefill_kernel):
    """Through the shared plugin harness (``kvpage.testing.run_plugin_case``)."""
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    case = make_case(
        (37, 20), (5, 1), hq=8, hk=2, hd=hd, bs=16, dtype=name[dtype], kv_dtype=kv_dtype,
        window=window, k_scale=(0.25,), v_scale=(0.5,),
    )  # fmt: skip
    be = CupyBackend(num_splits=splits, prefill_kernel=prefill_kernel)
    got, want = run_plugin_case(be, case, torch.device("cuda"))
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


class _FakeProps:
    multi_processor_count = 132


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e5m2"])
def test_launcher_flow_with_recorded_launches(monkeypatch, kv_dtype):
    """The launcher code between validation and the kernel (planning, template choice,
    splits, grids, buffers), run on CPU tensors with the launch recorded instead."""
    calls: list[tuple] = []
    monkeypatch.setattr(CupyBackend, "_require_cuda", staticmethod(lambda t: None))
    monkeypatch.setattr(CupyBackend, "_kernel", staticmethod(lambda src, expr: expr))
    monkeypatch.setattr(
        CupyBackend,
        "_run",
        lambda self, fn, grid, block, args, dev: calls.append((fn, grid, block, args)),  # fmt: skip
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: _FakeProps())
    dtype = torch.bfloat16
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=2, head_dim=64, sliding_window=9)
    cache = allocate_kv_cache(8, 4, 2, 64, dtype=dtype, kv_dtype=kv_dtype)
    be = CupyBackend(num_splits=3)
    plan = be.plan(AttentionMetadata.build([3, 1], [10, 6], [[1, 2, 3], [4, 5]], 4))
    be.write_kv(torch.randn(4, 2, 64).to(dtype), torch.randn(4, 2, 64).to(dtype), cache, plan.meta.slot_mapping)  # fmt: skip
    fn, grid, block, args = calls[-1]
    assert grid == (4, 4) and block == 32 and fn.startswith("kvpage::write_kv<__nv_bfloat16")
    out = torch.full((4, 8, 64), float("nan"), dtype=dtype)
    res = be.forward(torch.randn(4, 8, 64).to(dtype), cache, plan, spec, out=out)
    assert res is out
    (afn, agrid, ablock, aargs), (rfn, rgrid, _, rargs) = calls[-2:]
    assert afn.endswith(", 64, 4>") and agrid == (4, 2, 3) and ablock == 128
    assert int(aargs[-1]) == 3 and int(aargs[-2]) == 3  # splits, chunk = ceil(9 / 3)
    assert rfn == "kvpage::split_reduce<__nv_bfloat16>" and rgrid == (32,)
    assert int(rargs[2]) == out.data_ptr()  # the reduce writes the caller's buffer
    calls.clear()
    dplan = be.plan(AttentionMetadata.build([1, 1], [10, 6], [[1, 2, 3], [4, 5]], 4))
    wide = torch.zeros((2, 8, 70), dtype=dtype)
    be.forward(torch.randn(2, 8, 64).to(dtype), cache, dplan, spec, out=wide[..., :64])
    assert calls[0][1] == (2, 2, 3)  # non-contiguous out: computed into a temporary
    assert int(calls[-1][3][2]) != wide.data_ptr() and torch.equal(wide[..., 64:], torch.zeros(2, 8, 6, dtype=dtype))  # fmt: skip
    calls.clear()
    CupyBackend().forward(torch.randn(4, 8, 64).to(dtype), cache, plan, spec)
    assert len(calls) == 1 and "paged_attention_rows<" in calls[0][0]
    assert calls[0][1] == (1, 2) and int(calls[0][3][-1]) == 4  # 4 rows in one block
    calls.clear()
    be.copy_blocks([cache], torch.tensor([[1, 6], [2, 7]]))
    assert [c[1] for c in calls] == [(2, 2)] * (2 if kv_dtype == "int8" else 1)


def test_sources_avoid_what_nvrtc_lacks():
    """NVRTC (what cupy.RawModule uses) has no host headers and does not guarantee the
    <math.h> macros that nvcc brings along, so the nvcc test alone would not catch them."""
    for name in (*templates.SOURCES, "kvpage_common.cuh"):
        text = re.sub(r"//[^\n]*", "", (templates.KERNEL_DIR / name).read_text())
        includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', text)
        assert set(includes) <= {"cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h", "kvpage_common.cuh"}, name  # fmt: skip
        for word in ("INFINITY", "NAN", "isnan", "isinf", "signbit", "printf", "assert("):
            assert word not in text, f"{name} uses {word}"
