"""kvpage plugin backend ``numba``: paged attention as ``@numba.cuda.jit`` kernels.

Registered through the ``kvpage.backends`` entry point ``numba =
kvpage_numba:NumbaBackend``. Importing this package does not import numba; the kernels
are compiled on first use. Runs on CUDA GPUs, and on CPU under ``NUMBA_ENABLE_CUDASIM=1``.
"""

from kvpage_numba.backend import NumbaBackend

__all__ = ["NumbaBackend"]
