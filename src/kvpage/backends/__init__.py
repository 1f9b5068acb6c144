"""Attention backends: the registry, runtime selection and the built-in torch backend.

Plugins (``kvpage_triton``, ``kvpage_cupy``, ``kvpage_numba``) register under the
entry-point group ``kvpage.backends`` and are imported only when asked for.
"""

from kvpage.backends.registry import (
    BUILTIN_BACKENDS,
    ENTRY_POINT_GROUP,
    auto_order,
    available_backends,
    backend_reasons,
    get_backend,
    select_backend,
)

__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "auto_order",
    "available_backends",
    "backend_reasons",
    "get_backend",
    "select_backend",
]
