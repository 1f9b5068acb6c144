"""Does a GIL-bound thread beside an HTTP server slow its ``/health``? (a script)

Four trivial uvicorn apps (one ``GET /health`` route), each in its own process and
probed every 50 ms by its own probe process (``bench_server_load.health_probe``), run
at the same time, so they see the same machine load:

* ``alone``: the app only (the machine's scheduling floor);
* ``thread``: the app plus a pure-Python CPU-bound thread in its process (it holds the
  GIL whenever it runs), GIL switch interval 1 ms and 5 ms (Python's default);
* ``process``: the app plus the same CPU-bound loop in a separate process.

Prints one line per setup: (setup, switch interval s, probes answered, probes failed,
latency percentiles in
seconds, max). It stands for the question behind ``--engine-process``: what the engine
thread's GIL costs the event loop, apart from the cost of the CPU it uses.

    .venv/bin/python benches/bench_health_gil.py --seconds 25
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server_load import health_probe, pct  # noqa: E402


def _hog() -> None:
    x = 0
    while True:
        for i in range(1000):
            x += i * i


def _probe(base_url: str, stop: Any, out: Any, ready: Any) -> None:
    ready.set()  # imports done: the probing time starts now
    health_probe(base_url, stop, out)


def _serve(mode: str, switch_s: float, out: Any, seconds: float) -> None:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from kvpage.server.runner import BackgroundServer

    sys.setswitchinterval(switch_s)

    async def health(request: Any) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    hog = None
    if mode == "thread":
        threading.Thread(target=_hog, daemon=True).start()
    elif mode == "process":
        hog = mp.get_context("spawn").Process(target=_hog, daemon=True)
        hog.start()
    srv = BackgroundServer(Starlette(routes=[Route("/health", health)]), lifespan="off").start()
    ctx = mp.get_context("spawn")
    stop, q, ready = ctx.Event(), ctx.Queue(), ctx.Event()
    probe = ctx.Process(target=_probe, args=(srv.base_url, stop, q, ready))
    probe.start()
    ready.wait(600)
    time.sleep(seconds)
    stop.set()
    raw = q.get(timeout=60)
    lat = [x for x in raw if x is not None]
    probe.join(30)
    if hog is not None:
        hog.terminate()
    srv.stop()
    out.put(
        (
            mode,
            switch_s,
            len(lat),
            len(raw) - len(lat),
            pct(lat),
            round(max(lat), 4) if lat else None,
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=25.0, help="probing time per setup")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    setups = [("alone", 0.005), ("thread", 0.001), ("thread", 0.005), ("process", 0.005)]
    procs = [ctx.Process(target=_serve, args=(m, s, q, args.seconds)) for m, s in setups]
    for p in procs:
        p.start()
    for _ in procs:
        print(q.get(timeout=args.seconds + 300), flush=True)
    for p in procs:
        p.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
