"""Compile every numba kernel variant to PTX for real GPUs, without a GPU.

``numba.cuda.compile_ptx`` type-checks and lowers a kernel for a compute capability
using NVVM only (no driver), so a typing error that the CUDA simulator cannot see (the
simulator just runs Python) fails here. Run as ``python -m kvpage_numba.ptx_check
[8.0 9.0 ...]`` with ``NUMBA_ENABLE_CUDASIM`` unset; the tests do that in a subprocess.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

#: storage dtype (numba type name) of each kernel kind
_KV_TYPES = {"float": ("float32", "float16"), "bf16": ("int16",), "int8": ("int8",), "fp8": ("uint8",)}  # fmt: skip
_SRC_TYPES = {"float": ("float32", "float16"), "bf16": ("int16",)}


def variants() -> Iterator[tuple[str, Any, str]]:
    """(label, python kernel function, numba signature string) for every variant the
    launcher can produce."""
    from kvpage_numba import kernels

    a = "[:, :, :]"
    for qk, qts in _SRC_TYPES.items():
        for kk, kts in _KV_TYPES.items():
            for qt in qts:
                kt = kts[0]
                sig = (
                    f"void({qt}{a}, {kt}[:, :, :, :, :], float32[:, :, :, :], float32[:, :], "
                    f"float32[:], int32[:, :], int32[:], int32[:], float32{a}, "
                    "float32[:, :, :, :], float32[:, :, :], int64, float32, int64, float32, "
                    "int64, int64, int64)"
                )
                yield f"attention[{qk},{kk},{qt}]", kernels.attention_pyfunc(qk, kk), sig
    for sk, sts in _SRC_TYPES.items():
        for st in sts:
            for dk, dt, mb, bias in (
                ("copy", st, 3, 7),
                ("int8", "int8", 3, 7),
                ("fp8", "uint8", 3, 7),
                ("fp8", "uint8", 2, 15),
            ):
                sig = (
                    f"void({st}{a}, {st}{a}, {dt}[:, :, :, :, :], float32[:, :, :, :], "
                    "float32[:, :], int64[:], int64, float32)"
                )
                fn = kernels.write_kv_pyfunc(sk, dk, mb, bias)
                yield f"write_kv[{sk}:{st}->{dk}/{mb}]", fn, sig
    yield (
        "split_reduce",
        kernels.split_reduce,
        "void(float32[:, :, :, :], float32[:, :, :], float32[:, :, :], int64)",
    )
    for it in ("uint8", "int16", "int32"):
        yield f"copy_blocks[{it}]", kernels.copy_blocks, f"void({it}[:, :, :], int64[:, :])"


class _FakeDevice:
    def __init__(self, cc: tuple[int, ...]) -> None:
        self.compute_capability = cc

    def __call__(self) -> _FakeDevice:
        """Stands in for ``dispatcher.get_current_device()``: returns itself."""
        return self


def main(argv: list[str]) -> int:
    """Compile all variants for each ``major.minor`` in ``argv`` (default 8.0 and 9.0);
    print one line per variant and return the number of failures."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("NUMBA_ENABLE_CUDASIM=1 is set: unset it to compile real PTX")
        return 1
    from numba import cuda
    from numba.cuda import dispatcher

    ccs = [tuple(int(x) for x in v.split(".")) for v in (argv or ["8.0", "9.0"])]
    failures = 0
    for cc in ccs:
        # device functions are compiled for the *current device's* compute capability;
        # with no driver, stand in a device of the target capability (this process only)
        dispatcher.get_current_device = _FakeDevice(cc)
        for label, fn, sig in variants():
            try:
                # numba.cuda.compile_ptx has no annotations
                ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)  # type: ignore[no-untyped-call]
                print(f"ok   sm_{cc[0]}{cc[1]} {label} ({len(ptx)} chars)")
            except Exception as e:  # report every failure, keep going
                failures += 1
                print(f"FAIL sm_{cc[0]}{cc[1]} {label}: {type(e).__name__}: {e}")
    return failures


if __name__ == "__main__":
    sys.exit(min(main(sys.argv[1:]), 1))
