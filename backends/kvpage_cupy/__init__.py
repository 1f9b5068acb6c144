"""kvpage plugin backend ``cupy``: paged attention as raw CUDA C kernels
(``kernels/*.cu``) compiled by NVRTC through ``cupy.RawModule``.

Registered through the ``kvpage.backends`` entry point ``cupy =
kvpage_cupy:CupyBackend``. Importing this package does not import cupy; kernels are
compiled on first use, per template instance. Runs on CUDA GPUs of compute capability
8.0 or newer; on a machine without one it reports why in ``unsupported_reasons``.
"""

from kvpage_cupy.backend import CupyBackend

__all__ = ["CupyBackend"]
