"""kvpage plugin backend ``numba-cpu``: paged attention on the CPU as one compiled,
multi-threaded Numba kernel that reads K/V in place through the block table.

Registered through the ``kvpage.backends`` entry point ``numba-cpu =
kvpage_numba_cpu:NumbaCpuBackend``. Importing this package does not import numba; the
kernel is compiled on first use (and cached on disk).
"""

from kvpage_numba_cpu.backend import NumbaCpuBackend

__all__ = ["NumbaCpuBackend"]
