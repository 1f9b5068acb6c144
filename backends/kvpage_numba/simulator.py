"""Helpers for running the numba kernels in numba's CUDA simulator (CPU), where every
simulated thread is a Python thread (ARCHITECTURE.md section 8). Only the launcher uses
them, and only for CPU tensors; the kernels are the same code as on a GPU.

``install_locked_shared_arrays`` fixes a race in the simulator itself (numba 0.68.1,
``numba/cuda/simulator/kernelapi.py``, ``FakeCUDAShared.array``): a static shared array
is looked up by its call site and, when missing, created and inserted without a lock. Two
simulated threads of one block that reach the call site together can both miss and each
get their own array; the writes of one are then invisible to the other after
``syncthreads``. In the attention kernel that corrupted every head of the first block of a
launch in about 1 % of launches on a loaded machine (docs/tolerances.md, "numba simulator
race"); the kernels themselves were right.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

#: guards the simulator's per-launch table of static shared arrays
_SHARED_LOCK = threading.Lock()
_INSTALLED: list[bool] = []
#: numba's own ``FakeCUDAShared.array`` (kept for the regression test); set on install
NUMBA_SHARED_ARRAY: Any = None


def locked_shared_array(self: Any, shape: Any, dtype: Any) -> Any:
    """Replacement for ``FakeCUDAShared.array``: the same contract (one array per call
    site per launch; size 0 = the dynamic shared buffer), with the lookup and the insert
    under one lock. The call site is the caller's (file, line), as numba keys it."""
    from numba.core import types
    from numba.np import numpy_support

    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:  # dynamic shared memory: one buffer for the whole launch
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    frame = sys._getframe(1)
    site = (frame.f_code.co_filename, frame.f_lineno)
    with _SHARED_LOCK:
        arr = self._allocations.get(site)
        if arr is None:
            arr = np.empty(shape, dtype)
            self._allocations[site] = arr
    return arr


def cudasim_enabled() -> bool:
    """Whether numba runs CUDA kernels in its simulator (``NUMBA_ENABLE_CUDASIM=1`` when
    numba was imported). Imports numba."""
    import numba

    # numba.config sets its options from the environment with setattr at import, so
    # mypy sees no attribute (numba.config has no stub for them)
    return bool(numba.config.ENABLE_CUDASIM)  # type: ignore[attr-defined]


def install_locked_shared_arrays() -> None:
    """Make the CUDA simulator's static ``cuda.shared.array`` allocation thread-safe (see
    the module docstring). Idempotent; a no-op unless ``NUMBA_ENABLE_CUDASIM=1``. Mutates
    ``numba.cuda.simulator.kernelapi.FakeCUDAShared.array`` for the whole process."""
    if _INSTALLED:
        return
    if not cudasim_enabled():
        return
    from numba.cuda.simulator import kernelapi

    global NUMBA_SHARED_ARRAY
    NUMBA_SHARED_ARRAY = kernelapi.FakeCUDAShared.array
    # replacing the simulator's method on its class is the point of this function
    kernelapi.FakeCUDAShared.array = locked_shared_array  # type: ignore[method-assign]
    _INSTALLED.append(True)


class SimArray:
    """A numpy array handed to a simulated kernel as-is. The simulator wraps ndarray
    arguments in two proxy layers (about 5 us per element access, measured); the kernels
    only index arrays and read ``.shape``, which this thin proxy forwards (0.4 us)."""

    __slots__ = ("a", "shape")

    def __init__(self, a: Any) -> None:
        self.a = a
        self.shape = a.shape

    def __getitem__(self, i: Any) -> Any:
        return self.a[i]

    def __setitem__(self, i: Any, v: Any) -> None:
        self.a[i] = v


class SimLaunch:
    """Runs a simulated launch with a short GIL switch interval (restored after): the
    simulator's scheduler thread busy-polls its worker threads and competes with them
    for the GIL; at the default 5 ms most of a launch is spent waiting (measured on a
    13-token prefill: 1.65 s at 5 ms, 0.15 s at 0.05 ms; benches/gpu/bench_simulator.py)."""

    def __init__(self, configured: Any) -> None:
        install_locked_shared_arrays()
        self.configured = configured

    def __call__(self, *args: Any) -> None:
        old = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)
        try:
            self.configured(*args)
        finally:
            sys.setswitchinterval(old)
