"""Trace replay and capacity planning without model weights.

``kvpage.workload.traces`` loads real serving traces (Azure 2023, Mooncake FAST'25) and maps
them to token ids; the simulator replays them through the real KVCacheManager.
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
