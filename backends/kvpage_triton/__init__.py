"""kvpage Triton backend plugin (entry point ``triton = kvpage_triton:TritonBackend``).

Importing this package does not import triton; kernels load on first use.
"""

from __future__ import annotations

from kvpage_triton.backend import TritonBackend

__all__ = ["TritonBackend"]
