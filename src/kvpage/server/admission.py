"""Admission control by token budget: per-tenant token buckets and a KV-pressure budget.

Everything here is plain Python, driven from the server's event loop (single thread);
the clock is an argument (``now``, seconds, monotonic) so tests can drive it.

* :class:`TokenBucket` — the classic token bucket (refill ``rate`` tokens/s up to
  ``burst``); a request of cost C passes when the bucket holds at least C tokens.
* :class:`TenantLimiter` — one bucket per tenant, created lazily from the config; at
  most ``max_tenants`` buckets are kept (least recently used evicted), so client-chosen
  tenant labels cannot grow the server without bound.
* :class:`TenantSequences` — how many admitted, unfinished sequences (``n`` per
  prompt) each tenant holds, capped per tenant, so one tenant's fan-out cannot fill the
  engine's queue ahead of the others.
* :class:`KVBudget` — reservations of KV blocks by admitted, unfinished requests;
  ``projected_usage(extra)`` is the share of the pool they may hold at their maximum
  length. Long-context requests that would push it over the high-water mark wait in a
  bounded queue (by ``(priority, arrival)`` under the ``priority`` scheduling policy,
  FIFO under ``fcfs``) or are refused; short ones always pass this check.
* :class:`PrioritySlots` — the degraded mode's long-context slots, served in the same
  order.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass

from kvpage.server.config import AdmissionConfig, TenantLimit

__all__ = [
    "Decision",
    "KVBudget",
    "PrioritySlots",
    "TenantLimiter",
    "TenantSequences",
    "TokenBucket",
]


@dataclass(frozen=True)
class Decision:
    """Outcome of an admission check.

    Attributes:
        ok: admitted.
        reason: machine-readable refusal reason (``"tenant_rate_limit"``,
            ``"cost_exceeds_burst"``, ``"kv_pressure"``, ``"queue_full"``) or ``""``.
        retry_after_s: whole seconds after which a retry may pass (None: never).
        message: human-readable explanation ("name: expected X, got Y").
    """

    ok: bool
    reason: str = ""
    retry_after_s: int | None = None
    message: str = ""


class TokenBucket:
    """A token bucket holding at most ``burst`` tokens, refilled at ``rate`` tokens/s.

    Starts full. State: ``tokens`` (float) and the time of the last refill.
    """

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket: expected rate > 0 and burst > 0, got {rate}, {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self._last = now

    def _refill(self, now: float) -> None:
        if now > self._last:
            self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
            self._last = now

    def try_take(self, cost: float, now: float) -> Decision:
        """Take ``cost`` tokens if available; otherwise change nothing but the refill.

        Returns:
            ``Decision(ok=True)`` or a refusal with ``retry_after_s`` = seconds until the
            bucket holds ``cost`` tokens (``None`` when ``cost > burst``: never).
        """
        self._refill(now)
        if cost > self.burst:
            return Decision(
                False,
                "cost_exceeds_burst",
                None,
                f"request cost: expected at most the tenant burst of {self.burst:g} tokens, "
                f"got {cost:g} (prompt tokens + n * max_tokens; an unset max_tokens counts "
                "as its default, 16 for completions and the room left in the context for "
                "chat: send a smaller max_tokens)",
            )
        if self.tokens >= cost:
            self.tokens -= cost
            return Decision(True)
        wait = (cost - self.tokens) / self.rate
        return Decision(
            False,
            "tenant_rate_limit",
            max(1, math.ceil(wait)),
            f"tenant token budget: expected {cost:g} tokens available, got {self.tokens:.0f} "
            f"(refill {self.rate:g} tokens/s)",
        )

    def refund(self, cost: float, now: float) -> None:
        """Give back ``cost`` tokens (a request admitted here was refused later)."""
        self._refill(now)
        self.tokens = min(self.burst, self.tokens + cost)


class TenantLimiter:
    """Per-tenant token buckets configured by :class:`AdmissionConfig`.

    Tenants listed in ``config.tenants`` (or ``extra_limits``, e.g. from the API keys
    file) get their own limit; others get ``config.default_limit``; with neither, a
    tenant is unlimited.

    Args:
        config: the admission section.
        extra_limits: more per-tenant limits (take precedence over ``config.tenants``).
        max_tenants: most buckets kept; the least recently used is dropped beyond it
            (a dropped tenant starts again with a full bucket). With authentication the
            tenants are the configured ones, so the cap is never reached.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        extra_limits: dict[str, TenantLimit] | None = None,
        max_tenants: int = 4096,
    ) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants: expected >= 1, got {max_tenants}")
        self._config = config
        self._limits = {**config.tenants, **(extra_limits or {})}
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.max_tenants = max_tenants

    @property
    def num_tenants(self) -> int:
        """Buckets currently held."""
        return len(self._buckets)

    def _limit(self, tenant: str) -> TenantLimit | None:
        return self._limits.get(tenant, self._config.default_limit)

    def try_take(self, tenant: str, cost: int, now: float) -> Decision:
        """Charge ``cost`` tokens to ``tenant``'s bucket (see :meth:`TokenBucket.try_take`)."""
        limit = self._limit(tenant)
        if limit is None:
            return Decision(True)
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(limit.rate, limit.burst, now)
            while len(self._buckets) > self.max_tenants:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(tenant)
        return bucket.try_take(cost, now)

    def refund(self, tenant: str, cost: int, now: float) -> None:
        """Refund ``cost`` tokens to ``tenant`` (no-op for unlimited tenants)."""
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.refund(cost, now)


