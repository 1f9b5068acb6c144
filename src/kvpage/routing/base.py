"""What every router policy shares: the request and load types, the block keys, the
:class:`RouterPolicy` protocol and the base class of the built-in policies
(:mod:`kvpage.routing.policies` has the policies themselves)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpage.cache import hash_request_blocks
from kvpage.routing.events import RoutingError


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as the router sees it when choosing.

    Attributes:
        replica_id: the replica.
        num_running: requests in its running batch.
        num_waiting: requests queued, not yet admitted (includes ones routed to it and
            not yet seen by its scheduler).
        kv_usage: fraction of its KV blocks held by requests, in [0, 1].
    """

    replica_id: str
    num_running: int
    num_waiting: int
    kv_usage: float

    @property
    def queued(self) -> int:
        """``num_running + num_waiting``: Ray Serve's queue length of a replica."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy knows of a request.

    Attributes:
        prompt_token_ids: the prompt's token ids.
        block_hashes: the prompt's chained block hashes, block 0 first (from
            :func:`route_request`, i.e. ``kvpage.cache.hash_request_blocks`` with the
            engine's block size, hash seed, cache_salt and adapter).
        block_size: tokens per block of ``block_hashes`` (0 = not given; then
            ``prefix_approx`` assumes the hashes cover the whole prompt).
    """

    prompt_token_ids: Sequence[int]
    block_hashes: Sequence[bytes]
    block_size: int = 0


def route_request(
    prompt_token_ids: Sequence[int],
    *,
    block_size: int,
    cache_salt: str | None = None,
    adapter_id: str | None = None,
    hash_seed: int = 0,
) -> RouteRequest:
    """A :class:`RouteRequest` with the engine's block keys.

    Args:
        prompt_token_ids: the prompt.
        block_size: the replicas' KV block size (tokens).
        cache_salt, adapter_id, hash_seed: as the engine uses them for this request
            (``kvpage.cache.hash_request_blocks``); different values give disjoint keys.

    Raises:
        SpecError: ``block_size < 1``, a token id outside int64 or a bad seed.
    """
    hashes = hash_request_blocks(
        prompt_token_ids,
        block_size,
        cache_salt=cache_salt,
        adapter_id=adapter_id,
        hash_seed=hash_seed,
    )
    return RouteRequest(prompt_token_ids, hashes, block_size)


class RouterPolicy(Protocol):
    """A routing policy (module docstring). ``choose`` must not mutate its inputs."""

    name: str

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> str:
        """The replica id (one of ``loads``) to send ``req`` to.

        Raises:
            RoutingError: ``loads`` is empty.
        """
        ...

    def on_routed(self, req: RouteRequest, replica_id: str) -> None:
        """Told after ``req`` was sent to ``replica_id``."""
        ...

    def forget(self, replica_id: str) -> None:
        """Drop any per-replica state of a dead / removed replica."""
        ...


def check_loads(loads: Sequence[ReplicaLoad]) -> None:
    if not loads:
        raise RoutingError("loads: expected at least one replica, got none")


class PolicyBase:
    name = ""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def on_routed(self, req: RouteRequest, replica_id: str) -> None:
        return None

    def forget(self, replica_id: str) -> None:
        return None

    def _least_queued(self, cands: Sequence[ReplicaLoad]) -> str:
        """The candidate with the fewest queued requests, ties at random."""
        best = min(c.queued for c in cands)
        ties = [c for c in cands if c.queued == best]
        return ties[0].replica_id if len(ties) == 1 else self._rng.choice(ties).replica_id

    def _pow2(self, loads: Sequence[ReplicaLoad]) -> str:
        if len(loads) <= 2:
            return self._least_queued(loads)
        return self._least_queued(self._rng.sample(list(loads), 2))


__all__ = [
    "PolicyBase",
    "ReplicaLoad",
    "RouteRequest",
    "RouterPolicy",
    "check_loads",
    "route_request",
]
