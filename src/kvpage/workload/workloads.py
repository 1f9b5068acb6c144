"""Named synthetic workloads for the stress-test matrix, as :class:`Trace` objects.

Every workload is generated from a seed (numpy ``default_rng``) at a *scale*: ``gpu``
lengths suit an 8B model with an 8k context; ``cpu`` divides every length by 16 (min 1
token) and the hash-block size too (512 -> 32 tokens) so that the bundled 512-context
stories260K model runs the same shapes. Prefix sharing is expressed with hash ids, as in
the Mooncake trace (see :mod:`kvpage.workload.traces` for the token mapping): two requests
share tokens exactly where they share leading hash ids.

Workloads (lengths at ``gpu`` scale, tokens; uniform ranges):

* ``short-short``: prompt 64-256, output 32-128.
* ``long-prompt``: prompt 3000-7000, output 16-64 (summarisation-like, prefill-bound).
* ``long-output``: prompt 64-256, output 1000-2000 (generation-bound).
* ``long-long``: prompt 3000-5000, output 1000-2000 (KV-bound).
* ``multi-turn``: sessions of 4 turns; turn k's prompt = turn k-1's prompt + its
  output + a new user message of 100-400 tokens (all turns of a session share the
  previous turn's hash blocks); outputs 100-400; a 1024-token system prompt shared by
  every session. Next turn arrives after the previous one's expected end plus an
  exponential think time (mean 5 s).
* ``rag``: a 1024-token shared system prompt, then 4 retrieved passages of 512 tokens
  from a pool of 32 (Zipf-like popularity, weight 1/rank), then a 32-128 token
  question; output 64-256.

Arrivals are Poisson at ``rate`` requests/s (sessions/s for multi-turn).
"""

from __future__ import annotations

import numpy as np

from kvpage.errors import SpecError
from kvpage.workload.traces import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest

WORKLOADS = ("short-short", "long-prompt", "long-output", "long-long", "multi-turn", "rag")
#: default arrival rate (req/s; sessions/s for multi-turn) at gpu scale
#: (chosen to load one H100 serving Llama-3-8B: near its prefill capacity or its KV capacity)
DEFAULT_RATES = {
    "short-short": 200.0,
    "long-prompt": 6.0,
    "long-output": 20.0,
    "long-long": 4.0,
    "multi-turn": 10.0,
    "rag": 20.0,
}
_RANGES = {
    "short-short": ((64, 256), (32, 128)),
    "long-prompt": ((3000, 7000), (16, 64)),
    "long-output": ((64, 256), (1000, 2000)),
    "long-long": ((3000, 5000), (1000, 2000)),
}


class _Ids:
    """Fresh hash ids."""

    def __init__(self) -> None:
        self.next = 1_000_000

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def make_workload(
    name: str, num_requests: int, *, scale: str = "gpu", rate: float | None = None, seed: int = 0
) -> Trace:
    """Generate a named workload (module docstring).

    Args:
        name: one of :data:`WORKLOADS`.
        num_requests: requests to generate (multi-turn: rounded to whole 4-turn sessions).
        scale: ``"gpu"`` or ``"cpu"`` (lengths / 16).
        rate: Poisson arrival rate; default :data:`DEFAULT_RATES` (x 1 at either scale).
        seed: generator seed.

    Raises:
        SpecError: unknown name or scale, ``num_requests < 1``, ``rate <= 0``.
    """
    if name not in WORKLOADS:
        raise SpecError(f"workload: expected one of {WORKLOADS}, got {name!r}")
    if scale not in ("gpu", "cpu"):
        raise SpecError(f"scale: expected 'gpu' or 'cpu', got {scale!r}")
    if num_requests < 1:
        raise SpecError(f"num_requests: expected >= 1, got {num_requests}")
    r = DEFAULT_RATES[name] if rate is None else rate
    if r <= 0:
        raise SpecError(f"rate: expected > 0, got {r}")
    div = 16 if scale == "cpu" else 1
    hb = MOONCAKE_BLOCK_TOKENS // div
    rng = np.random.default_rng(seed)
    ids = _Ids()

    def sc(x: int) -> int:
        return max(1, int(x) // div)

    def blocks_for(n: int) -> int:
        return -(-n // hb)

    reqs: list[TraceRequest] = []
    if name in _RANGES:
        (p0, p1), (o0, o1) = _RANGES[name]
        t = 0.0
        for i in range(num_requests):
            t += float(rng.exponential(1.0 / r))
            p = sc(int(rng.integers(p0, p1 + 1)))
            o = sc(int(rng.integers(o0, o1 + 1)))
            reqs.append(TraceRequest(i, t, p, o, tuple(ids.take(blocks_for(p)))))
    elif name == "rag":
        system = ids.take(2)  # 1024 tokens
        pool = ids.take(32)
        w = 1.0 / np.arange(1, 33)
        w /= w.sum()
        t = 0.0
        for i in range(num_requests):
            t += float(rng.exponential(1.0 / r))
            passages = [pool[j] for j in rng.choice(32, size=4, replace=False, p=w)]
            q = int(rng.integers(32, 129))
            p = sc(1024 + 4 * 512 + q)
            o = sc(int(rng.integers(64, 257)))
            rag_ids = system + passages + ids.take(1)
            reqs.append(TraceRequest(i, t, p, o, tuple(rag_ids[: blocks_for(p)])))
    else:  # multi-turn
        system = ids.take(2)
        sessions = max(1, num_requests // 4)
        start = 0.0
        for _ in range(sessions):
            start += float(rng.exponential(1.0 / r))
            t = start
            hids: list[int] = list(system)
            length = 1024
            for _turn in range(4):
                length += int(rng.integers(100, 401))
                need = blocks_for(sc(length))
                hids = hids[: min(len(hids), need)]
                # the previous turn's partial last block keeps its id: its tokens extend
                hids += ids.take(need - len(hids))
                o = int(rng.integers(100, 401))
                reqs.append(TraceRequest(0, t, sc(length), sc(o), tuple(hids)))
                length += o
                t += 0.02 * o + float(rng.exponential(5.0))
        reqs.sort(key=lambda q: q.arrival_s)
        reqs = [
            TraceRequest(i, q.arrival_s, q.prompt_tokens, q.output_tokens, q.hash_ids)
            for i, q in enumerate(reqs)
        ]
    t0 = reqs[0].arrival_s
    reqs = [
        TraceRequest(q.index, q.arrival_s - t0, q.prompt_tokens, q.output_tokens, q.hash_ids)
        for q in reqs
    ]
    return Trace(f"{name}-{scale}", "", "synthetic", reqs, hash_block_tokens=hb)


__all__ = ["DEFAULT_RATES", "WORKLOADS", "make_workload"]