class TenantSequences:
    """Admitted, unfinished sequences per tenant, at most ``cap`` each.

    Args:
        cap: the most sequences one tenant may hold at once (None: no cap; counted
            anyway).
        retry_after_s: the ``Retry-After`` of a refusal (when sequences finish is not
            known in advance).

    State: ``held`` (tenant -> sequences; a tenant holding none has no entry, so the
    map is bounded by the requests in flight). Call from the event loop thread.
    """

    def __init__(self, cap: int | None, retry_after_s: int) -> None:
        if cap is not None and cap < 1:
            raise ValueError(f"max_inflight_sequences_per_tenant: expected >= 1, got {cap}")
        self.cap = cap
        self.retry_after_s = retry_after_s
        self.held: dict[str, int] = {}

    def try_hold(self, tenant: str, sequences: int) -> Decision:
        """Hold ``sequences`` for ``tenant`` if its total stays within the cap.

        Returns:
            ``Decision(ok=True)``, or ``tenant_concurrency`` (``retry_after_s``; None when
            ``sequences`` alone exceed the cap: waiting cannot help).
        """
        held = self.held.get(tenant, 0)
        if self.cap is not None and held + sequences > self.cap:
            return Decision(
                False,
                "tenant_concurrency",
                self.retry_after_s if sequences <= self.cap else None,
                f"tenant sequences in flight: expected at most {self.cap} "
                f"(admission.max_inflight_sequences_per_tenant), got {held} held + "
                f"{sequences} asked (n x prompts)",
            )
        self.held[tenant] = held + sequences
        return Decision(True)

    def release(self, tenant: str, sequences: int) -> None:
        """Give back what :meth:`try_hold` took."""
        left = self.held.get(tenant, 0) - sequences
        if left < 0:
            raise AssertionError(f"tenant sequences: {tenant!r} went negative ({left})")
        if left:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)


def _wait_key(policy: str, priority: int, order: int) -> tuple[int, int]:
    """The service order of a waiter: ``(priority, arrival)`` under the ``priority``
    scheduling policy (lower first, FCFS among equals, as the engine's queue), plain
    arrival order under ``fcfs``."""
    return (priority if policy == "priority" else 0, order)


