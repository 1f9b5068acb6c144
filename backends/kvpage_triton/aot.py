"""Ahead-of-time compilation of the kernels for a CUDA architecture, without a GPU.

``triton.compile`` lowers a kernel through TTIR/TTGIR/LLVM to PTX and runs the bundled
``ptxas``; no CUDA driver is needed. This catches what the interpreter cannot: code
that only fails to *compile* (non-constexpr globals, unsupported casts, dot shapes,
shared-memory overflow). Used by the tests (a few variants) and by
``python -m kvpage_triton.aot`` (every variant of the benchmark shapes).

Imports triton: do not import from the backend's import path.
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvpage_triton.kernels.attention import paged_attention_kernel, reduce_splits_kernel
from kvpage_triton.kernels.cache_ops import copy_blocks_kernel, write_kv_kernel

#: triton pointer type names of torch dtype names
PTR = {
    "float32": "*fp32",
    "float16": "*fp16",
    "bfloat16": "*bf16",
    "int8": "*i8",
    "fp8_e4m3": "*fp8e4nv",
    "fp8_e5m2": "*fp8e5",
}
_FLOAT_ARGS = {"sm_scale", "soft_cap"}


def _signature(fn: Any, ptrs: dict[str, str], consts: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    return sig


def _compile(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], arch: int, **opts: Any) -> Any:
    src = ASTSource(fn, _signature(fn, ptrs, consts), consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def compile_attention(
    arch: int,
    dtype: str = "bfloat16",
    kv_dtype: str = "auto",
    *,
    group: int = 4,
    head_dim: int = 128,
    decode: bool = True,
    soft_cap: bool = False,
) -> Any:
    """Compile ``paged_attention_kernel`` as the launcher would for these settings on
    a CUDA device of compute capability ``arch`` (e.g. 90). Returns the compiled kernel."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_q = 1 if decode else max(1, 64 // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    kv = dtype if kv_dtype == "auto" else kv_dtype
    consts = dict(
        GROUP=group,
        HEADS_PER_PROG=group,
        NUM_CHUNKS=1,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        BLOCK_D=block_d,
        DIRECT_TILES=decode,
        KV_QUANT={"auto": 0, "int8": 1}.get(kv_dtype, 2),
        USE_SOFTCAP=soft_cap,
        DOT_FP32=dtype == "float32",
    )
    ptrs = {
        "q_ptr": PTR[dtype],
        "kv_ptr": PTR[kv],
        "out_ptr": PTR[dtype],
        "qsl_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "bt_ptr": "*i32",
        "tile_seq_ptr": "*i32",
        "tile_qstart_ptr": "*i32",
    }
    warps = 4 if block_m * block_d <= 64 * 128 else 8
    stages = 2 if block_d > 128 else 3
    return _compile(paged_attention_kernel, ptrs, consts, arch, num_warps=warps, num_stages=stages)


def compile_reduce(
    arch: int, dtype: str = "bfloat16", splits: int = 32, head_dim: int = 128
) -> Any:
    """Compile ``reduce_splits_kernel`` for ``splits`` splits."""
    consts = dict(BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim))
    return _compile(reduce_splits_kernel, {"out_ptr": PTR[dtype]}, consts, arch, num_warps=4)


def compile_write_kv(
    arch: int, dtype: str, kv_dtype: str, num_kv_heads: int = 8, head_dim: int = 128
) -> Any:
    """Compile ``write_kv_kernel`` for a model dtype and kv dtype."""
    quant = {"auto": 0, "int8": 1}.get(kv_dtype, 2)
    fmt = {"fp8_e4m3": (448.0, 3, -6), "fp8_e5m2": (57344.0, 2, -14)}.get(kv_dtype, (0.0, 0, 0))
    block_h = triton.next_power_of_2(num_kv_heads)
    consts = dict(
        QUANT=quant,
        FP8_MAX=fmt[0],
        MANT_BITS=fmt[1],
        MIN_EXP=fmt[2],
        BLOCK_T=max(1, 16 // block_h),
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    ptrs = {
        "key_ptr": PTR[dtype],
        "value_ptr": PTR[dtype],
        "slot_ptr": "*i64",
        "kv_ptr": PTR[dtype if kv_dtype == "auto" else kv_dtype],
    }
    return _compile(write_kv_kernel, ptrs, consts, arch, num_warps=4, enable_fp_fusion=False)


def compile_copy(arch: int, elem: str = "*i16") -> Any:
    """Compile ``copy_blocks_kernel`` for an integer element view."""
    return _compile(
        copy_blocks_kernel,
        {"buf_ptr": elem, "pairs_ptr": "*i64"},
        {"BLOCK": 4096},
        arch,
        num_warps=4,
    )


def _run_jobs(jobs: list[tuple[str, Any]]) -> int:
    """Compile each job, print ok/FAILED per variant; return the number of failures."""
    failures = 0
    for name, job in jobs:
        t0 = time.perf_counter()
        try:
            k = job()
            dt = time.perf_counter() - t0
            print(f"{name}: ok ({dt:.1f}s, smem {k.metadata.shared} B)", flush=True)
        except Exception as e:  # report every failing variant, not just the first
            failures += 1
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    return failures


QUICK: list[tuple[str, Any]] = [
    ("sm_90 attention bf16/fp8_e4m3 decode", lambda: compile_attention(90, "bfloat16", "fp8_e4m3")),
    ("sm_80 attention fp16/int8 prefill soft cap", lambda: compile_attention(80, "float16", "int8", decode=False, soft_cap=True)),
    ("sm_90 write_kv bf16/fp8_e5m2", lambda: compile_write_kv(90, "bfloat16", "fp8_e5m2")),
    ("sm_80 write_kv fp16/int8", lambda: compile_write_kv(80, "float16", "int8")),
    ("sm_80 reduce", lambda: compile_reduce(80)),
    ("sm_80 copy", lambda: compile_copy(80)),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Compile every kernel variant the benchmark and the engine use (or ``--quick``:
    a few representative ones); print one line per variant; exit 1 if any failed."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, action="append", help="compute capability x10 (repeatable)")
    ap.add_argument("--quick", action="store_true", help="a few representative variants only")
    args = ap.parse_args(argv)
    if args.quick:
        return 1 if _run_jobs(QUICK) else 0
    failures = 0
    for arch in args.arch or [80, 90]:
        jobs: list[tuple[str, Any]] = []
        kvs = ["auto", "int8"] + (["fp8_e4m3", "fp8_e5m2"] if arch >= 89 else [])
        for dt, kv in itertools.product(["float32", "float16", "bfloat16"], kvs):
            jobs.append((f"write_kv {dt}/{kv}", lambda a=arch, d=dt, k=kv: compile_write_kv(a, d, k)))  # fmt: skip
        for dt, kv, dec in itertools.product(["bfloat16", "float16", "float32"], kvs, [True, False]):  # fmt: skip
            name = f"attention {dt}/{kv} {'decode' if dec else 'prefill'}"
            jobs.append((name, lambda a=arch, d=dt, k=kv, de=dec: compile_attention(a, d, k, decode=de)))  # fmt: skip
        jobs.append(("attention bf16 prefill hd=256 MQA soft cap", lambda a=arch: compile_attention(a, head_dim=256, group=8, decode=False, soft_cap=True)))  # fmt: skip
        jobs.append(("reduce", lambda a=arch: compile_reduce(a)))
        jobs.append(("copy", lambda a=arch: compile_copy(a)))
        failures += _run_jobs([(f"sm_{arch} {name}", job) for name, job in jobs])
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
