"""Serving figures with Locust (a maintained load-testing tool from PyPI): requests/s,
TTFT and inter-token latency percentiles at several concurrencies.

Starts ``kvpage serve`` as a subprocess on 127.0.0.1 (``OMP_NUM_THREADS`` from the
environment, default 1), waits for ``/health``, then for each concurrency runs
``locust --headless`` with ``benches/locust/locustfile.py`` (an SSE streaming user, no
think time) for ``--seconds`` and reads Locust's CSV statistics. Every request asks for
``--max-tokens`` tokens with ``ignore_eos``, so output tokens/s = requests/s x max_tokens.

Locust runs from its own environment (``--locust``, default ``locust`` on PATH): install
it with ``pip install locust==2.47.0`` (the ``bench`` extra pins it), ideally in a
separate virtualenv since it brings gevent, flask and their pins.

Usage: ``.venv/bin/python benches/bench_locust.py --locust /path/to/locust
[--users 1,4,16] [--seconds 20] [--max-tokens 64] [--out out/bench_locust.json]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_health(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server at {url} not healthy after {timeout_s}s")


def _row(rows: list[dict[str, str]], name: str) -> dict[str, str]:
    for r in rows:
        if r["Name"] == name:
            return r
    return {}


def run_one(locust: str, url: str, users: int, seconds: int, prefix: Path, env: dict) -> dict:
    """One headless Locust run; returns the parsed figures."""
    cmd = [
        locust,
        "-f",
        str(HERE / "locust" / "locustfile.py"),
        "--host",
        url,
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{seconds}s",
        "--csv",
        str(prefix),
        "--only-summary",
        "--stop-timeout",
        "30",
    ]
    subprocess.run(cmd, env=env, check=False, capture_output=True, timeout=seconds + 120)
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    req, e2e, ttft, itl = (
        _row(rows, n) for n in ("completions SSE", "SSE E2E", "SSE TTFT", "SSE ITL")
    )

    def pct(r: dict[str, str], p: str) -> float | None:
        v = r.get(p)
        return None if v in (None, "", "N/A") else float(v)

    return {
        "users": users,
        "requests": int(req.get("Request Count", 0) or 0),
        "failures": int(req.get("Failure Count", 0) or 0),
        "requests_per_s": float(req.get("Requests/s", 0) or 0),
        "e2e_ms": {p: pct(e2e, p) for p in ("50%", "90%", "99%")},
        "ttft_ms": {p: pct(ttft, p) for p in ("50%", "90%", "99%")},
        "itl_ms": {p: pct(itl, p) for p in ("50%", "90%", "99%")},
        "itl_samples": int(itl.get("Request Count", 0) or 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--locust", default="locust", help="the locust executable")
    ap.add_argument("--users", default="1,4,16", help="concurrencies (comma separated)")
    ap.add_argument("--seconds", type=int, default=20, help="run time per concurrency")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="out/bench_locust.json")
    args = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvpage", "serve", "stories260K", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    try:
        _wait_health(url)
        lenv = dict(env, KVPAGE_MAX_TOKENS=str(args.max_tokens))
        for u in (int(x) for x in args.users.split(",")):
            r = run_one(args.locust, url, u, args.seconds, out.parent / f"locust_u{u}", lenv)
            r["output_tokens_per_s"] = r["requests_per_s"] * args.max_tokens
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    locust_version = subprocess.run(
        [args.locust, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "locust": locust_version,
        "omp_num_threads": env["OMP_NUM_THREADS"],
        "seconds_per_run": args.seconds,
        "max_tokens": args.max_tokens,
        "results": results,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
