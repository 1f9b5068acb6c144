"""The one summary of a latency or length distribution used in kvpage's reports.

:func:`summarize` gives ``p50``, ``p90``, ``p95``, ``p99``, ``mean``, ``min`` and ``max``
(p90 is the TTFT percentile the llm-d and routing comparisons quote):

* percentiles by linear interpolation between order statistics (numpy's default
  ``method="linear"``, Hyndman & Fan 1996 type 7), so p50 of ``[1, 2]`` is 1.5;
* units: those of the values times ``scale`` (e.g. ``scale=1000`` turns seconds into
  milliseconds); the caller names the unit in the key it stores the dict under
  (``ttft_ms``, ``tpot_s``, ``prompt_tokens``);
* no values: every entry is NaN (an empty distribution has no percentiles; 0 would
  read as a measured zero). JSON writers emit NaN as ``NaN``.

The server's overload controller takes its sliding-window p99 from here too
(``kvpage.server.degradation.p99``), mapping "no samples" to 0.0 ("no pressure").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

#: the keys of :func:`summarize`, in order
SUMMARY_KEYS = ("p50", "p90", "p95", "p99", "mean", "min", "max")


def summarize(
    values: Sequence[float] | npt.NDArray[np.floating] | npt.NDArray[np.integer],
    *,
    scale: float = 1.0,
) -> dict[str, float]:
    """Percentiles, mean and range of ``values`` (see the module docstring).

    Args:
        values: the samples (any real numbers).
        scale: multiplies every value first (unit conversion).

    Returns:
        ``{"p50", "p90", "p95", "p99", "mean", "min", "max"}`` as floats; all NaN when empty.
    """
    a = np.asarray(values, dtype=np.float64) * scale
    if a.size == 0:
        return dict.fromkeys(SUMMARY_KEYS, float("nan"))
    p50, p90, p95, p99 = np.percentile(a, [50, 90, 95, 99])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
    }


__all__ = ["SUMMARY_KEYS", "summarize"]
