"""Moved to :mod:`kvpage.workload.workloads` (trace loading and workload mapping sit below
both the engine and the simulator). This alias keeps ``kvpage.sim.workloads`` imports
working and warns once; it will be removed in a later release."""

import warnings

from kvpage.workload.workloads import *  # noqa: F403
from kvpage.workload.workloads import __all__  # noqa: F401

warnings.warn(
    "kvpage.sim.workloads moved to kvpage.workload.workloads",
    DeprecationWarning,
    stacklevel=2,
)
