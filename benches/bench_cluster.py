"""Real run of the scaled-out server: router policies on a shared-prefix workload.

Starts Ray in this process, then for each policy (``--policies``, default all four)
deploys ``--replicas`` engine replicas of the bundled model (stories260K, CPU) behind
the ingress (``kvpage.cluster.launch``; the application is deleted and deployed again
between policies, so every policy starts from cold caches), and drives the HTTP API
with the official ``openai`` client (``AsyncOpenAI``, ``--concurrency`` closed-loop
clients taking requests in trace order).

Workload (Mooncake-derived, shared prefix): of the first ``--scan`` requests of the
Mooncake FAST'25 conversation trace (bundled), those whose first ``--group-blocks``
hash ids are shared by at least ``--min-group`` of them (conversations and agents that
come back, and their system prompts), the first ``--requests`` in trace order. Each 512-token Mooncake hash block becomes a run of
``--tokens-per-hash`` token ids (``kvpage.workload.traces.TokenMapper`` over the
model's 512-token vocabulary, seeded), and a prompt is the runs of its first
``--max-hash-blocks`` hash ids -- so requests that share leading hash ids share
leading token blocks exactly as in the trace, scaled to a 512-token model. Every
request is greedy with ``max_tokens`` ``--max-tokens`` and ``ignore_eos``.

With ``--rounds R`` the policies run in turn R times (alternating rounds on the same
machine). Reported per policy and round: prefix hit ratio (prompt tokens served from the replicas' prefix
caches / prompt tokens, from ``usage.prompt_tokens_details.cached_tokens``), requests/s
and tokens/s over the policy's run, the router's predicted vs actual hit blocks and
resyncs (``/metrics``), and requests per replica. Checked: every completion's tokens
equal ``LLM.generate`` on one engine with the same prompts (greedy), for every policy.

    .venv/bin/python benches/bench_cluster.py --replicas 2 --requests 96 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpage.workload.traces import TokenMapper, load_trace

MODEL = "stories260K"
POLICIES = ("round_robin", "power_of_two", "prefix_approx", "kv_precise")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_prompts(
    n: int,
    tokens_per_hash: int,
    max_hash_blocks: int,
    seed: int,
    scan: int = 4000,
    group_blocks: int = 2,
    min_group: int = 4,
) -> list[list[int]]:
    """The Mooncake-derived shared-prefix prompts (see module doc)."""
    from collections import Counter

    trace = load_trace("mooncake-conv", limit=scan)
    key = lambda r: tuple((r.hash_ids or ())[:group_blocks])  # noqa: E731
    count = Counter(key(r) for r in trace.requests)
    chosen = [r for r in trace.requests if count[key(r)] >= min_group][:n]
    mapper = TokenMapper(seed=seed, vocab_size=512, hash_block_tokens=tokens_per_hash)
    out = []
    for req in chosen:
        ids: list[int] = []
        for h in (req.hash_ids or ())[:max_hash_blocks]:
            ids.extend(int(t) for t in mapper.hash_block(h))
        out.append(ids)
    return out


def ideal_hit_ratio(prompts: list[list[int]], block: int) -> float:
    """Hit ratio of one infinite cache seeing the prompts in order (the upper bound)."""
    seen: set[tuple[int, ...]] = set()
    hit = tot = 0
    for p in prompts:
        n = len(p) // block
        m = 0
        for k in range(1, n + 1):
            pre = tuple(p[: k * block])
            if pre in seen:
                m = k
            seen.add(pre)
        hit += m * block
        tot += len(p)
    return hit / tot if tot else 0.0


def _metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


async def drive(url: str, prompts: list[list[int]], max_tokens: int, conc: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)
    results: list[Any] = [None] * len(prompts)
    nxt = 0

    async def worker() -> None:
        nonlocal nxt
        while nxt < len(prompts):
            i = nxt
            nxt += 1
            r = await client.completions.create(
                model=MODEL,
                prompt=prompts[i],
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            d = r.usage.prompt_tokens_details
            results[i] = (
                r.choices[0].text,
                r.usage.prompt_tokens,
                int(d.cached_tokens or 0) if d is not None else 0,
                r.usage.completion_tokens,
            )

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    await client.close()
    prompt = sum(r[1] for r in results)
    cached = sum(r[2] for r in results)
    completion = sum(r[3] for r in results)
    return {
        "texts": [r[0] for r in results],
        "wall_s": wall,
        "requests_per_s": len(prompts) / wall,
        "tokens_per_s": (prompt + completion) / wall,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens-per-hash", type=int, default=32)
    ap.add_argument("--max-hash-blocks", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=512, help="KV blocks per replica")
    ap.add_argument("--scan", type=int, default=4000)
    ap.add_argument("--group-blocks", type=int, default=2)
    ap.add_argument("--min-group", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rounds", type=int, default=1, help="policies in turn, this many times (alternating)"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import ray
    from ray import serve

    from kvpage import LLM, SamplingParams
    from kvpage.cluster import launch
    from kvpage.cluster.config import ClusterConfig

    prompts = build_prompts(
        a.requests,
        a.tokens_per_hash,
        a.max_hash_blocks,
        a.seed,
        scan=a.scan,
        group_blocks=a.group_blocks,
        min_group=a.min_group,
    )
    engine = {"model": MODEL, "num_blocks": a.num_blocks, "block_size": 16}
    llm = LLM(**engine)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    single_s = time.perf_counter() - t0
    del llm
    port = _free_port()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs",
        "ray": ray.__version__,
        "replicas": a.replicas,
        "requests": a.requests,
        "concurrency": a.concurrency,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "num_blocks_per_replica": a.num_blocks,
        "ideal_hit_ratio_one_infinite_cache": ideal_hit_ratio(prompts, 16),
        "single_engine_generate_s": single_s,
        "policies": {},
    }
    ok = True
    try:
        runs = [p for _ in range(a.rounds) for p in a.policies.split(",")]
        for i, policy in enumerate(runs):
            cfg = ClusterConfig.model_validate(
                {
                    "server": {"port": port, "log_level": "warning"},
                    "router": {"policy": policy, "kv_event_poll_s": 0.1},
                    "groups": {
                        "default": {"replicas": a.replicas, "num_cpus": 0.5, "engine": engine}
                    },
                    "ingress_num_cpus": 0.25,
                }
            )
            if i == 0:
                url = launch.start(cfg, ray_init_kwargs={"logging_level": "warning"})
            else:
                serve.delete(cfg.app_name)
                serve.run(launch.build_app(cfg), name=cfg.app_name, route_prefix="/")
            res = asyncio.run(drive(url, prompts, a.max_tokens, a.concurrency))
            import httpx

            m = _metrics(httpx.get(url + "/metrics", timeout=60).text)
            same = sum(x == y for x, y in zip(res.pop("texts"), want))
            ok &= same == len(want)
            per_replica = sorted(v for v in m.get("kvpage:router_decisions_total", {}).values())
            res.update(
                {
                    "identical_to_single_engine": f"{same}/{len(want)}",
                    "predicted_hit_blocks": sum(
                        m.get("kvpage:router_predicted_hit_blocks_total", {}).values()
                    ),
                    "actual_hit_blocks": sum(
                        m.get("kvpage:router_actual_hit_blocks_total", {}).values()
                    ),
                    "resyncs": sum(m.get("kvpage:router_resyncs_total", {}).values()),
                    "requests_per_replica": per_replica,
                }
            )
            report["policies"].setdefault(policy, []).append(res)
            print(policy, json.dumps(res), flush=True)
    finally:
        launch.stop()
    print(json.dumps(report, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    if not ok:
        print("FAIL: some completions differ from the single engine", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
