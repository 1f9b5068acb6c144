"""Group choice honours each group's limits (no Ray): a request the drawn group cannot
take (a canary with a smaller ``max_model_len`` or ``max_num_seqs``) goes to a group
that can, so the answer never depends on the draw and the ingress's advertised
``max_model_len`` (the largest group's) holds for every request."""

from __future__ import annotations

import asyncio
import itertools
import types
from typing import Any

from test_cluster_units import _drain, _Handle, _LoopObs, _Out

from kvpage.cluster.core import RouterCore
from kvpage.cluster.remote import GroupSelector, RemoteEngineLoop, ReplicaGroup

LIMITS = {"default": (512, 32), "canary": (128, 4), "long_context": (512, 8)}


def test_canary_that_cannot_take_the_request_falls_back_to_default() -> None:
    s = GroupSelector(frozenset({"default", "canary"}), None, 1.0, limits=dict(LIMITS))
    assert s.route(5, 50, 1) == ("canary", "canary")
    assert s.route(5, 200, 1) == ("default", "canary")  # 205 > canary's 128
    assert s.route(5, 50, 8) == ("default", "canary")  # n 8 > canary's max_num_seqs 4
    assert s.route(127, 1, 1) == ("canary", "canary")
    assert s.route(128, 1, 1) == ("default", "canary")
    s.canary_fraction = 0.0
    assert s.route(5, 200, 1) == ("default", "default")


def test_long_context_rule_and_no_fit() -> None:
    limits = {"default": (128, 32), "long_context": (512, 8)}
    s = GroupSelector(frozenset({"default", "long_context"}), 100, 0.0, limits=limits)
    assert s.route(150, 100, 1) == ("long_context", "long_context")
    assert s.route(20, 300, 1) == ("long_context", "default")  # too long for default
    assert s.route(150, 100, 16) == ("long_context", "long_context")  # fits none: engine says
    assert s.route(20, 50, 16) == ("default", "default")


def test_every_request_within_the_largest_group_is_routed_to_a_group_that_fits() -> None:
    groups = frozenset(LIMITS)
    for frac, thr in itertools.product((0.0, 0.5, 1.0), (None, 64, 300)):
        s = GroupSelector(groups, thr, frac, seed=3, limits=dict(LIMITS))
        top = max(m for m, _ in LIMITS.values())
        for prompt, max_tokens, n in itertools.product(
            (1, 63, 64, 127, 300, 511), (1, 100, 400), (1, 4, 8)
        ):
            if prompt + max_tokens > top:
                continue  # refused at the ingress (context_length_exceeded)
            g, _ = s.route(prompt, max_tokens, n)
            assert s.fits(g, prompt, max_tokens, n), (frac, thr, prompt, max_tokens, n, g)


def test_remote_loop_sends_a_too_long_canary_draw_to_default_and_counts_it() -> None:
    async def main() -> None:
        obs = _LoopObs()
        groups = {}
        handles = {}
        for name in ("default", "canary"):
            core = RouterCore(name, "round_robin", block_size=4)
            core.set_replicas([name + "-r"])
            handles[name] = _Handle(core, {name + "-r": [_Out(1, True)]})
            groups[name] = ReplicaGroup(name, handles[name], core, 4)
        sel = GroupSelector(frozenset(groups), None, 1.0, limits=dict(LIMITS))
        loop = RemoteEngineLoop(groups, sel, obs)
        loop.start(asyncio.get_running_loop())
        params: Any = types.SimpleNamespace(max_tokens=200, n=1)
        await _drain(await loop.add("r1", [1, 2, 3, 4, 5], params))
        assert [c[0] for c in handles["default"].calls] == ["default-r"]
        assert handles["canary"].calls == []
        assert ("fallback", "canary", "default") in obs.events
        assert ("request", "default") in obs.events
        handles["canary"].script["canary-r"] = [_Out(1, True)]
        params = types.SimpleNamespace(max_tokens=50, n=1)
        await _drain(await loop.add("r2", [1, 2, 3, 4, 5], params))
        assert [c[0] for c in handles["canary"].calls] == ["canary-r"]

    asyncio.run(main())
