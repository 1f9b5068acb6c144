"""Trace replay and capacity planning without model weights.

``kvpage.workload.traces`` loads real serving traces (Azure 2023, Mooncake FAST'25) and maps
them to token ids; the simulator replays them through the real KVCacheManager.
"""

# the same names as kvpage.workload (one list: this package re-exports it)
from kvpage.workload import *  # noqa: F403
from kvpage.workload import __all__ as __all__
