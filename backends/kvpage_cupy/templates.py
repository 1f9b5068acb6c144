"""Template selection for the CUDA sources in ``kernels/`` (pure Python; no cupy import).

Every kernel is a C++ template; the launcher names the instance it needs as a
``cupy.RawModule`` name expression (``"kvpage::paged_attention<__nv_bfloat16, ...>"``)
and NVRTC instantiates exactly that. This module maps torch dtypes, the cache's kv dtype,
head_dim and the GQA group size to those names, so the choice is testable on a machine
without a GPU, and lists representative instances for the ``nvcc`` compile test.

Templated where it pays: ``HEAD_DIM`` (per-lane register arrays of ``ceil(head_dim /
32)`` elements and unrolled loops) and ``GT``, the query heads of one KV head that a
thread block serves, so K/V rows are read once per GQA group. Block size stays a runtime
argument (one index division per key).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

#: the CUDA sources
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
SOURCES = ("attention.cu", "write_kv.cu", "copy_blocks.cu")
#: largest head_dim the attention kernel is instantiated for (register budget)
MAX_HEAD_DIM = 256
#: most per-lane accumulator registers (GT * ceil(head_dim / 32)) an instance may use
MAX_LANE_ELEMS = 16

C_TYPES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
}
#: KIND template argument per CacheSpec.kv_dtype (see kernels/kvpage_common.cuh)
KV_KINDS: dict[str, int] = {"auto": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}
#: storage element type of quantized caches
QUANT_STORAGE: dict[str, str] = {
    "int8": "signed char",
    "fp8_e4m3": "unsigned char",
    "fp8_e5m2": "unsigned char",
}


def _c_type(dtype: torch.dtype, what: str) -> str:
    if dtype not in C_TYPES:
        raise ValueError(f"{what}: expected float32|float16|bfloat16, got {dtype}")
    return C_TYPES[dtype]


def heads_per_block(group: int, head_dim: int) -> int:
    """GT: the most query heads of one GQA group one block serves: the largest of 8, 4,
    2, 1 that divides ``group`` and keeps ``GT * ceil(head_dim / 32)`` accumulator
    registers per lane within ``MAX_LANE_ELEMS``."""
    e = -(-head_dim // 32)
    for gt in (8, 4, 2, 1):
        if group % gt == 0 and gt * e <= MAX_LANE_ELEMS:
            return gt
    return 1


def storage_type(kv_dtype: str, model_dtype: torch.dtype) -> str:
    """C element type of the cache: the model type for ``auto``, else the quantized one."""
    if kv_dtype == "auto":
        return _c_type(model_dtype, "cache.kv.dtype")
    if kv_dtype not in QUANT_STORAGE:
        raise ValueError(f"kv_dtype: expected one of {sorted(KV_KINDS)}, got {kv_dtype!r}")
    return QUANT_STORAGE[kv_dtype]


def attention_instance(
    query_dtype: torch.dtype,
    kv_dtype: str,
    cache_dtype: torch.dtype,
    head_dim: int,
    group: int,
    *,
    rows: bool = False,
) -> tuple[str, str, int]:
    """The attention kernel for a call.

    Args:
        query_dtype: the query (and output) dtype.
        kv_dtype: the cache's ``kv_dtype`` (``auto``, ``int8``, ``fp8_e4m3``, ``fp8_e5m2``).
        cache_dtype: ``cache.kv.dtype`` (the model dtype for ``auto``).
        head_dim: exact head size, 1..``MAX_HEAD_DIM``.
        group: query heads per KV head.
        rows: the prefill kernel with one warp per query row (``paged_attention_rows``)
            instead of one block per row with optional KV splits (``paged_attention``).

    Returns:
        ``(source file, name expression, GT)``.

    Raises:
        ValueError: unsupported dtype or head_dim (the backend reports these as
            unsupported reasons before any launch).
    """
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim: expected 1..{MAX_HEAD_DIM}, got {head_dim}")
    q = _c_type(query_dtype, "query.dtype")
    kv = storage_type(kv_dtype, cache_dtype)
    gt = heads_per_block(group, head_dim)
    name = "paged_attention_rows" if rows else "paged_attention"
    expr = f"kvpage::{name}<{q}, {kv}, {KV_KINDS[kv_dtype]}, {head_dim}, {gt}>"
    return "attention.cu", expr, gt


def reduce_instance(out_dtype: torch.dtype) -> tuple[str, str]:
    """The split-KV reduction writing ``out_dtype``."""
    return "attention.cu", f"kvpage::split_reduce<{_c_type(out_dtype, 'out.dtype')}>"


def write_instance(src_dtype: torch.dtype, kv_dtype: str) -> tuple[str, str]:
    """The write kernel for key/value of ``src_dtype`` into a ``kv_dtype`` cache (for
    ``auto`` the cache dtype equals ``src_dtype``)."""
    src = _c_type(src_dtype, "key.dtype")
    dst = storage_type(kv_dtype, src_dtype)
    return "write_kv.cu", f"kvpage::write_kv<{src}, {dst}, {KV_KINDS[kv_dtype]}>"


def copy_instance(block_bytes: int) -> tuple[str, str, int]:
    """The block copy kernel: 4-byte words when a block's byte size allows, else bytes.

    Returns:
        ``(source file, name expression, word size in bytes)``.
    """
    if block_bytes % 4 == 0:
        return "copy_blocks.cu", "kvpage::copy_blocks<unsigned int>", 4
    return "copy_blocks.cu", "kvpage::copy_blocks<unsigned char>", 1


def read_source(name: str) -> str:
    """Text of ``kernels/<name>`` (it ``#include``s ``kvpage_common.cuh``: compile with
    ``include_dirs()`` on the include path)."""
    if name not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, got {name!r}")
    return (KERNEL_DIR / name).read_text()


def include_dirs(cuda_path: str | None = None) -> list[str]:
    """Include directories for NVRTC/nvcc: the kernel folder, then the CUDA toolkit's
    ``include`` (for ``cuda_fp16.h``, ``cuda_bf16.h``, ``cuda_fp8.h``) when found via
    ``cuda_path``, ``$CUDA_PATH`` / ``$CUDA_HOME``, ``/usr/local/cuda``, or
    ``cuda.pathfinder`` (which also finds pip-installed NVIDIA headers)."""
    dirs = [str(KERNEL_DIR)]
    roots = [cuda_path, os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]  # fmt: skip
    for r in roots:
        if r and (Path(r) / "include" / "cuda_fp8.h").is_file():
            dirs.append(str(Path(r) / "include"))
            return dirs
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception:  # not installed or nothing found: NVRTC's built-in headers remain
        found = None
    if found and (Path(found) / "cuda_fp8.h").is_file():
        dirs.append(str(found))
    return dirs


def compile_options(cuda_path: str | None = None) -> tuple[str, ...]:
    """NVRTC options: C++17 (``if constexpr``), the include path; no fast math, so
    division and ``expf`` are IEEE-accurate and the int8/fp8 encodes match torch."""
    return ("-std=c++17", *(f"-I{d}" for d in include_dirs(cuda_path)))


def representative_instances() -> list[tuple[str, str]]:
    """(source, name expression) pairs covering every dtype / kind / GT path and
    boundary head sizes, for compile tests without a GPU."""
    out: list[tuple[str, str]] = []
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    for q, kv_dtype, cache, hd, group in (
        (f32, "auto", f32, 64, 1),
        (f16, "auto", f16, 128, 4),
        (bf16, "auto", bf16, 128, 4),
        (bf16, "auto", bf16, 80, 8),
        (f16, "int8", torch.int8, 96, 2),
        (bf16, "fp8_e4m3", torch.float8_e4m3fn, 128, 4),
        (f16, "fp8_e5m2", torch.float8_e5m2, 256, 8),
        (f32, "fp8_e4m3", torch.float8_e4m3fn, 16, 32),
    ):
        for rows in (False, True):
            src, expr, _ = attention_instance(q, kv_dtype, cache, hd, group, rows=rows)
            out.append((src, expr))
    for q in (f32, f16, bf16):
        out.append(reduce_instance(q))
        for kv_dtype in KV_KINDS:
            out.append(write_instance(q, kv_dtype))
    for nbytes in (64, 3):
        src, expr, _ = copy_instance(nbytes)
        out.append((src, expr))
    return out


def instantiation_unit(instances: list[tuple[str, str]]) -> str:
    """A translation unit that includes the sources and takes the address of each
    instance, which makes ``nvcc`` instantiate (and so type-check) them."""
    srcs = sorted({s for s, _ in instances}, key=SOURCES.index)
    lines = [f'#include "{s}"' for s in srcs]
    lines.append("void* kvpage_instances[] = {")
    lines += [f"    (void*)&{expr}," for _, expr in instances]
    lines.append("};")
    return "\n".join(lines) + "\n"
