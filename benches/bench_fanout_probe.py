"""/health latency while one tenant sends a huge multi-prompt body (a script, not a test).

Issue 23: one 80 KB ``/v1/completions`` body of 10,000 prompts held ``/health`` for
seconds. This starts a real uvicorn server (stories260K, CPU, no rate limit: the
default) in this process and, in a child process, probes ``GET /health`` every 50 ms
(timestamps in wall time, so each phase's window is cut from one probe run). Phases:

* ``idle``: nothing else runs (the floor of this machine).
* ``refused``: the 10,000-prompt body, sent ``--refused-rounds`` times back to back
  (default caps: 400 ``too_many_prompts``).
* ``allowed``: the largest body the defaults allow, 256 prompts x ``n: 4`` = 1,024
  sequences (``max_tokens`` 16, ``ignore_eos``), and meanwhile another tenant's 8-token
  request (its latency is reported: starvation).
* ``lifted`` (with ``--lifted``): a second server in the same process with the caps
  lifted (``max_prompts_per_request`` = ``max_sequences_per_request`` = 10,000, no
  per-tenant sequence cap) serving the 10,000-prompt body with ``max_tokens`` 1: what
  the cap avoids (the work now runs off the loop, but the engine still serves 10,000
  sequences ahead of the other tenant).

``--engine-process`` runs the engine in its own process (``engine_process: true``), so
its scheduling does not hold the server's GIL.

Prints a JSON summary; ``--out`` writes it too.

    .venv/bin/python benches/bench_fanout_probe.py --lifted
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import httpx
import numpy as np

from kvpage.server.app import create_app
from kvpage.server.config import ServerConfig
from kvpage.server.runner import BackgroundServer, prepare_serving_process

MODEL = "stories260K"


def probe(base_url: str, stop: Any, out: Any, every_s: float = 0.05) -> None:
    """Child process: ``(wall start, latency s or None)`` of GET /health until ``stop``."""
    got: list[tuple[float, float | None]] = []
    with httpx.Client(base_url=base_url, timeout=15) as c:
        while not stop.is_set():
            w, t0 = time.time(), time.perf_counter()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            got.append((w, time.perf_counter() - t0 if ok else None))
            time.sleep(every_s)
    out.put(got)


def stats(samples: list[tuple[float, float | None]], t0: float, t1: float) -> dict[str, Any]:
    """Percentiles (ms) of the probes started in ``[t0, t1]``; failures counted."""
    win = [lat for w, lat in samples if t0 <= w <= t1]
    ok = [lat * 1e3 for lat in win if lat is not None]
    out: dict[str, Any] = {"probes": len(win), "failed": len(win) - len(ok)}
    if ok:
        out |= {f"p{q}_ms": round(float(np.percentile(ok, q)), 1) for q in (50, 99)} | {
            "max_ms": round(max(ok), 1)
        }
    return out


def post(base: str, body: dict[str, Any], user: str) -> tuple[int, float, str]:
    t = time.perf_counter()
    r = httpx.post(
        base + "/v1/completions", json={"model": MODEL, "user": user, **body}, timeout=600
    )
    code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
    return r.status_code, time.perf_counter() - t, code


def server(admission: dict[str, Any], engine_process: bool = False) -> BackgroundServer:
    cfg = ServerConfig.model_validate(
        {
            "log_level": "warning",
            "engine_process": engine_process,
            "engine": {"num_blocks": 1025, "block_size": 16, "max_num_seqs": 256},
            "admission": admission,
        }
    )
    app = create_app(cfg)
    prepare_serving_process(app)
    return BackgroundServer(app).start()


def phase_allowed(base: str, prompts: list[str], n: int, max_tokens: int) -> dict[str, Any]:
    """The big body in a thread; the other tenant's small request once it is in."""
    big: dict[str, Any] = {}

    def run() -> None:
        body = {"prompt": prompts, "n": n, "max_tokens": max_tokens, "ignore_eos": True}
        big["status"], big["s"], big["code"] = post(base, body, "big")

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)  # let the big body reach the engine
    small = post(base, {"prompt": "Once upon a time", "max_tokens": 8}, "other")
    t.join()
    return {
        "big_status": big["status"],
        "big_code": big["code"],
        "big_s": round(big["s"], 2),
        "other_status": small[0],
        "other_s": round(small[1], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refused-rounds", type=int, default=20)
    ap.add_argument("--lifted", action="store_true", help="also run the caps-lifted server")
    ap.add_argument("--engine-process", action="store_true", help="the engine in its own process")
    ap.add_argument("--out")
    args = ap.parse_args()
    huge = [f"p{i} hi" for i in range(10_000)]  # ~80 KB of JSON
    summary: dict[str, Any] = {
        "load_before": round(os.getloadavg()[0], 2),
        "engine_process": args.engine_process,
    }
    ctx = mp.get_context("spawn")
    runs = [("default", {})]
    if args.lifted:
        lifted = {
            "max_prompts_per_request": 10_000,
            "max_sequences_per_request": 10_000,
            "max_inflight_sequences_per_tenant": None,
        }
        runs.append(("lifted", lifted))
    for name, admission in runs:
        srv = server(admission, args.engine_process)
        stop, q = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=probe, args=(srv.base_url, stop, q))
        p.start()
        time.sleep(3.0)  # the child imports httpx, then probes
        res: dict[str, Any] = {}
        marks: dict[str, tuple[float, float]] = {}
        t0 = time.time()
        time.sleep(3.0)
        marks["idle"] = (t0, time.time())
        if name == "default":
            t0 = time.time()
            codes = [
                post(srv.base_url, {"prompt": huge, "max_tokens": 1}, "big")
                for _ in range(args.refused_rounds)
            ]
            marks["refused"] = (t0, time.time())
            res["refused"] = {
                "status": sorted({c[0] for c in codes}),
                "code": sorted({c[2] for c in codes}),
                "mean_s": round(sum(c[1] for c in codes) / len(codes), 3),
            }
            t0 = time.time()
            res["allowed"] = phase_allowed(srv.base_url, huge[:256], 4, 16)
            marks["allowed"] = (t0, time.time())
        else:
            t0 = time.time()
            res["lifted"] = phase_allowed(srv.base_url, huge, 1, 1)
            marks["lifted"] = (t0, time.time())
        stop.set()
        samples = q.get(timeout=120)
        p.join(30)
        for k, (a, b) in marks.items():
            res.setdefault(k, {})["health"] = stats(samples, a, b)
        srv.stop()
        summary[name] = res
    summary["load_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
