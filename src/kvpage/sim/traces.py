"""Moved to :mod:`kvpage.workload.traces` (trace loading and workload mapping sit below
both the engine and the simulator). This alias keeps ``kvpage.sim.traces`` imports
working and warns once; it will be removed in a later release."""

import warnings

from kvpage.workload.traces import *  # noqa: F403
from kvpage.workload.traces import __all__  # noqa: F401

warnings.warn(
    "kvpage.sim.traces moved to kvpage.workload.traces",
    DeprecationWarning,
    stacklevel=2,
)
