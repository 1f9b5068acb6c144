"""Prefix-cache isolation between tenants (issue 12), read from the engine's own count.

The hard guarantee is asserted on ``usage.prompt_tokens_details.cached_tokens`` (the
engine's ``num_cached_tokens`` of the request) and on the engine's prefix-cache hit
counter, not on time: under the default scope a tenant's probe of another tenant's
prompt gets 0 cached tokens, so there is no cache hit to time. The timing side of the
same claim is ``test_timing_probe_indistinguishable`` (``-m slow``).
"""

from __future__ import annotations

import math
import random
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.xdist_group("server_cache_isolation")

MODEL = "stories260K"
KEYS = {"a": "sk-tenant-a-" + "1" * 24, "b": "sk-tenant-b-" + "2" * 24}
PROMPT = list(range(300, 300 + 80))  # 80 tokens = 5 full blocks of 16


def _prompt(k):
    """Another 80-token prompt, distinct for each k (vocabulary: 512 tokens)."""
    return [(t * 7 + k * 13) % 500 + 5 for t in range(80)]


def _server(serve, scope):
    return serve(security={"api_keys": list(KEYS.values()), "prefix_cache_scope": scope})


@pytest.fixture(scope="module")
def tenant_server(serve):
    return _server(serve, "tenant")


@pytest.fixture(scope="module")
def global_server(serve):
    return _server(serve, "global")


@pytest.fixture(scope="module")
def salt_server(serve):
    return _server(serve, "salt")


def _cached(server, tenant, prompt, salt=None, chat=False):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS[tenant], max_retries=0)
    extra = {"cache_salt": salt} if salt is not None else None
    if chat:
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=1,
            temperature=0,
            extra_body=extra,
        )
    else:
        r = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
    return r.usage.prompt_tokens_details.cached_tokens


def _hits(server):
    """The engine's prefix-cache hit counter, read on the engine thread between steps
    (the published snapshot may lag a response by one step)."""
    import asyncio

    eng_loop = server.app.state.serving.loop
    fut = asyncio.run_coroutine_threadsafe(eng_loop.call(lambda e: e.get_metrics()), eng_loop._loop)
    return fut.result(timeout=30)["kvpage:prefix_cache_hits_total"]


def test_default_scope_isolates_tenants(tenant_server):
    p = PROMPT
    assert _cached(tenant_server, "a", p) == 0
    assert _cached(tenant_server, "a", p) == 64  # own cache: 4 full blocks (last recomputed)
    h0 = _hits(tenant_server)
    assert _cached(tenant_server, "b", p) == 0  # another tenant, same prompt: nothing shared
    assert _hits(tenant_server) == h0
    assert _cached(tenant_server, "b", p) == 64  # b's own copy now
    # the same salt does not bridge tenants under the default scope
    assert _cached(tenant_server, "a", p, salt="shared") == 0
    assert _cached(tenant_server, "b", p, salt="shared") == 0


def test_cache_salt_separates_one_tenants_requests(tenant_server):
    p = _prompt(1)
    assert _cached(tenant_server, "a", p, salt="user-1") == 0
    assert _cached(tenant_server, "a", p, salt="user-2") == 0
    assert _cached(tenant_server, "a", p) == 0  # no salt is its own namespace too
    assert _cached(tenant_server, "a", p, salt="user-1") == 64
    text = "Once upon a time there was a little girl named Lily. " * 6
    assert _cached(tenant_server, "a", text, salt="s", chat=True) == 0
    assert _cached(tenant_server, "a", text, salt="t", chat=True) == 0
    assert _cached(tenant_server, "a", text, salt="s", chat=True) > 0


def test_global_scope_shares_and_salt_still_separates(global_server):
    p = _prompt(2)
    assert _cached(global_server, "a", p) == 0
    assert _cached(global_server, "b", p) == 64  # operator chose sharing
    assert _cached(global_server, "a", p, salt="x") == 0
    assert _cached(global_server, "b", p, salt="x") == 64
    assert _cached(global_server, "b", p, salt="y") == 0


def test_salt_scope_shares_only_by_agreed_salt(salt_server):
    p = _prompt(3)
    assert _cached(salt_server, "a", p) == 0
    assert _cached(salt_server, "b", p) == 0  # no salt: per tenant
    assert _cached(salt_server, "a", p, salt="team-secret") == 0
    assert _cached(salt_server, "b", p, salt="team-secret") == 64


def test_bad_cache_salt_is_refused(tenant_server):
    url = tenant_server.base_url + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEYS['a']}"}
    for salt in ("", 5, "x" * 2000):
        r = httpx.post(
            url, json={"model": MODEL, "prompt": "Once", "cache_salt": salt}, headers=auth
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", salt


# ------------------------------------------------------------------ timing (slow)


def _mann_whitney_z(x: list[float], y: list[float]) -> float:
    """Two-sided Mann-Whitney U statistic as a z-score (normal approximation, mid-ranks
    for ties; fine for n >= 20 per sample)."""
    allv = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(allv)
    i = 0
    while i < len(allv):
        j = i
        while j + 1 < len(allv) and allv[j + 1][0] == allv[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    r1 = sum(r for r, (_, g) in zip(ranks, allv) if g == 0)
    n1, n2 = len(x), len(y)
    u = r1 - n1 * (n1 + 1) / 2
    mu, sd = n1 * n2 / 2, math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    return (u - mu) / sd


def _ttft(client, prompt):
    t0 = time.perf_counter()
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - t0


@pytest.mark.slow
def test_timing_probe_indistinguishable(serve):
    """Tenant b probes secrets of tenant a: a correct guess must not be faster than a
    wrong one (default scope), while a's own repeat still is.

    Test: 40 rounds; each round a fresh 400-token secret S is sent by a, then b sends S
    (correct guess) and a fresh 400-token W (wrong guess) in random order; a then resends
    S (own cache). Two-sided Mann-Whitney U on b's correct vs wrong latencies must give
    |z| < 3.29 (p > 0.001: indistinguishable), and a one-sided test of a's repeat vs b's
    wrong guesses must give z < -3.29 (the cache benefit is real and measurable by the
    same probe). Alternating order within a round spreads machine-load drift over both.
    """
    srv = serve(
        engine={"num_blocks": 257, "max_num_batched_tokens": 512},
        security={"api_keys": list(KEYS.values())},
    )
    a = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEYS["a"], max_retries=0)
    b = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEYS["b"], max_retries=0)
    rng = random.Random(0)
    right, wrong, own = [], [], []
    for _ in range(40):
        secret = [rng.randrange(3, 500) for _ in range(400)]
        guess = [rng.randrange(3, 500) for _ in range(400)]
        _ttft(a, secret)
        if rng.random() < 0.5:
            right.append(_ttft(b, secret))
            wrong.append(_ttft(b, guess))
        else:
            wrong.append(_ttft(b, guess))
            right.append(_ttft(b, secret))
        own.append(_ttft(a, secret))
    z_cross = _mann_whitney_z(right, wrong)
    z_own = _mann_whitney_z(own, wrong)
    print(f"cross-tenant z={z_cross:.2f}, own-tenant z={z_own:.2f}")
    assert abs(z_cross) < 3.29
    assert z_own < -3.29
