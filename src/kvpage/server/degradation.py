"""Graceful degradation controller with hysteresis.

Signals (over a sliding window of ``window_s`` seconds):

* block allocation failures per second: the increase of the engine counter
  ``kvpage:block_allocation_failures_total`` inside the window divided by ``window_s``;
* p99 TTFT of the requests whose first token arrived inside the window
  (:func:`kvpage.stats.summarize`'s percentile; 0.0 without samples).

State machine: ``normal -> degraded`` when the failure rate >=
``enter_alloc_failures_per_s`` or p99 TTFT >= ``enter_p99_ttft_s``; ``degraded ->
normal`` only when the rate <= ``exit_alloc_failures_per_s`` and p99 TTFT <= ``exit_p99_ttft_s`` (or no TTFT samples) and at
least ``min_dwell_s`` passed since the last change. Exit thresholds lower than the enter
thresholds plus the dwell time are the hysteresis. Every change is logged and reported to
an ``on_change`` callback (the server turns it into metrics).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvpage.server.config import DegradationConfig
from kvpage.stats import summarize

__all__ = ["DegradationController", "DegradationSignals", "p99"]

logger = logging.getLogger("kvpage.server.degradation")


def p99(values: list[float]) -> float:
    """The 99th percentile of ``values`` by :func:`kvpage.stats.summarize` (linear
    interpolation), except that no samples mean no pressure: 0.0, not NaN."""
    return summarize(values)["p99"] if values else 0.0


@dataclass(frozen=True)
class DegradationSignals:
    """What the controller saw at its last evaluation."""

    #: block allocation failures per second over the window
    alloc_failures: float
    p99_ttft_s: float
    num_ttft_samples: int


class DegradationController:
    """Decides whether the server runs degraded.

    Args:
        config: thresholds and actions.
        now: current monotonic time in seconds (the controller never reads a clock).
        on_change: called as ``on_change(degraded, reason)`` after every state change.

    Attributes:
        degraded: current state.
        transitions: number of state changes so far.
        last_signals: the signals of the last :meth:`evaluate`.
    """

    def __init__(
        self,
        config: DegradationConfig,
        now: float,
        on_change: Callable[[bool, str], None] | None = None,
    ) -> None:
        self.config = config
        self.degraded = False
        self.transitions = 0
        self._since = now
        self._failures: deque[tuple[float, float]] = deque()  # (time, counter value)
        self._ttfts: deque[tuple[float, float]] = deque()  # (time, ttft seconds)
        self._on_change = on_change
        self.last_signals = DegradationSignals(0.0, 0.0, 0)

    def record_ttft(self, ttft_s: float, now: float) -> None:
        """Record one request's TTFT (seconds) observed at ``now``."""
        self._ttfts.append((now, ttft_s))

    def record_alloc_failures_total(self, total: float, now: float) -> None:
        """Record the engine's cumulative allocation failure counter at ``now``."""
        self._failures.append((now, total))

    def _trim(self, now: float) -> None:
        horizon = now - self.config.window_s
        while self._ttfts and self._ttfts[0][0] < horizon:
            self._ttfts.popleft()
        # Keep one sample at or before the horizon as the baseline of the window.
        while len(self._failures) >= 2 and self._failures[1][0] <= horizon:
            self._failures.popleft()

    def signals(self, now: float) -> DegradationSignals:
        """Compute the windowed signals at ``now`` (drops samples older than the window)."""
        self._trim(now)
        fails = self._failures[-1][1] - self._failures[0][1] if len(self._failures) >= 2 else 0.0
        ttfts = [t for _, t in self._ttfts]
        rate = max(0.0, fails) / self.config.window_s
        return DegradationSignals(rate, p99(ttfts), len(ttfts))

    def evaluate(self, now: float) -> bool:
        """Update the state from the signals at ``now``; return whether it changed."""
        cfg = self.config
        sig = self.last_signals = self.signals(now)
        if not cfg.enabled:
            return False
        if not self.degraded:
            reasons = []
            if sig.alloc_failures >= cfg.enter_alloc_failures_per_s:
                reasons.append(
                    f"block allocation failures {sig.alloc_failures:g}/s >= "
                    f"{cfg.enter_alloc_failures_per_s:g}/s over {cfg.window_s:g}s"
                )
            if sig.num_ttft_samples and sig.p99_ttft_s >= cfg.enter_p99_ttft_s:
                reasons.append(f"p99 TTFT {sig.p99_ttft_s:.3f}s >= {cfg.enter_p99_ttft_s:g}s")
            if reasons:
                self._set(True, "; ".join(reasons), now)
                return True
            return False
        calm = sig.alloc_failures <= cfg.exit_alloc_failures_per_s and (
            sig.num_ttft_samples == 0 or sig.p99_ttft_s <= cfg.exit_p99_ttft_s
        )
        if calm and now - self._since >= cfg.min_dwell_s:
            self._set(
                False,
                f"block allocation failures {sig.alloc_failures:g}/s <= "
                f"{cfg.exit_alloc_failures_per_s:g}/s, "
                f"p99 TTFT {sig.p99_ttft_s:.3f}s <= {cfg.exit_p99_ttft_s:g}s "
                f"for {now - self._since:.1f}s",
                now,
            )
            return True
        return False

    def _set(self, degraded: bool, reason: str, now: float) -> None:
        self.degraded = degraded
        self._since = now
        self.transitions += 1
        cfg = self.config
        if degraded:
            logger.warning(
                "degradation: entering degraded mode (%s); max_tokens cap %s, "
                "long-context requests limited to %d at a time",
                reason,
                "off" if cfg.max_tokens_cap is None else cfg.max_tokens_cap,
                cfg.long_context_concurrency,
            )
        else:
            logger.warning("degradation: back to normal mode (%s)", reason)
        if self._on_change is not None:
            self._on_change(degraded, reason)

    def cap_max_tokens(self, max_tokens: int) -> int:
        """``max_tokens`` for a new request under the current state (unchanged unless
        degraded with ``max_tokens_cap`` set)."""
        cap = self.config.max_tokens_cap
        if self.degraded and cap is not None:
            return min(max_tokens, cap)
        return max_tokens