class KVBudget:
    """Global admission budget tied to KV pressure.

    Args:
        num_blocks: usable blocks in the pool (the null block excluded).
        block_size: tokens per block.
        config: high-water mark, long-context threshold, queue policy.
        policy: the engine's scheduling policy: ``"priority"`` serves the queue of
            waiting long requests by ``(priority, arrival)``, ``"fcfs"`` by arrival.

    State: ``reserved_blocks`` (sum of active reservations) and the waiters with their
    keys. All methods must be called from the event loop thread.
    """

    def __init__(
        self, num_blocks: int, block_size: int, config: AdmissionConfig, policy: str = "fcfs"
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"kv budget: expected num_blocks, block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.config = config
        self.policy = policy
        self.reserved_blocks = 0
        #: waiter -> its key (woken waiters stay until they resume, holding their place)
        self._waiters: dict[asyncio.Future[None], tuple[int, int]] = {}
        self._order = itertools.count()

    def blocks_for(self, prompt_tokens: int, max_tokens: int, n: int) -> int:
        """Upper bound of blocks a request may hold: ``n * ceil((prompt + max) / block_size)``."""
        return n * -(-(prompt_tokens + max_tokens) // self.block_size)

    def projected_usage(self, extra_blocks: int = 0) -> float:
        """Share of the pool reserved if ``extra_blocks`` more were reserved."""
        return (self.reserved_blocks + extra_blocks) / self.num_blocks

    @property
    def num_queued(self) -> int:
        """Long-context requests waiting for KV budget."""
        return sum(1 for w in self._waiters if not w.done())

    def is_long(self, prompt_tokens: int) -> bool:
        """Whether a prompt counts as long-context (``>= long_prompt_tokens``)."""
        return prompt_tokens >= self.config.long_prompt_tokens

    def _fits(self, blocks: int) -> bool:
        # An empty server always admits (the engine itself refuses what can never fit).
        return (
            self.reserved_blocks == 0 or self.projected_usage(blocks) <= self.config.kv_high_water
        )

    async def acquire(self, prompt_tokens: int, blocks: int, priority: int = 0) -> Decision:
        """Reserve ``blocks`` for a request, waiting or refusing under KV pressure.

        Short requests reserve at once. A long request reserves at once if no waiter
        comes before it (by key: ``(priority, arrival)`` under the ``priority`` policy,
        arrival under ``fcfs``) and the projection stays at or under the high-water
        mark (or nothing is reserved); otherwise it is refused (``reject`` policy, full
        queue) or waits up to ``queue_timeout_s``. Waiters are served strictly by key:
        a release wakes the first, and one that still does not fit keeps its place
        (the ones behind it wait too, so a large urgent request is not starved by
        smaller later ones). A cancelled waiter reserves nothing and passes a wake-up
        it received on.
        """
        cfg = self.config
        key = _wait_key(self.policy, priority, next(self._order))
        if not self.is_long(prompt_tokens):
            self.reserved_blocks += blocks
            return Decision(True)
        first_key = min(self._waiters.values(), default=None)
        if (first_key is None or key < first_key) and self._fits(blocks):
            self.reserved_blocks += blocks
            return Decision(True)
        refusal = Decision(
            False,
            "kv_pressure",
            cfg.retry_after_s,
            f"projected KV usage: expected at most {cfg.kv_high_water:.2f} for a long-context "
            f"request, got {self.projected_usage(blocks):.2f}",
        )
        if cfg.kv_pressure_action == "reject" or cfg.queue_timeout_s <= 0:
            return refusal
        if self.num_queued >= cfg.max_queued:
            return Decision(
                False,
                "queue_full",
                cfg.retry_after_s,
                f"long-context queue: expected fewer than {cfg.max_queued} waiting, "
                f"got {self.num_queued}",
            )
        return await self._wait_in_queue(key, blocks, refusal)

    async def _wait_in_queue(
        self, key: tuple[int, int], blocks: int, refusal: Decision
    ) -> Decision:
        """Wait in the queue under ``key`` until ``blocks`` fit at a wake-up (reserve
        them, wake the next waiter) or ``queue_timeout_s`` passes (``refusal``); a
        cancelled waiter that was woken passes the wake-up on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout_s
        while True:
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters[fut] = key  # the same key again after a wake: the same place
            try:
                await asyncio.wait_for(fut, timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return refusal
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._waiters.pop(fut, None)
                    self._wake()  # woken, then cancelled: the next waiter may fit
                raise
            finally:
                self._waiters.pop(fut, None)
            if self._fits(blocks):
                self.reserved_blocks += blocks
                self._wake()  # the next waiter may fit too
                return Decision(True)
            if loop.time() >= deadline:
                return refusal

    def release(self, blocks: int) -> None:
        """Return a reservation and wake the first waiter."""
        self.reserved_blocks -= blocks
        if self.reserved_blocks < 0:
            raise AssertionError(
                f"kv budget: reserved blocks went negative ({self.reserved_blocks})"
            )
        self._wake()

    def _wake(self) -> None:
        live = [(k, w) for w, k in self._waiters.items() if not w.done()]
        if live:
            min(live, key=lambda kw: kw[0])[1].set_result(None)


class PrioritySlots:
    """A counting semaphore whose waiters get a freed slot by key (``(priority,
    arrival)`` under the ``priority`` policy, arrival under ``fcfs``): the degraded
    mode's long-context slots. A release hands the slot to the first waiter directly,
    so a later arrival cannot take it in between.

    Args:
        value: the number of slots (>= 1).
        policy: ``"priority"`` or ``"fcfs"``.

    All methods must be called from the event loop thread.
    """

    def __init__(self, value: int, policy: str = "fcfs") -> None:
        if value < 1:
            raise ValueError(f"slots: expected >= 1, got {value}")
        self.free = value
        self.policy = policy
        self._waiters: dict[asyncio.Future[None], tuple[int, int]] = {}
        self._order = itertools.count()

    @property
    def num_waiting(self) -> int:
        """Waiters not yet handed a slot."""
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot, waiting behind every waiter with a smaller key. Cancelled (e.g.
        by ``asyncio.wait_for``'s timeout), it takes none (a slot handed to it in the
        meantime goes to the next waiter)."""
        key = _wait_key(self.policy, priority, next(self._order))
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[fut] = key
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._waiters.pop(fut, None)
                self.release()  # handed a slot, then cancelled: pass it on
            raise
        finally:
            self._waiters.pop(fut, None)

    def release(self) -> None:
        """Give a slot back: to the first waiter if any, else to the free count."""
        live = [(k, w) for w, k in self._waiters.items() if not w.done()]
        if live:
            w = min(live, key=lambda kw: kw[0])[1]
            del self._waiters[w]
            w.set_result(None)
        else:
            self.free += 1
