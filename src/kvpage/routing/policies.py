"""Router policies: pick a replica for a request from its block hashes and replica loads.

Every policy implements :class:`RouterPolicy` (``choose`` then ``on_routed``); the same
objects run in the Ray Serve deployment and in the multi-instance simulator
(``kvpage simulate --instances N --router NAME``). Names (:data:`POLICY_NAMES`):

* ``round_robin``: replicas in turn (the naive baseline).
* ``power_of_two``: two distinct replicas drawn at random, the one with fewer queued
  requests (running + waiting) wins; Ray Serve's default request router
  (``PowerOfTwoChoicesRequestRouter``).
* ``prefix_approx``: the approximate baseline of Ray Serve LLM's
  ``PrefixCacheAffinityRouter``, rebuilt here (see :class:`PrefixApproxPolicy` for why
  it is not imported).
* ``kv_precise``: ours; the exact blocks each replica holds *now* (a
  :class:`~kvpage.routing.index.PrefixIndex` fed by KV events) in one cost with load,
  see :class:`KVPrecisePolicy` and :class:`CostWeights`.
* ``oracle`` (simulator only): the replica holding the longest prefix according to an
  exact lookup of every replica's pool, load as the tie-break; the upper bound of
  prefix-hit routing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpage.routing.base import (
    PolicyBase,
    ReplicaLoad,
    RouteRequest,
    RouterPolicy,
    check_loads,
    route_request,
)
from kvpage.routing.cost import CostWeights
from kvpage.routing.events import RoutingError
from kvpage.routing.index import PrefixIndex

POLICY_NAMES = ("round_robin", "power_of_two", "prefix_approx", "kv_precise", "oracle")


class RoundRobinPolicy(PolicyBase):
    """Replicas in turn, in the order of ``loads`` (position = counter mod len)."""

    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._next = 0

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> str:
        check_loads(loads)
        rid = loads[self._next % len(loads)].replica_id
        self._next += 1
        return rid


class PowerOfTwoPolicy(PolicyBase):
    """Two distinct random replicas, fewer queued wins (ties at random): Ray Serve's
    default ``PowerOfTwoChoicesRequestRouter`` (Mitzenmacher, "The Power of Two Choices
    in Randomized Load Balancing", 2001)."""

    name = "power_of_two"

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> str:
        check_loads(loads)
        return self._pow2(loads)


class PrefixApproxPolicy(PolicyBase):
    """Approximate prefix affinity from past routing decisions, no eviction feedback.

    The algorithm of Ray Serve LLM's ``PrefixCacheAffinityRouter`` (Ray docs,
    "Prefix-aware routing"), with its defaults:

    1. if the queue lengths (running + waiting) of the replicas differ by more than
       ``imbalanced_threshold`` (10), fall back to power of two choices;
    2. else match the prompt against the prefix tree of prompts already routed: if the
       longest match covers at least ``match_rate_threshold`` (0.1) of the prompt, the
       candidates are the replicas with that longest match; below it, the replicas with
       the smallest share of the tree ("smallest tenants");
    3. among the candidates the one with the fewest queued requests wins; with no tree
       data at all, power of two choices.

    The tree stores each routed prompt under its replica and never evicts (Ray's default
    ``do_eviction=False``), so it keeps predicting hits for blocks a replica has long
    evicted: exactly the staleness ``kv_precise`` removes.

    Why not import Ray's class: it lives in ``ray.serve.llm``, which is installed with
    the ``ray[llm]`` extra (its requirements list ``vllm``); importing
    ``ray.serve.llm.request_router`` first runs ``ray/serve/llm/__init__.py``, which
    imports the ``LLMConfig`` / ``LLMServer`` (vLLM engine deployment) modules. A
    vLLM-free import was not verified (Ray is not installed in kvpage's environment),
    and the class also expects text ``prompt``/``messages`` request arguments and a
    detached prefix-tree actor, while kvpage's router core must not need Ray. This
    rebuild matches on tokens instead of characters, with block-granular edges: the tree
    is a dict keyed by the chained block hashes (a chained hash names the whole path
    from the root, so the dict *is* the trie), and a match counts ``block_size`` tokens
    per matched block (a prompt's partial last block is never matched).

    Args:
        seed: the random draws.
        imbalanced_threshold, match_rate_threshold: as Ray's router.
    """

    name = "prefix_approx"

    def __init__(
        self, seed: int = 0, *, imbalanced_threshold: int = 10, match_rate_threshold: float = 0.1
    ) -> None:
        super().__init__(seed)
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self._tree: dict[bytes, set[str]] = {}
        self._tenant_size: dict[str, int] = {}

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> str:
        check_loads(loads)
        queued = [c.queued for c in loads]
        if max(queued) - min(queued) > self.imbalanced_threshold or not self._tree:
            return self._pow2(loads)
        ids = {c.replica_id for c in loads}
        alive, matched = set(ids), 0
        for h in req.block_hashes:
            nxt = alive & self._tree.get(h, set())
            if not nxt:
                break
            alive, matched = nxt, matched + 1
        if req.block_size:
            rate = matched * req.block_size / max(len(req.prompt_token_ids), 1)
        else:
            rate = matched / max(len(req.block_hashes), 1)
        if matched and rate >= self.match_rate_threshold:
            cands = [c for c in loads if c.replica_id in alive]
        else:
            sizes = {c.replica_id: self._tenant_size.get(c.replica_id, 0) for c in loads}
            small = min(sizes.values())
            cands = [c for c in loads if sizes[c.replica_id] == small]
        return self._least_queued(cands)

    def on_routed(self, req: RouteRequest, replica_id: str) -> None:
        tree = self._tree
        added = 0
        for h in req.block_hashes:
            s = tree.get(h)
            if s is None:
                tree[h] = {replica_id}
                added += 1
            elif replica_id not in s:
                s.add(replica_id)
                added += 1
        self._tenant_size[replica_id] = self._tenant_size.get(replica_id, 0) + added

    def forget(self, replica_id: str) -> None:
        self._tenant_size.pop(replica_id, None)
        for h in [h for h, s in self._tree.items() if replica_id in s]:
            s = self._tree[h]
            s.discard(replica_id)
            if not s:
                del self._tree[h]


class KVPrecisePolicy(PolicyBase):
    """Exact prefix hits now, traded against load in one cost (lowest wins).

    For a request of ``n`` blocks and replica ``r``, with ``m_r`` = leading blocks ``r``
    holds now (``PrefixIndex.matched_blocks``, fed by KV events, so evicted blocks no
    longer count) and ``B`` = the running mean of the *uncached* blocks of the requests
    routed so far (``n - m`` at the replica each was sent to, as predicted when it was
    routed: the prefill a queued request brings on average)::

        cost(r) = w_miss * (n - m_r)
                + B * (w_waiting * waiting_r + w_running * running_r + w_kv * kv_usage_r)

    With KV tiers, ``m_r`` is weighted: the leading run of blocks ``r`` holds in any
    medium (``PrefixIndex.matched_media``), a device block counting 1 and a block held
    only in the host / disk tier ``w_host`` / ``w_disk`` (< 1, :class:`CostWeights`).
    Without tier events this is exactly the device count.

    The first term is the prefill work the request itself brings to ``r`` (blocks to
    compute); the second estimates the work already ahead of it there, counting a
    waiting request as one mean-size prefill, a running one as a fraction of it (it
    shares every step) and a full pool as one more. Ties go to the fewest queued
    requests, then at random.

    Why ``B`` counts uncached blocks, not whole prompts: a queued request costs the
    replica only the blocks it must compute; measuring it by the mean prompt length
    over-prices queues exactly when prefix sharing is high (prompt lengths are
    heavy-tailed and their cached share is large), pushing requests away from the
    replica that holds their prefix. In the simulator (docs/benchmarks.md, "Routers at
    scale (simulator)") this raised the hit ratio of the shared-prompt ``rag`` workload
    by 0.8-1.8 points at every N = 2..64 (TTFT p90 within 0.01 s); on Mooncake the
    change is within the spread between policy seeds.

    Where the form comes from: NVIDIA Dynamo's KV router scores a worker by
    ``overlap_weight * prefill_blocks + decode_blocks`` from KV events (Dynamo docs,
    "KV cache routing"); llm-d's inference scheduler sums weighted scorers
    (prefix-cache, queue depth, KV-cache utilization, each normalized to [0, 1]; llm-d
    docs, "precise prefix cache routing"). Ours differs: the load side is in the same
    unit as the hit side (blocks of prefill, via ``B``), so the trade "k cached blocks
    against one queued request" does not depend on which other replicas are candidates
    (llm-d's min-max normalization does), and it needs only the counts a replica
    reports (no router-side prediction of each worker's active blocks, as Dynamo keeps).

    Args:
        index: the KV-event-fed view of the replicas.
        seed: the random tie-break.
        cost: the weights (defaults of :class:`CostWeights`).
    """

    name = "kv_precise"

    def __init__(self, index: PrefixIndex, seed: int = 0, cost: CostWeights | None = None) -> None:
        super().__init__(seed)
        self.index = index
        self.cost = cost or CostWeights()
        self._blocks_sum = 0.0
        self._routed = 0
        #: (request, matched per replica) of the last ``scores`` call, for ``on_routed``
        self._last: tuple[RouteRequest, dict[str, float]] | None = None

    @property
    def mean_blocks(self) -> float:
        """``B``: mean uncached blocks (``n - m`` at the chosen replica, tier-weighted
        as in the cost) of the requests routed so far (1 before the first)."""
        return self._blocks_sum / self._routed if self._routed else 1.0

    def _matched(self, req: RouteRequest) -> dict[str, float]:
        """``m_r`` per replica holding any leading block (tier-weighted)."""
        w = self.cost
        if self.index.has_tiers:
            return {
                rid: sum(w.medium_weight(m) * k for m, k in per.items())
                for rid, per in self.index.matched_media(req.block_hashes).items()
            }
        return dict(self.index.matched_blocks(req.block_hashes))

    def scores(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> dict[str, float]:
        """``cost(r)`` per replica of ``loads`` (the class docstring's formula)."""
        check_loads(loads)
        n = len(req.block_hashes)
        w = self.cost
        matched = self._matched(req)
        self._last = (req, matched)
        b = max(self.mean_blocks, 1.0)
        return {
            c.replica_id: w.miss * (n - matched.get(c.replica_id, 0))
            + b * (w.waiting * c.num_waiting + w.running * c.num_running + w.kv_usage * c.kv_usage)
            for c in loads
        }

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> str:
        sc = self.scores(req, loads)
        best = min(sc.values())
        ties = [c for c in loads if sc[c.replica_id] <= best + 1e-9]
        return self._least_queued(ties)

    def on_routed(self, req: RouteRequest, replica_id: str) -> None:
        last = self._last
        matched = last[1] if last is not None and last[0] is req else self._matched(req)
        self._last = None
        self._blocks_sum += len(req.block_hashes) - matched.get(replica_id, 0)
        self._routed += 1

    def forget(self, replica_id: str) -> None:
        self.index.remove(replica_id)


class OraclePolicy(PolicyBase):
    """The replica holding the longest leading run of the request's blocks according
    to ``lookup`` (exact: the simulator passes a function that reads every replica's
    pool), ties by fewest queued, then at random. Simulator only: a real router cannot
    read remote pools.

    It maximizes each request's own hit, greedily and ignoring load; when every request
    shares a first block (a system prompt), the instances that hold it first attract
    all traffic (herding), so under load its cluster-wide hit ratio and TTFT can be
    worse than ``kv_precise``'s. It bounds one request's hit, not the cluster's (the
    benchmark's ``ideal`` column, one infinite cache, bounds that)."""

    name = "oracle"

    def __init__(self, lookup: Callable[[Sequence[bytes]], dict[str, int]], seed: int = 0) -> None:
        super().__init__(seed)
        self._lookup = lookup

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> str:
        check_loads(loads)
        m = self._lookup(req.block_hashes)
        best = max(m.get(c.replica_id, 0) for c in loads)
        return self._least_queued([c for c in loads if m.get(c.replica_id, 0) == best])


def make_policy(
    name: str,
    *,
    index: PrefixIndex | None = None,
    seed: int = 0,
    cost: CostWeights | None = None,
    lookup: Callable[[Sequence[bytes]], dict[str, int]] | None = None,
) -> RouterPolicy:
    """A policy by name (:data:`POLICY_NAMES`).

    Args:
        name: the policy.
        index: required by ``kv_precise`` (and the default ``lookup`` of ``oracle``).
        seed: seed of the policy's random draws.
        cost: ``kv_precise`` weights (refused for other policies).
        lookup: ``oracle`` only: block hashes -> leading blocks held per replica, exact
            (default ``index.matched_blocks``).

    Raises:
        RoutingError: unknown name, a missing index, or ``cost``/``lookup`` given to a
            policy that does not use it.
    """
    if name not in POLICY_NAMES:
        raise RoutingError(f"router: expected one of {list(POLICY_NAMES)}, got {name!r}")
    if cost is not None and name != "kv_precise":
        raise RoutingError(f"cost: expected only with router 'kv_precise', got router {name!r}")
    if lookup is not None and name != "oracle":
        raise RoutingError(f"lookup: expected only with router 'oracle', got router {name!r}")
    if name == "round_robin":
        return RoundRobinPolicy(seed)
    if name == "power_of_two":
        return PowerOfTwoPolicy(seed)
    if name == "prefix_approx":
        return PrefixApproxPolicy(seed)
    if name == "kv_precise":
        if index is None:
            raise RoutingError("index: expected a PrefixIndex for router 'kv_precise', got None")
        return KVPrecisePolicy(index, seed, cost)
    if lookup is None:
        if index is None:
            raise RoutingError("index: expected a PrefixIndex or a lookup for 'oracle', got None")
        lookup = index.matched_blocks
    return OraclePolicy(lookup, seed)


__all__ = [
    "POLICY_NAMES",
    "CostWeights",
    "KVPrecisePolicy",
    "OraclePolicy",
    "PowerOfTwoPolicy",
    "PrefixApproxPolicy",
    "ReplicaLoad",
    "RoundRobinPolicy",
    "RouteRequest",
    "RouterPolicy",
    "make_policy",
    "route_request",
]
