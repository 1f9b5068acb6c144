"""Event-loop stall tracing for the server benchmarks (``bench_server_load.py
--trace-stalls FILE``).

Two probes, both in the server process:

* a tick on the event loop every ``tick_s``; each tick re-arms
  ``faulthandler.dump_traceback_later(threshold_s)``, so whenever the loop misses its
  tick by ``threshold_s`` the stacks of every thread are written to the file *during*
  the stall (faulthandler's watchdog is a C thread: it needs no GIL and no event loop);
  the lag of every late tick is recorded;
* ``gc.callbacks``: the duration of every garbage collection by generation.

:meth:`StallTracer.summary` reports the collections over 5 ms, the full (generation 2)
ones, and the loop lags.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import time
from typing import IO, Any


class StallTracer:
    """Install with :meth:`start` (any thread), read with :meth:`summary`, then :meth:`stop`.

    Args:
        out: where the stack dumps go (a text file opened by the caller).
        threshold_s: a stall this long dumps the stacks.
        tick_s: the loop's tick.
    """

    def __init__(self, out: IO[str], threshold_s: float = 0.04, tick_s: float = 0.01) -> None:
        self.out = out
        self.threshold_s = threshold_s
        self.tick_s = tick_s
        self.lags_ms: list[float] = []
        self.lag_times_s: list[float] = []  # when each of them ended, since start
        self.gc_ms: list[tuple[int, float]] = []  # (generation, ms) of collections > 5 ms
        self.num_ticks = 0
        self._gc_t0 = 0.0
        self._running = False

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._gc_t0) * 1000
            if ms > 5:
                self.gc_ms.append((int(info["generation"]), round(ms, 1)))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start tracing ``loop`` (scheduled on it) and the collections of this process."""
        self._running = True
        gc.callbacks.append(self._gc)
        last = [time.perf_counter()]
        t0 = last[0]

        def tick() -> None:
            if not self._running:
                return
            now = time.perf_counter()
            lag = now - last[0] - self.tick_s
            if lag > 0.02:
                self.lags_ms.append(round(lag * 1000, 1))
                self.lag_times_s.append(round(now - t0, 2))
            last[0] = now
            self.num_ticks += 1
            faulthandler.dump_traceback_later(self.threshold_s, repeat=False, file=self.out)
            loop.call_later(self.tick_s, tick)

        loop.call_soon_threadsafe(tick)

    def stop(self) -> None:
        """Stop the tick, the watchdog and the GC callback."""
        self._running = False
        faulthandler.cancel_dump_traceback_later()
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def summary(self) -> dict[str, Any]:
        """Collections over 5 ms (count, max, full ones), loop lags over 20 ms (count,
        the 5 largest with when they ended, in seconds since start), ticks."""
        full = [ms for g, ms in self.gc_ms if g == 2]
        top = sorted(zip(self.lags_ms, self.lag_times_s), reverse=True)[:5]
        return {
            "ticks": self.num_ticks,
            "gc_over_5ms": len(self.gc_ms),
            "gc_max_ms": max((ms for _, ms in self.gc_ms), default=0.0),
            "gc_full_ms": full,
            "loop_lags_over_20ms": len(self.lags_ms),
            "loop_lag_top5_ms": [ms for ms, _ in top],
            "loop_lag_top5_at_s": [t for _, t in top],
        }
