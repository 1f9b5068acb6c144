"""kvpage.stats.summarize: the one percentile helper (linear interpolation, NaN when
empty, caller's units times ``scale``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvpage.stats import SUMMARY_KEYS, summarize


def test_empty_is_nan_everywhere() -> None:
    s = summarize([])
    assert tuple(s) == SUMMARY_KEYS and all(math.isnan(v) for v in s.values())


def test_linear_interpolation_and_scale() -> None:
    assert summarize([1.0, 2.0])["p50"] == 1.5
    s = summarize([0.001 * i for i in range(1, 101)], scale=1000.0)
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert s["min"] == pytest.approx(1.0) and s["max"] == pytest.approx(100.0)
    assert s["mean"] == pytest.approx(50.5)


def test_integer_arrays() -> None:
    s = summarize(np.arange(1, 6, dtype=np.int64))
    assert s == {
        "p50": 3.0,
        "p90": pytest.approx(4.6),
        "p95": 4.8,
        "p99": pytest.approx(4.96),
        "mean": 3.0,
        "min": 1.0,
        "max": 5.0,
    }
