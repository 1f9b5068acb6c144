"""kvpage plugin backend ``native-cpu``: paged attention on the CPU as one C kernel,
compiled at first use by the system C compiler and called through ``ctypes``, that
reads K/V in place through the block table.

Registered through the ``kvpage.backends`` entry point ``native-cpu =
kvpage_native_cpu:NativeCpuBackend``. Importing this package compiles nothing; the
kernel is built on first use and cached on disk (``build.py``).
"""

from kvpage_native_cpu.backend import NativeCpuBackend

__all__ = ["NativeCpuBackend"]
