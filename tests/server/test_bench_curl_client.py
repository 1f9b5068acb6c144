"""The load bench's curl client (``benches/bench_server_load.py --client curl``) counts a
request whose connection closed without a status line as lost, and reuses connections.

Against a small HTTP/1.1 keep-alive server (``http.server``, threads) that answers every
completion except one, which it drops by closing the connection unanswered: the bench's
judge must report exactly that one as lost, the rest ok, each once.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_server_load.py"
DROPPED = 3  # the request (seed) the server closes the connection on


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_server_load", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["seed"] == DROPPED:
            self.close_connection = True  # no status line at all
            return
        if body["stream"]:
            ev = {"choices": [{"text": "x", "finish_reason": "length"}]}
            out = f"data: {json.dumps(ev)}\n\ndata: [DONE]\n\n".encode()
            ctype = "text/event-stream"
        else:
            out = json.dumps(
                {
                    "choices": [{"text": "x", "finish_reason": "length"}],
                    "usage": {"completion_tokens": body["max_tokens"]},
                }
            ).encode()
            ctype = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl program")
def test_curl_client_counts_a_dropped_connection_as_lost(tmp_path: Path) -> None:
    bench = _bench()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        specs = [
            {
                "i": i,
                "kind": "valid",
                "prompt": [5, 6, 7],
                "max_tokens": 4,
                "stream": i % 2 == 1,
                "tenant": "tenant-0",
            }
            for i in range(12)
        ]
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        results, stats = bench.drive_curl(url, specs, 2, True, str(tmp_path))
    finally:
        srv.shutdown()
        srv.server_close()
    assert [r["i"] for r in results] == list(range(12))
    lost = [r for r in results if r["status"] is None]
    assert [r["i"] for r in lost] == [DROPPED] and not lost[0]["ok"]
    assert all(r["ok"] and r["status"] == 200 for r in results if r["i"] != DROPPED)
    assert stats["transfers"] == 12 and stats["duplicate_write_out_lines"] == 0
    # 2 parallel transfers over 12 requests: connections were reused (the dropped one
    # costs a reconnect), so far fewer than 12 were opened
    assert stats["reused_connection_transfers"] >= 6, stats
