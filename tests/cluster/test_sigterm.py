"""``kvpage serve --replicas 1`` stops on SIGTERM as cleanly as on Ctrl-C (slow: it
starts Ray, ~30-60 s on 2 cores).

``ray.init`` installs its own SIGTERM handler; before the fix SIGTERM printed Ray's
crash-style dump ("*** SIGTERM received ... PC: @") and left Ray's DashboardAgent and
RuntimeEnvAgent running for minutes.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the cluster extra"),
]


def _agents() -> set[int]:
    pids = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"DashboardAgent" in cmd or b"RuntimeEnvAgent" in cmd:
                pids.add(int(p.name))
    return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, log: Any) -> subprocess.Popen[bytes]:
    """``kvpage serve --replicas 1`` on ``port``, output to ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvpage.cli", "serve", "--replicas", "1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_sigterm_shuts_serve_and_ray_down(tmp_path: Path) -> None:
    port = _free_port()
    before = _agents()
    log = (tmp_path / "serve.log").open("w")
    proc = _serve(port, log)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(1)
        else:
            pytest.fail("the server did not come up in 240 s")
        ours = _agents() - before
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "SIGTERM received" not in text and "PC: @" not in text, text[-2000:]
    time.sleep(5)
    assert not (ours & _agents()), "Ray agents left running after SIGTERM"


@pytest.mark.parametrize("after_s", [1.0, 2.5])
def test_sigterm_inside_ray_init_leaves_no_ray_process(tmp_path: Path, after_s: float) -> None:
    """SIGTERM while ``ray.init`` runs reaches Ray's handler (it exits at once); the
    start-up path must still take down the node it started (fresh-user finding F1:
    DashboardAgent and RuntimeEnvAgent were left running)."""
    port = _free_port()
    before = _agents()
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    proc = _serve(port, log)
    try:
        deadline = time.monotonic() + 120
        # the last line before ray.init starts the node (kvpage's bind warning)
        while "WITHOUT authentication" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        time.sleep(after_s)
        started = _agents() - before
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    time.sleep(8)
    left = (_agents() - before) | (started & _agents())
    assert not left, f"Ray agents left running: {left}\n{log_path.read_text()[-2000:]}"
