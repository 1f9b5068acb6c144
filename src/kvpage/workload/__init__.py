"""Request workloads: serving traces and synthetic workloads, below engine and sim.

:mod:`kvpage.workload.traces` loads real serving traces (Azure 2023, Mooncake FAST'25)
and maps them to token ids; :mod:`kvpage.workload.workloads` builds named synthetic
workloads; :mod:`kvpage.workload.workload_stats` summarises lengths for capacity
planning. Imports only ``kvpage.errors``, ``kvpage.specs`` and ``kvpage.stats``.
"""

from kvpage.workload.traces import (
    BUNDLED_TRACES,
    TokenMapper,
    Trace,
    TraceError,
    TraceRequest,
    bundled_trace_path,
    load_trace,
)

__all__ = [
    "BUNDLED_TRACES",
    "TokenMapper",
    "Trace",
    "TraceError",
    "TraceRequest",
    "bundled_trace_path",
    "load_trace",
]
