"""CPU benchmark of the numba backend under the CUDA simulator: a small prefill with the
GIL switch interval the backend sets for simulated launches (0.05 ms) against Python's
default (5 ms), in the same process. Run with NUMBA_ENABLE_CUDASIM=1:

    NUMBA_ENABLE_CUDASIM=1 python benches/gpu/bench_simulator.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from kvpage_numba import NumbaBackend, simulator

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.specs import make_attention_spec


def _prefill_seconds(reps: int) -> float:
    be = NumbaBackend(threads=4)
    spec = make_attention_spec(num_q_heads=4, num_kv_heads=2, head_dim=16)
    cache = allocate_kv_cache(12, 4, 2, 16, dtype=torch.float32)
    meta = be.plan(AttentionMetadata.build([3, 10], [7, 10], [[5, 2], [9, 1, 7]], 4))
    q = torch.randn(meta.num_tokens, 4, 16)
    be.forward(q, cache, be.plan(meta), spec)  # compile / warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        be.forward(q, cache, be.plan(meta), spec)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    fast = _prefill_seconds(5)
    original = simulator.SimLaunch.__call__

    def default_interval(self, *args):  # type: ignore[no-untyped-def]
        self.configured(*args)

    simulator.SimLaunch.__call__ = default_interval  # type: ignore[method-assign]
    try:
        slow = _prefill_seconds(5)
    finally:
        simulator.SimLaunch.__call__ = original  # type: ignore[method-assign]
    print(f"switch interval default {sys.getswitchinterval() * 1e3:.1f} ms: {slow:.3f} s")
    print(f"switch interval 0.05 ms (backend): {fast:.3f} s; speed-up {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
