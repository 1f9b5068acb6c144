"""A new request's wait under a provoked overload on a small pool: degradation off, on
capping only new requests (the behaviour before issue 29), and on capping admitted work
too (``ServingState.cap_admitted``), in alternating rounds.

Each round starts a fresh real server (uvicorn, stories260K, a 48-block pool of 16
tokens, 768 tokens in all) and sends ``--load`` streams of 300 tokens each
(``ignore_eos``; ~12x the pool), then, ``--probe-after`` seconds later, one probe
request of 4 tokens; it records the probe's wait (time to its first streamed token),
its total time, the load's allocation-failure rate and the degradation transitions.

    python benches/bench_degradation.py --rounds 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time
from typing import Any

import httpx

MODES = ("off", "cap_new_only", "cap_admitted")


def _config(mode: str) -> Any:
    from kvpage.server.config import ServerConfig

    deg: dict[str, Any] = {"enabled": mode != "off", "max_tokens_cap": 16}
    deg.update(eval_interval_s=0.1, window_s=2.0, enter_alloc_failures_per_s=20.0)
    return ServerConfig.model_validate(
        {
            "log_level": "error",
            "engine": {"num_blocks": 48, "block_size": 16, "max_num_seqs": 16},
            "degradation": deg,
        }
    )


def _stream(url: str, body: dict[str, Any]) -> tuple[float, float, int]:
    t0 = time.monotonic()
    first = None
    n = 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    n += 1
                    if first is None:
                        first = time.monotonic() - t0
    return (first if first is not None else float("nan")), time.monotonic() - t0, n


def one_round(mode: str, load: int, probe_after: float) -> dict[str, float]:
    from kvpage.server.app import create_app
    from kvpage.server.runner import BackgroundServer

    app = create_app(_config(mode))
    state = app.state.serving
    if mode == "cap_new_only":

        async def no_cap(cap: int) -> dict[str, int]:
            state._capping = None
            return {}

        state.cap_admitted = no_cap  # type: ignore[method-assign]
    srv = BackgroundServer(app).start()
    url = srv.base_url + "/v1/completions"
    body = {"model": "stories260K", "temperature": 0, "ignore_eos": True}
    try:
        snap0 = dict(state.loop.metrics_snapshot)
        with concurrent.futures.ThreadPoolExecutor(load + 1) as pool:
            t0 = time.monotonic()
            loads = [
                pool.submit(_stream, url, {**body, "prompt": f"Story {i}: once", "max_tokens": 300})
                for i in range(load)
            ]
            time.sleep(probe_after)
            wait, total, _ = _stream(url, {**body, "prompt": "The dog", "max_tokens": 4})
            out = [f.result() for f in loads]
            elapsed = time.monotonic() - t0
        snap = state.loop.metrics_snapshot
        fails = snap.get("kvpage:block_allocation_failures_total", 0.0) - snap0.get(
            "kvpage:block_allocation_failures_total", 0.0
        )
        return {
            "probe_wait_s": wait,
            "probe_total_s": total,
            "load_tokens": float(sum(n for _, _, n in out)),
            "alloc_failures_per_s": fails / elapsed,
            "transitions": float(state.degradation.transitions),
            "round_s": elapsed,
        }
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", type=int, default=12)
    ap.add_argument("--probe-after", type=float, default=1.0)
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for i in range(args.rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:  # alternating order
            r = one_round(mode, args.load, args.probe_after)
            rows[mode].append(r)
            print(mode, {k: round(v, 3) for k, v in r.items()}, flush=True)
    print("\nmedians over", args.rounds, "rounds")
    for mode, rs in rows.items():
        med = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
        print(f"{mode:14s}", med)


if __name__ == "__main__":
    main()
