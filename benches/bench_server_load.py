"""Bounded load test of ``kvpage serve`` (a script, not a default test).

Starts a real uvicorn server (stories260K, CPU) on a free loopback port in this process
and drives it with ``--clients`` concurrent asyncio httpx clients that share a queue of
``--requests`` requests. Request lengths come from the bundled Azure LLM conversation
trace (2023), scaled to the 512-token model and to a bounded run:

    prompt_tokens = clip(ContextTokens // 8, 1, 256)
    max_tokens    = clip(GeneratedTokens // 4, 1, min(128, 512 - prompt_tokens))

(random prompt token ids, seeded; ``ignore_eos`` so every completion has a known length;
the trace's arrival times are not replayed: the clients are closed-loop). A seeded mix:
``--cancel-frac`` of the requests are streamed and dropped after 1-3 chunks,
``--malformed-frac`` are malformed (bad JSON, unknown model, negative max_tokens, bad
types); half of the rest stream. Clients belong to 4 tenants (API keys).

With ``--auth`` the server requires API keys (4 tenants, one ``--api-key`` each, and an
operator key for /metrics) and the mix gains ``--hostile-frac`` of hostile requests in
equal parts: an oversized body (5 MB > the 4 MiB default limit: 413), a ``text/plain``
body (415) and a wrong API key (401). A separate process polls ``GET /health`` every
50 ms during the run (its own connection, outside this process's GIL) and reports the
latency percentiles; the run fails if /health p99 >= 100 ms or any probe fails. A
control probe polls a trivial uvicorn app in a fourth process at the same time: its
latency is what the machine's scheduling alone costs (on a shared, oversubscribed box
that floor can exceed 100 ms; compare the two). The
load clients then run in a child process too (as remote clients would), so the server
process holds only the server: its event loop, tokenizer pool and the engine thread
(the default) or, with ``--engine-process``, the pipe to the engine's own process
(``--engine-niceness``, default 10). Server CPU seconds count the server process
only.

With ``--client curl`` the load comes from one ``curl --parallel --parallel-max CLIENTS``
process instead (a non-Python client whose pool reuses connections: keep-alive), one
config-file entry per request; a request is lost when curl reports no HTTP status line
(``http_code`` 000 or a curl error). The summary's ``curl`` entry counts the new
connections curl opened and the transfers that reused one.

Checks (exit status 1 if any fails): every valid request completes (finish_reason
"length", 1 <= completion tokens <= max_tokens) or is refused with 429 + Retry-After;
every malformed request gets a 4xx; no request is lost (no other status, no transport
error); afterwards the engine holds no block and running = waiting = 0.

Prints a JSON summary (requests/s, completion tokens/s, TTFT and end-to-end latency
percentiles) and writes it to ``--out`` when given.

    .venv/bin/python benches/bench_server_load.py --requests 320 --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np

from kvpage.server.app import create_app
from kvpage.server.config import ServerConfig
from kvpage.server.runner import BackgroundServer, prepare_serving_process
from kvpage.workload.traces import bundled_trace_path, load_trace

MODEL = "stories260K"
MALFORMED: list[tuple[str, bytes]] = [
    ("bad_json", b'{"model": "stories260K", "prompt": "x",'),
    ("unknown_model", b'{"model": "gpt-9", "prompt": "hello"}'),
    ("negative_max_tokens", b'{"model": "stories260K", "prompt": "hi", "max_tokens": -5}'),
    ("bad_type", b'{"model": "stories260K", "prompt": "hi", "temperature": "warm"}'),
    ("empty_prompt", b'{"model": "stories260K", "prompt": []}'),
]


HOSTILE = ("oversized", "wrong_ctype", "bad_key")
#: expected status of each hostile kind
HOSTILE_STATUS = {"oversized": 413, "wrong_ctype": 415, "bad_key": 401}


def tenant_key(tenant: str) -> str:
    """The API key of a bench tenant when ``--auth`` is on."""
    return f"sk-bench-{tenant}-0123456789abcdef"


def build_workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The seeded list of request specs (kind: valid | cancel | malformed | hostile)."""
    trace = load_trace(bundled_trace_path("azure-conv"), limit=args.requests)
    rng = random.Random(args.seed)
    specs = []
    for i, tr in enumerate(trace.requests):
        p = int(np.clip(tr.prompt_tokens // 8, 1, 256))
        m = int(np.clip(tr.output_tokens // 4, 1, min(128, 512 - p)))
        u = rng.random()
        hostile = args.hostile_frac if args.auth else 0.0
        kind = (
            "malformed"
            if u < args.malformed_frac
            else "cancel"
            if u < args.malformed_frac + args.cancel_frac
            else HOSTILE[i % 3]
            if u < args.malformed_frac + args.cancel_frac + hostile
            else "valid"
        )
        specs.append(
            {
                "i": i,
                "kind": kind,
                "prompt": [rng.randrange(3, 512) for _ in range(p)],
                "max_tokens": m,
                "stream": kind == "cancel" or rng.random() < 0.5,
                "tenant": f"tenant-{i % 4}",
                "malformed": MALFORMED[i % len(MALFORMED)],
                "cancel_after": rng.randint(1, 3),
            }
        )
    return specs


async def run_one(c: httpx.AsyncClient, spec: dict[str, Any], auth: bool) -> dict[str, Any]:
    """Send one request; return what happened (status, tokens, timings, verdict)."""
    key = tenant_key(spec["tenant"]) if auth else spec["tenant"]
    headers = {"Authorization": f"Bearer {key}"}
    t0 = time.perf_counter()
    res: dict[str, Any] = {"i": spec["i"], "kind": spec["kind"]}
    try:
        if spec["kind"] in HOSTILE:
            kind = spec["kind"]
            good = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 1}).encode()
            if kind == "oversized":
                body = b'{"model": "stories260K", "prompt": "' + b"a" * 5_000_000 + b'"}'
                h = {**headers, "content-type": "application/json"}
            elif kind == "wrong_ctype":
                body, h = good, {**headers, "content-type": "text/plain"}
            else:
                body = good
                h = {"Authorization": "Bearer sk-wrong", "content-type": "application/json"}
            r = await c.post("/v1/completions", content=body, headers=h)
            res.update(status=r.status_code, ok=r.status_code == HOSTILE_STATUS[kind])
            return res
        if spec["kind"] == "malformed":
            name, body = spec["malformed"]
            r = await c.post(
                "/v1/completions",
                content=body,
                headers={**headers, "content-type": "application/json"},
            )
            res.update(status=r.status_code, ok=400 <= r.status_code < 500 and "error" in r.json())
            return res
        body = {
            "model": MODEL,
            "prompt": spec["prompt"],
            "max_tokens": spec["max_tokens"],
            "temperature": 0.8,
            "seed": spec["i"],
            "ignore_eos": True,
            "stream": spec["stream"],
        }
        if not spec["stream"]:
            r = await c.post("/v1/completions", json=body, headers=headers)
            res["status"] = r.status_code
            if r.status_code == 200:
                j = r.json()
                n = j["usage"]["completion_tokens"]
                res.update(tokens=n, e2e=time.perf_counter() - t0)
                res["ok"] = (
                    j["choices"][0]["finish_reason"] == "length" and 1 <= n <= spec["max_tokens"]
                )
            else:
                res["ok"] = r.status_code == 429 and "retry-after" in r.headers
            return res
        async with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            res["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                res["ok"] = r.status_code == 429 and "retry-after" in r.headers
                return res
            chunks, finish = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                chunks += 1
                if chunks == 1:
                    res["ttft"] = time.perf_counter() - t0
                finish = ch["choices"][0]["finish_reason"] or finish
                if spec["kind"] == "cancel" and chunks >= spec["cancel_after"]:
                    res.update(ok=True, cancelled=True)
                    return res  # leaving the block closes the connection mid-stream
            res["e2e"] = time.perf_counter() - t0
            res["ok"] = finish == "length" or spec["kind"] == "cancel"
            return res
    except httpx.HTTPError as exc:
        res.update(status=None, ok=False, error=repr(exc), after_s=time.perf_counter() - t0)
        return res


async def drive(
    base_url: str,
    specs: list[dict[str, Any]],
    clients: int,
    auth: bool = False,
    default_pool: bool = False,
) -> list[dict[str, Any]]:
    """``clients`` workers pull from one queue until it is empty (``default_pool``:
    httpx's default connection pool, 100 connections / 20 kept alive / 5 s expiry)."""
    q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for s in specs:
        q.put_nowait(s)
    results: list[dict[str, Any]] = []
    limits = (
        httpx.Limits()
        if default_pool
        else httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    )
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as c:

        async def worker() -> None:
            while True:
                try:
                    s = q.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await run_one(c, s, auth))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def _drive_process(
    base_url: str,
    specs: list[dict[str, Any]],
    clients: int,
    auth: bool,
    out: Any,
    default_pool: bool = False,
) -> None:
    """Child process: run :func:`drive` and put its results on ``out``."""
    out.put(asyncio.run(drive(base_url, specs, clients, auth, default_pool)))


def _curl_quote(s: str) -> str:
    """A value for a curl config file (double-quoted; backslash and quote escaped)."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _curl_judge(spec: dict[str, Any], status: int | None, retry_after: str, body: bytes) -> bool:
    """The verdict on one curl transfer, with the rules :func:`run_one` applies to httpx."""
    if status is None:
        return False
    if spec["kind"] in HOSTILE:
        return status == HOSTILE_STATUS[spec["kind"]]
    if spec["kind"] == "malformed":
        try:
            return 400 <= status < 500 and "error" in json.loads(body)
        except ValueError:
            return False
    if status != 200:
        return status == 429 and bool(retry_after)
    if not spec["stream"]:
        j = json.loads(body)
        n = j["usage"]["completion_tokens"]
        return bool(j["choices"][0]["finish_reason"] == "length" and 1 <= n <= spec["max_tokens"])
    finish, done = None, False
    for line in body.decode().splitlines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return done and finish == "length"


def drive_curl(
    base_url: str, specs: list[dict[str, Any]], clients: int, auth: bool, workdir: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Send ``specs`` with one ``curl --parallel --parallel-max clients`` process (a non-Python
    client; its connection pool reuses connections: HTTP/1.1 keep-alive). One config-file
    entry per request (its body from a file, its response into a file, a ``--write-out``
    line with its status, new connections, curl exit code and time). Lost = a transfer with
    no HTTP status line (``http_code`` 000 or a nonzero curl exit code). Returns the per-request
    results (as :func:`run_one`'s) and the connection statistics."""
    import shutil
    import subprocess

    curl = shutil.which("curl")
    if curl is None:
        raise SystemExit("--client curl: no curl on PATH")
    entries = []
    for s in specs:
        i = s["i"]
        key = tenant_key(s["tenant"]) if auth else s["tenant"]
        ctype = "application/json"
        if s["kind"] in HOSTILE:
            kind = s["kind"]
            body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 1}).encode()
            if kind == "oversized":
                body = b'{"model": "stories260K", "prompt": "' + b"a" * 5_000_000 + b'"}'
            elif kind == "wrong_ctype":
                ctype = "text/plain"
            else:
                key = "sk-wrong"
        elif s["kind"] == "malformed":
            body = s["malformed"][1]
        else:
            body = json.dumps(
                {
                    "model": MODEL,
                    "prompt": s["prompt"],
                    "max_tokens": s["max_tokens"],
                    "temperature": 0.8,
                    "seed": i,
                    "ignore_eos": True,
                    "stream": s["stream"],
                }
            ).encode()
        bpath = os.path.join(workdir, f"req{i}.json")
        with open(bpath, "wb") as f:
            f.write(body)
        entries.append(
            "\n".join(
                (
                    f"url = {_curl_quote(base_url + '/v1/completions')}",
                    f"header = {_curl_quote('Authorization: Bearer ' + key)}",
                    f"header = {_curl_quote('Content-Type: ' + ctype)}",
                    f"data-binary = {_curl_quote('@' + bpath)}",
                    f"output = {_curl_quote(os.path.join(workdir, f'resp{i}'))}",
                    "write-out = "
                    + _curl_quote(
                        f"R {i} %{{http_code}} %{{num_connects}} %{{exitcode}} "
                        "%{time_total} [%header{retry-after}]\\n"
                    ),
                    "no-buffer",
                )
            )
        )
    cfg_path = os.path.join(workdir, "curl.cfg")
    with open(cfg_path, "w") as f:
        f.write("\nnext\n".join(entries) + "\n")
    proc = subprocess.run(
        [curl, "--silent", "--parallel", "--parallel-max", str(clients), "--config", cfg_path],
        capture_output=True,
        timeout=3600,
    )
    lines: dict[int, list[str]] = {}
    for line in proc.stdout.decode().splitlines():
        parts = line.split(" ")
        if parts[0] == "R" and len(parts) >= 6:
            lines.setdefault(int(parts[1]), parts)
    dup_lines = sum(1 for line in proc.stdout.decode().splitlines() if line.startswith("R ")) - len(
        lines
    )
    results: list[dict[str, Any]] = []
    new_conns = 0
    for s in specs:
        res: dict[str, Any] = {"i": s["i"], "kind": s["kind"]}
        parts = lines.get(s["i"])
        if parts is None:
            res.update(status=None, ok=False, error="no write-out line")
            results.append(res)
            continue
        code, conns, exitcode, t = int(parts[2]), int(parts[3]), int(parts[4]), float(parts[5])
        new_conns += conns
        retry_after = " ".join(parts[6:]).strip("[]")
        status = code if code and exitcode == 0 else None
        rpath = os.path.join(workdir, f"resp{s['i']}")
        body = open(rpath, "rb").read() if os.path.exists(rpath) else b""  # noqa: SIM115
        res["status"] = status
        if status is None:
            res.update(ok=False, error=f"curl exit {exitcode}, http_code {code}", after_s=t)
        else:
            res["ok"] = _curl_judge(s, status, retry_after, body)
            if s["kind"] == "valid" and status == 200:
                res["e2e"] = t
                if not s["stream"]:
                    res["tokens"] = json.loads(body)["usage"]["completion_tokens"]
        results.append(res)
    stats = {
        "curl": subprocess.run([curl, "--version"], capture_output=True, check=True)
        .stdout.decode()
        .split("\n")[0],
        "curl_exit": proc.returncode,
        "transfers": len(specs),
        "new_connections": new_conns,
        "reused_connection_transfers": sum(
            1 for p in lines.values() if int(p[3]) == 0 and int(p[2]) != 0
        ),
        "duplicate_write_out_lines": dup_lines,
    }
    return results, stats


