"""The numba CUDA simulator's shared-array race and kvpage's locked allocation.

numba 0.68.1's simulator (``FakeCUDAShared.array``) finds a block's static shared array by
call site and creates it on a miss without a lock: simulated threads that miss together
each get their own array, and the writes of one are lost to the others after
``syncthreads``. That made the numba backend's results vary under load (issue 10; about
1 % of attention launches on a loaded 2-core machine corrupted the first block).
``kvpage_numba.simulator.install_locked_shared_arrays`` replaces the allocation with a
locked one. These tests force the interleaving instead of waiting for a loaded machine:
the first makes every thread miss at once (a barrier inside numba's window), so the
upstream code is wrong on every launch; the second widens the window with a sleep and
shows the locked allocation stays right.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

numba = pytest.importorskip("numba")
if not numba.config.ENABLE_CUDASIM:
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (the CUDA simulator)", allow_module_level=True)

from kvpage_numba import simulator  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda.simulator import kernelapi  # noqa: E402

T = 8


def _sum_kernel():  # type: ignore[no-untyped-def]
    """Each thread writes 1 into its slot of two shared arrays; thread 0 sums both."""

    def kernel(out):  # type: ignore[no-untyped-def]
        a = cuda.shared.array(T, numba.float32)
        b = cuda.shared.array(T, numba.float32)
        i = cuda.threadIdx.x
        a[i] = 1.0
        b[i] = 2.0
        cuda.syncthreads()
        if i == 0:
            s = numba.float32(0.0)
            for j in range(T):
                s += a[j] + b[j]
            out[0] = s

    return cuda.jit(kernel)


class _NumpyWith:
    """numpy, except ``empty``, which runs ``hook`` first (inside the allocation window)."""

    def __init__(self, hook) -> None:  # type: ignore[no-untyped-def]
        self.hook = hook

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(np, name)

    def empty(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.hook()
        return np.empty(*args, **kwargs)


def _launch_sums(kernel, launches: int) -> list[float]:  # type: ignore[no-untyped-def]
    sums = []
    for _ in range(launches):
        out = np.zeros(1, np.float32)
        kernel[1, T](out)
        sums.append(float(out[0]))
    return sums


def test_upstream_shared_array_allocation_races_when_threads_miss_together(monkeypatch):
    """Pins the upstream bug this module works around: with numba's own allocation and
    every thread inside its miss window at once, each thread gets a private "shared"
    array and thread 0 does not see the others' writes. If this starts failing, numba
    changed ``FakeCUDAShared.array``: re-check whether the workaround is still needed."""
    simulator.install_locked_shared_arrays()
    original = simulator.NUMBA_SHARED_ARRAY
    assert original is not None and original is not simulator.locked_shared_array
    monkeypatch.setattr(kernelapi.FakeCUDAShared, "array", original)
    state = {"barrier": threading.Barrier(T, timeout=30)}

    def all_threads_in_window() -> None:
        if threading.current_thread() is not threading.main_thread():
            state["barrier"].wait()

    monkeypatch.setattr(kernelapi, "np", _NumpyWith(all_threads_in_window))
    kernel = _sum_kernel()
    for _ in range(2):
        state["barrier"] = threading.Barrier(T, timeout=30)
        sums = _launch_sums(kernel, 1)
        assert sums[0] != 3.0 * T, "every thread had its own array, yet the sum was right"


def test_locked_shared_array_allocation_is_one_array_per_site_per_launch(monkeypatch):
    """kvpage's allocation keeps one array per call site even when the window is wide
    (a 5 ms sleep inside it, where the other threads run), on every launch."""
    simulator.install_locked_shared_arrays()
    assert kernelapi.FakeCUDAShared.array is simulator.locked_shared_array
    monkeypatch.setattr(simulator, "np", _NumpyWith(lambda: time.sleep(0.005)))
    sums = _launch_sums(_sum_kernel(), 5)
    assert sums == [3.0 * T] * 5


def test_locked_allocation_keeps_distinct_sites_apart_and_dynamic_shared_memory():
    simulator.install_locked_shared_arrays()

    def kernel(out):  # type: ignore[no-untyped-def]
        a = cuda.shared.array(4, numba.int32)
        b = cuda.shared.array(4, numba.int32)
        dyn = cuda.shared.array(0, numba.int32)
        i = cuda.threadIdx.x
        a[i] = 1
        b[i] = 10
        dyn[i] = 100
        cuda.syncthreads()
        out[i] = a[(i + 1) % 4] + b[(i + 2) % 4] + dyn[(i + 3) % 4]

    out = np.zeros(4, np.int32)
    cuda.jit(kernel)[1, 4, 0, 16](out)
    assert out.tolist() == [111] * 4
