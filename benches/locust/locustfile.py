"""Locust load test of an OpenAI-compatible server with a streaming (SSE) user.

Each simulated user loops without think time: ``POST /v1/completions`` with
``"stream": true`` and ``ignore_eos`` (so every request generates exactly
``KVPAGE_MAX_TOKENS`` tokens), reading the server-sent events as they arrive. Besides
Locust's own request statistics (requests/s, end-to-end latency), it reports two custom
entries through ``events.request``:

* ``SSE TTFT``: request sent -> first chunk with text (ms);
* ``SSE ITL``: gap between consecutive chunks with text (ms), one sample per gap. With
  ``n = 1`` and no stop strings kvpage streams one chunk per generated token, so this is
  the inter-token latency;
* ``SSE E2E``: request sent -> ``[DONE]`` (ms). (Locust's own entry for the POST stops
  its clock when the response headers arrive, i.e. it measures time to headers.)

Environment: ``KVPAGE_MODEL`` (default stories260K), ``KVPAGE_MAX_TOKENS`` (64),
``KVPAGE_TEMPERATURE`` (0.8). Run with ``locust -f benches/locust/locustfile.py --host
http://127.0.0.1:8000 --headless -u USERS -r USERS -t 30s --csv out/locust``;
``benches/bench_locust.py`` drives it over several concurrencies.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, constant, events, task

MODEL = os.environ.get("KVPAGE_MODEL", "stories260K")
MAX_TOKENS = int(os.environ.get("KVPAGE_MAX_TOKENS", "64"))
TEMPERATURE = float(os.environ.get("KVPAGE_TEMPERATURE", "0.8"))
PROMPTS = [
    "Once upon a time",
    "Lily and Ben went to the park",
    "The little dog was sad because",
    "One day, a big bird",
    "Tom had a red ball. He liked to",
    "The sun was hot and the children",
]


def _fire(name: str, ms: float) -> None:
    events.request.fire(
        request_type="SSE",
        name=name,
        response_time=ms,
        response_length=0,
        exception=None,
        context={},
    )


class SSECompletionUser(HttpUser):
    """A client that streams completions back to back."""

    wait_time = constant(0)

    @task
    def stream_completion(self) -> None:
        body = {
            "model": MODEL,
            "prompt": random.choice(PROMPTS),
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        first = last = None
        gaps = []
        with self.client.post(
            "/v1/completions", json=body, stream=True, catch_response=True, name="completions SSE"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"status {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    resp.failure(str(chunk["error"])[:200])
                    return
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            resp.success()
        _fire("SSE E2E", (time.perf_counter() - t0) * 1000)
        if first is not None:
            _fire("SSE TTFT", (first - t0) * 1000)
        for g in gaps:
            _fire("SSE ITL", g * 1000)