def _control_server(port_q: Any, stop: Any) -> None:
    """Child process: a trivial uvicorn app answering ``GET /health`` (the control: its
    probe latency is what this machine's scheduling alone costs)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request: Any) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    srv = BackgroundServer(Starlette(routes=[Route("/health", health)]), lifespan="off").start()
    port_q.put(srv.base_url)
    stop.wait()
    srv.stop()


def health_probe(
    base_url: str, stop: Any, out: Any, every_s: float = 0.05, ready: Any = None
) -> None:
    """Child process: GET /health every ``every_s`` until ``stop`` is set; put the list
    of latencies (seconds; None for a failed probe) on ``out``. Sets ``ready`` (an event)
    when the first probe has been sent."""
    lat: list[float | None] = []
    with httpx.Client(base_url=base_url, timeout=10) as c:
        while not stop.is_set():
            if ready is not None and lat:
                ready.set()
            t0 = time.perf_counter()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            lat.append(time.perf_counter() - t0 if ok else None)
            time.sleep(every_s)
    out.put(lat)


def pct(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Percentiles in seconds (numpy linear interpolation); empty -> {}."""
    if not values:
        return {}
    return {f"p{q}": round(float(np.percentile(values, q)), 4) for q in qs}


def offline_baseline(
    specs: list[dict[str, Any]], engine_kw: dict[str, Any], clients: int
) -> dict[str, float]:
    """The engine alone on the same valid requests: ``LLMEngine`` driven in this thread
    with the same closed-loop concurrency (at most ``clients`` requests in flight), no
    HTTP and no admission. Returns its generated tokens/s."""
    from kvpage.engine import LLMEngine, SamplingParams

    eng = LLMEngine.from_config(model=MODEL, **engine_kw)
    pending = [s for s in specs if s["kind"] == "valid"]
    pending.reverse()
    in_flight = tokens = done = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or eng.has_unfinished_requests():
        while pending and in_flight < clients:
            s = pending.pop()
            sp = SamplingParams(
                max_tokens=s["max_tokens"], temperature=0.8, seed=s["i"], ignore_eos=True
            )
            eng.add_request(f"b{s['i']}", s["prompt"], sp)
            in_flight += 1
        for out in eng.step():
            if out.finished:
                in_flight -= 1
                done += 1
                tokens += sum(len(o.token_ids) for o in out.outputs)
    wall = time.perf_counter() - t0
    return {
        "requests": done,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "cpu_s": round(time.process_time() - c0, 2),
        "tokens_per_s": round(tokens / wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--cancel-frac", type=float, default=0.1)
    ap.add_argument("--malformed-frac", type=float, default=0.05)
    ap.add_argument("--num-blocks", type=int, default=257, help="KV pool (incl. null block)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--torch-threads",
        "--threads",
        dest="torch_threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on an oversubscribed CPU, OpenMP spinning "
        "made a main-thread engine ~30x slower than one stepped from a worker thread)",
    )
    ap.add_argument("--out", help="write the JSON summary here")
    ap.add_argument(
        "--auth", action="store_true", help="API keys on, hostile requests, /health probe"
    )
    ap.add_argument("--hostile-frac", type=float, default=0.09, help="with --auth")
    ap.add_argument("--switch-interval-s", type=float, default=0.0, help="sys.setswitchinterval")
    ap.add_argument(
        "--engine-niceness", type=int, default=10, help="with --engine-process: its nice"
    )
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine in its own process (default: a thread of the server process)",
    )
    ap.add_argument(
        "--no-prepare",
        action="store_true",
        help="skip prepare_serving_process (kvpage serve's pre-imports, tokenizer pool start "
        "and gc.freeze of the start-up heap)",
    )
    ap.add_argument(
        "--trace-stalls",
        metavar="FILE",
        help="trace the server's event loop: stacks of every stall >= 40 ms go to FILE, and "
        "the summary gains 'loop_stalls' (collections, loop lags; benches/loop_stalls.py)",
    )
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the offline LLM.generate baseline on the same workload",
    )
    ap.add_argument(
        "--default-pool",
        action="store_true",
        help="the clients use httpx's default connection pool (20 kept alive, 5 s expiry)",
    )
    ap.add_argument(
        "--keep-alive-timeout-s", type=float, default=None, help="security.keep_alive_timeout_s"
    )
    ap.add_argument(
        "--stock-h11",
        action="store_true",
        help="serve with uvicorn's own h11 protocol instead of kvpage's IdleOnlyH11Protocol "
        "(the keep-alive timeout may then close a connection with a request in it)",
    )
    ap.add_argument(
        "--client",
        choices=("httpx", "curl"),
        default="httpx",
        help="the load client: httpx (asyncio, --clients workers) or curl (one "
        "`curl --parallel --parallel-max CLIENTS` process: a non-Python client with its own "
        "keep-alive pool; needs --cancel-frac 0, curl cannot drop a stream after N chunks)",
    )
    args = ap.parse_args(argv)
    if args.client == "curl" and args.cancel_frac:
        ap.error("--client curl cannot cancel streams after 1-3 chunks: pass --cancel-frac 0")

    import torch

    torch.set_num_threads(args.torch_threads)
    if args.switch_interval_s:
        sys.setswitchinterval(args.switch_interval_s)
    specs = build_workload(args)
    load_before = round(os.getloadavg()[0], 2)
    engine_kw = {"num_blocks": args.num_blocks, "block_size": 16, "max_num_seqs": 64}
    cfg = ServerConfig.model_validate(
        {
            "log_level": "warning",
            "engine_process": args.engine_process,
            "engine_niceness": args.engine_niceness,
            "engine": engine_kw,
            "admission": {
                "default_limit": {"rate": 2000.0, "burst": 20000.0},
                "kv_high_water": 0.9,
                "long_prompt_tokens": 128,
                "kv_pressure_action": "queue",
                "queue_timeout_s": 2.0,
            },
            "security": {
                "api_keys": [tenant_key(f"tenant-{k}") for k in range(4)] if args.auth else [],
                **(
                    {"keep_alive_timeout_s": args.keep_alive_timeout_s}
                    if args.keep_alive_timeout_s
                    else {}
                ),
            },
        }
    )
    app = create_app(cfg)
    if not args.no_prepare:
        prepare_serving_process(app)  # as kvpage serve does (runner.run_server)
    if args.stock_h11:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        from kvpage.server import runner

        stock = runner.uvicorn_limits

        def limits(security: Any) -> dict[str, Any]:
            return {**stock(security), "http": H11Protocol}

        runner.uvicorn_limits = limits  # type: ignore[assignment]
    srv = BackgroundServer(app).start()
    state = srv.app.state.serving
    tracer = None
    if args.trace_stalls:
        from loop_stalls import StallTracer

        tracer = StallTracer(open(args.trace_stalls, "w"))  # noqa: SIM115 (closed below)
        tracer.start(state.loop._loop)
    probe = None
    if args.auth:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        stop, out_q = ctx.Event(), ctx.Queue()
        probe_ready = ctx.Event()
        probe = ctx.Process(
            target=health_probe, args=(srv.base_url, stop, out_q, 0.05, probe_ready)
        )
        stop_ctl, ctl_url_q, ctl_q = ctx.Event(), ctx.Queue(), ctx.Queue()
        ctl_srv = ctx.Process(target=_control_server, args=(ctl_url_q, stop_ctl))
        ctl_srv.start()
        ctl_probe = ctx.Process(target=health_probe, args=(ctl_url_q.get(timeout=120), stop, ctl_q))
        probe.start()
        ctl_probe.start()
        probe_ready.wait(120)  # the probe covers the whole run
    health: list[float | None] = []
    control: list[float | None] = []
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        curl_stats = None
        if args.client == "curl":  # curl is its own process
            import tempfile

            with tempfile.TemporaryDirectory(prefix="kvpage-curl-") as wd:
                results, curl_stats = drive_curl(srv.base_url, specs, args.clients, args.auth, wd)
        elif args.auth:  # clients in their own process, like remote clients
            res_q = ctx.Queue()
            driver = ctx.Process(
                target=_drive_process,
                args=(srv.base_url, specs, args.clients, True, res_q, args.default_pool),
            )
            driver.start()
            results = res_q.get(timeout=3600)
            driver.join(30)
        else:
            results = asyncio.run(
                drive(srv.base_url, specs, args.clients, args.auth, args.default_pool)
            )
        wall = time.perf_counter() - t0
        if probe is not None:
            stop.set()
            health = out_q.get(timeout=60)
            control = ctl_q.get(timeout=60)
            probe.join(30)
            ctl_probe.join(30)
            stop_ctl.set()
            ctl_srv.join(30)
        cpu = time.process_time() - c0
        deadline = time.monotonic() + 30

        def busy() -> bool:
            m = state.loop.metrics_snapshot
            return bool(
                m.get("kvpage:num_requests_running") or m.get("kvpage:num_requests_waiting")
            )

        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = dict(state.loop.metrics_snapshot)
    finally:
        if tracer is not None:
            tracer.stop()
            tracer.out.close()
        srv.stop()
    report = getattr(state.loop, "final_report", None)
    if report is None:  # the engine thread ran here: inspect it directly
        from kvpage.server.engine_core import engine_report

        report = engine_report(state.engine)
    clean = {
        k: report[k] for k in ("free_blocks", "usable_blocks", "running", "waiting", "integrity")
    }
    clean["kv_reserved_blocks"] = state.kv_budget.reserved_blocks
    by = Counter((r["kind"], r.get("status")) for r in results)
    bad = [r for r in results if not r.get("ok")]
    done = [r for r in results if r["kind"] == "valid" and r.get("status") == 200]
    tokens = sum(r.get("tokens", 0) for r in done if "tokens" in r)
    # streamed completions report no usage; count their tokens from the engine counter
    gen_total = snap.get("kvpage:generation_tokens_total", 0.0)
    summary = {
        "requests": len(results),
        "outcomes": {f"{k}:{s}": n for (k, s), n in sorted(by.items(), key=str)},
        "lost_or_wrong": len(bad),
        "transport_errors": sum(1 for r in results if "error" in r),
        "duplicated": len(results) - len({r["i"] for r in results}),
        "client": args.client,
        **({"curl": curl_stats} if curl_stats is not None else {}),
        "default_pool": args.default_pool if args.client == "httpx" else None,
        "keep_alive_timeout_s": cfg.security.keep_alive_timeout_s,
        "protocol": "uvicorn H11Protocol" if args.stock_h11 else "IdleOnlyH11Protocol",
        "engine": f"process+nice{args.engine_niceness}" if args.engine_process else "thread",
        "loadavg_1m_before_after": [load_before, round(os.getloadavg()[0], 2)],
        "torch_threads": args.torch_threads,
        "prepared": not args.no_prepare,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "completed_requests_per_s": round(len(done) / wall, 2),
        "generated_tokens_per_s_engine": round(gen_total / wall, 1),
        "non_streamed_completion_tokens": tokens,
        "ttft_s_streamed": pct(
            [r["ttft"] for r in results if "ttft" in r and r["kind"] == "valid"]
        ),
        "e2e_s": pct([r["e2e"] for r in done if "e2e" in r]),
        "engine_counters": {k: v for k, v in snap.items() if k.endswith("_total")},
        "after_run": clean,
    }
    if args.auth:
        ok_lat = [x for x in health if x is not None]
        summary["health_probe"] = {
            "probes": len(health),
            "failed": len(health) - len(ok_lat),
            **pct(ok_lat),
            "max": round(max(ok_lat), 4) if ok_lat else None,
        }
        ctl_lat = [x for x in control if x is not None]
        summary["health_probe_control"] = {
            "probes": len(control),
            "failed": len(control) - len(ctl_lat),
            **pct(ctl_lat),
            "max": round(max(ctl_lat), 4) if ctl_lat else None,
        }
    if tracer is not None:
        summary["loop_stalls"] = tracer.summary()
    if not args.no_baseline:
        summary["baseline"] = offline_baseline(specs, engine_kw, args.clients)
        summary["server_over_offline_tokens_per_s"] = round(
            summary["generated_tokens_per_s_engine"] / summary["baseline"]["tokens_per_s"], 3
        )
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    ok = (
        not bad
        and len(results) == len(specs)
        and clean["free_blocks"] == clean["usable_blocks"]
        and clean["running"] == clean["waiting"] == clean["kv_reserved_blocks"] == 0
        and clean["integrity"] == "ok"
    )
    if args.auth:
        hp = summary["health_probe"]
        ok = ok and hp["failed"] == 0 and hp["probes"] > 0 and hp.get("p99", 1.0) < 0.1
    if bad:
        print("FAILED requests:", bad[:10], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
