"""Helpers for running the numba kernels in numba's CUDA simulator (CPU), where every
simulated thread is a Python thread (ARCHITECTURE.md section 8). Only the launcher uses
them, and only for CPU tensors; the kernels are the same code as on a GPU.
"""

from __future__ import annotations

import sys
from typing import Any


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
        self.configured = configured

    def __call__(self, *args: Any) -> None:
        old = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)
        try:
            self.configured(*args)
        finally:
            sys.setswitchinterval(old)
