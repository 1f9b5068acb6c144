"""Replay a serving trace through the engine in real time and summarize it.

Length rule (how a production trace is fitted into a small model's context):

* prompt length ``P = clamp(ceil(input_tokens / prompt_scale), 1, max_model_len // 2)``;
* output length ``M = clamp(ceil(output_tokens / output_scale), 1, max_model_len - P)``,
  generated with ``ignore_eos`` so the trace's output length is honoured;
* defaults: Azure ``prompt_scale = 8``, ``output_scale = 1``; Mooncake ``prompt_scale =
  32`` (one 512-token hash block becomes 16 tokens, exactly one block at block_size
  16), ``output_scale = 1``.
* prompt token ids: Azure prompts are seeded random ids unique per request; a
  Mooncake hash id maps to a fixed run of ``512 / prompt_scale`` token ids (at most
  ``max_model_len // 2``, the longest prompt)
  (``kvpage.workload.traces.TokenMapper``), so requests that share leading hash ids share
  exactly those leading tokens and hit the prefix cache.

Arrival times are the trace's, divided by ``speedup``; a request's TTFT and latency are
measured from its scheduled arrival, so queueing delay counts.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpage.cache.explain import aggregate_misses
from kvpage.engine.engine import LLMEngine
from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.errors import RequestRejected
from kvpage.stats import summarize

#: longest single sleep while waiting for the next arrival, in seconds
MAX_SLEEP_S = 1.0

#: default prompt scale per trace format (see the module docstring)
DEFAULT_PROMPT_SCALE = {"azure": 8, "mooncake": 32, "synthetic": 8}


@dataclass
class ReplayRequest:
    """One request ready for the engine: arrival (s after start), prompt ids, max_tokens."""

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


def resolve_prompt_scale(trace_format: str, prompt_scale: float | None) -> float:
    """The prompt scale in use: ``prompt_scale`` when given, else the trace format's
    default (:data:`DEFAULT_PROMPT_SCALE`, 8 for an unknown format).

    Raises:
        ValueError: ``prompt_scale`` is given but not a finite number > 0.
    """
    if prompt_scale is None:
        return float(DEFAULT_PROMPT_SCALE.get(trace_format, 8))
    if not _positive(prompt_scale):
        raise ValueError(f"prompt_scale: expected a finite number > 0, got {prompt_scale!r}")
    return float(prompt_scale)


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def fit_trace(
    trace: Any,
    *,
    max_model_len: int,
    vocab_size: int,
    prompt_scale: float | None = None,
    output_scale: float = 1.0,
    seed: int = 0,
) -> list[ReplayRequest]:
    """Scale a ``kvpage.workload.traces.Trace`` into the model's context (module docstring).

    Raises:
        ValueError: a scale is not a finite number > 0 (``prompt_scale`` None = the
            format's default, see :func:`resolve_prompt_scale`).
    """
    from kvpage.workload.traces import MOONCAKE_BLOCK_TOKENS, TokenMapper

    ps = resolve_prompt_scale(trace.format, prompt_scale)
    if not _positive(output_scale):
        raise ValueError(f"output_scale: expected a finite number > 0, got {output_scale!r}")
    max_prompt = max(1, max_model_len // 2)
    # a run longer than the longest prompt is never read past max_prompt tokens: capping it
    # keeps the same prefix sharing and bounds the mapper's memory (a tiny prompt_scale
    # such as 0.001 would otherwise make 4 MB runs for each of thousands of hash ids)
    hb = min(max(1, int(round(MOONCAKE_BLOCK_TOKENS / ps))), max_prompt)
    mapper = TokenMapper(seed=seed, vocab_size=vocab_size, hash_block_tokens=hb)
    out = []
    for r in trace.requests:
        p = min(max(1, math.ceil(r.prompt_tokens / ps)), max_prompt)
        m = min(max(1, math.ceil(r.output_tokens / output_scale)), max_model_len - p)
        scaled = dataclasses.replace(r, prompt_tokens=p, output_tokens=m)
        if r.hash_ids is not None:
            need = -(-p // hb)
            if len(r.hash_ids) < need:  # rounding of the scale: pad with private ids
                extra = tuple(10**9 + r.index * 1000 + k for k in range(need - len(r.hash_ids)))
                scaled = dataclasses.replace(scaled, hash_ids=r.hash_ids + extra)
        out.append(ReplayRequest(r.request_id, r.arrival_s, mapper.prompt(scaled), m))
    return out


class Terminated(KeyboardInterrupt):
    """SIGTERM delivered as an interrupt (``kvpage replay`` installs the handler), so a
    replay stopped by ``kill`` ends like one stopped by Ctrl-C: partial summary written,
    unfinished requests aborted. ``exit_code`` is the shell's code for SIGTERM."""

    exit_code = 143  # 128 + SIGTERM


@dataclass
class ReplayResult:
    """Summary of a replay (times in milliseconds, rates per second of wall time)."""

    summary: dict[str, Any] = field(default_factory=dict)
    outputs: list[RequestOutput] = field(default_factory=list)


def replay(
    engine: LLMEngine,
    requests: list[ReplayRequest],
    *,
    speedup: float = 1.0,
    on_finish: Callable[[RequestOutput], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ReplayResult:
    """Feed ``requests`` to ``engine`` at their (sped-up) arrival times and step it
    until all finish.

    Args:
        engine: the engine (its counters are read before and after).
        requests: sorted by ``arrival_s``.
        speedup: arrival times are divided by it (> 0).
        on_finish: called with each finished output (progress bars).

    Returns:
        A ReplayResult whose ``summary`` has: requests, completed, rejected, prompt and
        generated tokens, TTFT/TPOT/e2e percentiles (ms), prefill and decode tokens per
        second (tokens computed / wall time of the run), output tokens/s, peak and mean
        (over steps) KV usage, prefix hit ratio (hit / queried prompt tokens, every
        lookup: readmissions after preemption included), the finished requests'
        first-admission hit tokens by tier (``prefix_hit_tokens_by_tier``: device,
        host, disk) and their share of the prompt tokens (``first_admission_hit_ratio``),
        preemptions, allocation failures, steps, duration, ``interrupted`` (True
        when Ctrl-C or SIGTERM stopped the run early; unfinished requests are aborted)
        and ``interrupted_by`` (``"SIGINT"``, ``"SIGTERM"`` or None). A percentile
        with no sample (no request finished) is None, never NaN.

    Raises:
        ValueError: ``speedup`` is not a finite number > 0, or an arrival time is not
            finite.
    """
    if not _positive(speedup):
        raise ValueError(f"speedup: expected a finite number > 0, got {speedup!r}")
    for r in requests:  # a NaN arrival would never come due: the loop would wait forever
        if not math.isfinite(r.arrival_s):
            raise ValueError(
                f"requests[{r.request_id}].arrival_s: expected a finite number, got {r.arrival_s}"
            )
    m0 = engine.get_metrics()
    st = engine.step_stats
    pre0, dec0, steps0 = st.prefill_tokens, st.decode_tokens, st.num_steps
    done: list[RequestOutput] = []
    rejected: dict[str, str] = {}
    usage: list[float] = []
    t0 = time.monotonic()
    i = 0
    n = len(requests)
    interrupted: str | None = None
    try:
        while i < n or engine.has_unfinished_requests():
            now = time.monotonic() - t0
            while i < n and requests[i].arrival_s / speedup <= now:
                r = requests[i]
                params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                try:
                    engine.add_request(
                        r.request_id, r.prompt_token_ids, params, t0 + r.arrival_s / speedup
                    )
                except RequestRejected as e:
                    rejected[r.request_id] = e.reason
                i += 1
            if not engine.has_unfinished_requests():
                if i < n:
                    # in slices of at most MAX_SLEEP_S: a tiny speedup gives huge waits
                    # (time.sleep overflows past ~1e9 s) and Ctrl-C stays responsive
                    wait = requests[i].arrival_s / speedup - (time.monotonic() - t0)
                    sleep(min(MAX_SLEEP_S, max(0.0, wait)))
                continue
            for out in engine.step(finished_only=True):
                if out.finished:
                    done.append(out)
                    if on_finish is not None:
                        on_finish(out)
            usage.append(engine.kv_cache_manager.usage)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: summarize what finished, free the rest
        interrupted = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        for r in requests[:i]:
            engine.abort_request(r.request_id)
    wall = time.monotonic() - t0
    m1 = engine.get_metrics()

    def delta(name: str) -> float:
        return m1[f"kvpage:{name}"] - m0[f"kvpage:{name}"]

    q, h = delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total")
    gen = sum(len(c.token_ids) for o in done for c in o.outputs)
    summary: dict[str, Any] = {
        "requests": n,
        "completed": len(done),
        "rejected": len(rejected),
        "rejected_reasons": sorted(set(rejected.values())),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in done),
        "generated_tokens": gen,
        "ttft_ms": summarize([o.ttft for o in done if o.ttft is not None], scale=1000.0),
        "tpot_ms": summarize([o.tpot for o in done if o.tpot is not None], scale=1000.0),
        "e2e_ms": summarize(
            [o.e2e_latency for o in done if o.e2e_latency is not None], scale=1000.0
        ),
        "prefill_tokens_per_s": (st.prefill_tokens - pre0) / wall if wall > 0 else 0.0,
        "decode_tokens_per_s": (st.decode_tokens - dec0) / wall if wall > 0 else 0.0,
        "output_tokens_per_s": gen / wall if wall > 0 else 0.0,
        "kv_usage_peak": max(usage, default=0.0),
        "kv_usage_mean": float(np.mean(usage)) if usage else 0.0,
        "prefix_hit_ratio": h / q if q > 0 else 0.0,
        "prefix_hit_tokens": int(h),
        "preemptions": int(delta("num_preemptions_total")),
        "allocation_failures": int(delta("block_allocation_failures_total")),
        "miss_reasons": aggregate_misses(o.cache_miss for o in done),
        "steps": st.num_steps - steps0,
        "duration_s": wall,
        "speedup": speedup,
        "interrupted": interrupted is not None,
        "interrupted_by": interrupted,
    }
    by_tier: dict[str, int] = {}  # first-admission hits by where they were found
    for o in done:
        for k, v in o.num_cached_tokens_by_tier.items():
            by_tier[k] = by_tier.get(k, 0) + v
    summary["prefix_hit_tokens_by_tier"] = by_tier
    first = sum(by_tier.values())
    summary["first_admission_hit_ratio"] = first / summary["prompt_tokens"] if done else 0.0
    return ReplayResult(summary, done)


__all__ = [
    "DEFAULT_PROMPT_SCALE",
    "ReplayRequest",
    "ReplayResult",
    "Terminated",
    "fit_trace",
    "replay",
    "resolve_prompt_scale",
]
