"""The ingress side of a request: an engine loop whose engine is a replica group.

:class:`RemoteEngineLoop` is a :class:`kvpage.server.engine_client.EngineClient`, so the server's :class:`~kvpage.server.service.ServingState` -- validation, admission,
stop strings, streaming, metrics -- runs unchanged at the ingress; only where the
engine runs differs. ``add`` picks the replica group (:meth:`GroupSelector.select`),
sends the request through the group's deployment handle (the custom router picks the
replica) and returns once the replica produced its first output, so refusals and
failures before the first token are answered as by the single server.

Faults: if the replica fails (its actor died, the call was lost) before any byte of
the request reached its client -- before its first output, or at any point of a
non-streamed request (``add(..., replayable=True)``: its outputs are cumulative and the
server sends nothing before the last) -- the request is sent again, once, to another
replica of the group (``route["exclude"]``), counted in
``kvpage:router_retries_total``; a replayed request's outputs start again from its
first token (the server keeps only the final text). A streamed request that fails after
its first output ends with an :class:`~kvpage.server.engine_loop.EngineFailure` naming
the replica, which the server turns into a clean error event; a failure of the second
attempt is a 503 (before any output) or a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvpage.cluster.core import RouterCore
from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.errors import RequestRejected
from kvpage.server.engine_client import EngineFailure, EngineOutput, PromptInput
from kvpage.server.protocol import APIError

__all__ = ["GroupSelector", "IngressObserver", "RemoteEngineLoop", "ReplicaGroup"]

logger = logging.getLogger("kvpage.cluster")

_T = TypeVar("_T")


@dataclass
class ReplicaGroup:
    """A group as the ingress sees it: its deployment handle and router state."""

    name: str
    handle: Any
    core: RouterCore
    block_size: int


@dataclass
class GroupSelector:
    """Which group serves a request.

    Prompts of at least ``long_threshold`` tokens go to ``long_context`` (when that
    group exists); of the others, a ``canary_fraction`` share (a seeded draw per
    request) goes to ``canary``; the rest to ``default``. ``canary_fraction`` may be
    changed at any time (it applies to requests arriving afterwards; requests in flight
    finish where they are).

    :meth:`route` then checks the chosen group's limits (``limits``): a request that
    group cannot take (prompt + ``max_tokens`` above its ``max_model_len``, ``n`` above
    its ``max_num_seqs``) goes to the first of ``default``, ``long_context``, ``canary``
    that can (a fallback, counted by the ingress); one that fits no group goes to
    ``default`` (or ``long_context`` when chosen by the prompt length), whose engine
    refuses it as the single server does. So the answer never depends on the draw.
    """

    groups: frozenset[str]
    long_threshold: int | None = None
    canary_fraction: float = 0.0
    seed: int = 0
    #: group -> (max_model_len, max_num_seqs), from the replicas' ``info()`` (set by
    #: the ingress); a group without an entry takes any request
    limits: dict[str, tuple[int, int]] = field(default_factory=dict)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def select(self, num_prompt_tokens: int) -> str:
        """The group name for a prompt of ``num_prompt_tokens`` tokens."""
        if (
            self.long_threshold is not None
            and "long_context" in self.groups
            and num_prompt_tokens >= self.long_threshold
        ):
            return "long_context"
        if (
            "canary" in self.groups
            and self.canary_fraction > 0.0
            and self._rng.random() < self.canary_fraction
        ):
            return "canary"
        return "default"

    def fits(self, group: str, num_prompt_tokens: int, max_tokens: int, n: int) -> bool:
        """Whether ``group``'s engines can take the request (see ``limits``)."""
        lim = self.limits.get(group)
        if lim is None:
            return True
        max_len, max_seqs = lim
        return num_prompt_tokens + max(1, max_tokens) <= max_len and n <= max_seqs

    def route(self, num_prompt_tokens: int, max_tokens: int = 1, n: int = 1) -> tuple[str, str]:
        """``(group, drawn)``: the group that serves the request and the one the rules
        chose (:meth:`select`); they differ when ``drawn`` cannot take it (a fallback)."""
        drawn = self.select(num_prompt_tokens)
        if self.fits(drawn, num_prompt_tokens, max_tokens, n):
            return drawn, drawn
        for g in ("default", "long_context", "canary"):
            if g in self.groups and self.fits(g, num_prompt_tokens, max_tokens, n):
                return g, drawn
        return ("default" if drawn == "canary" else drawn), drawn


@dataclass
class _Attempt:
    """One try of a request on a replica group (:meth:`RemoteEngineLoop._stream`):
    where its outputs go and whether any was sent yet."""

    group: ReplicaGroup
    request_id: str
    arrival: float | None
    q: asyncio.Queue[EngineOutput]
    ack: asyncio.Future[None]
    got_any: bool = False


def _prompt_parts(prompt: PromptInput) -> tuple[list[int], str | None]:
    if isinstance(prompt, dict):
        return list(prompt["prompt_token_ids"]), prompt.get("cache_salt")
    return list(prompt), None


def _shift_times(out: RequestOutput, arrival: float | None) -> RequestOutput:
    """Put the replica's (monotonic) timestamps on the ingress's clock: the replica's
    arrival becomes the ingress's arrival (clocks of two hosts are not comparable)."""
    if arrival is None:
        return out
    delta = arrival - out.arrival_time
    if out.first_scheduled_time is not None:
        out.first_scheduled_time += delta
    if out.first_token_time is not None:
        out.first_token_time += delta
    if out.finish_time is not None:
        out.finish_time += delta
    out.arrival_time = arrival
    return out


class IngressObserver(Protocol):
    """What a :class:`RemoteEngineLoop` reports (the ingress's ``ClusterMetrics``)."""

    def request(self, group: str) -> None: ...

    def fallback(self, drawn: str, group: str) -> None: ...

    def retry(self, group: str) -> None: ...

    def failure(self, group: str) -> None: ...

    def hits(self, group: str, predicted: int, actual: int) -> None: ...


class _Unobserved:
    """No observer (yet): the reports go nowhere."""

    def request(self, group: str) -> None:
        pass

    def fallback(self, drawn: str, group: str) -> None:
        pass

    def retry(self, group: str) -> None:
        pass

    def failure(self, group: str) -> None:
        pass

    def hits(self, group: str, predicted: int, actual: int) -> None:
        pass


class RemoteEngineLoop:
    """An ``AsyncEngine`` stand-in whose engine is a set of replica groups.

    Args:
        groups: name -> :class:`ReplicaGroup`.
        selector: the group choice.
        observer: receives ``request``, ``fallback``, ``retry``, ``failure`` and
            ``hits`` reports (:class:`IngressObserver`: the ingress metrics; None:
            nobody, until ``observer`` is set).
        on_first_output: called with ``(group, replica_id)`` when a request's first
            output arrives (the ingress pulls that replica's KV events then).

    Attributes:
        metrics_snapshot: engine counters summed over replicas (``*_total`` only; see
            :class:`kvpage.cluster.ingress.ClusterState`), refreshed by the ingress.
    """

    def __init__(
        self,
        groups: dict[str, ReplicaGroup],
        selector: GroupSelector,
        observer: IngressObserver | None,
        on_first_output: Callable[[str, str], None] | None = None,
    ) -> None:
        self.groups = groups
        self.selector = selector
        self.observer: IngressObserver = _Unobserved() if observer is None else observer
        self._on_first = on_first_output
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: request id -> {"group", "replica"} until the server takes it (metrics labels)
        self._placements: dict[str, dict[str, str]] = {}
        self._running = False
        self.metrics_snapshot: dict[str, float] = {}

    # ------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Mark the loop running (the replicas run their own engine loops)."""
        self._loop = loop
        self._running = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel every request in flight (their replicas abort them); callable from
        any thread."""
        self._running = False
        loop = getattr(self, "_loop", None)
        if loop is None or loop.is_closed():
            return

        def cancel_all() -> None:
            for t in list(self._tasks.values()):
                t.cancel()

        loop.call_soon_threadsafe(cancel_all)

    @property
    def running(self) -> bool:
        """Whether the ingress accepts requests."""
        return self._running

    # ------------------------------------------------------------ handler API
    async def add(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        replayable: bool = False,
    ) -> asyncio.Queue[EngineOutput]:
        """Send a request to a replica; return the queue its outputs arrive on (the
        first one is already there). ``priority`` goes to the replica's scheduler as in
        :meth:`AsyncEngine.add <kvpage.server.engine_loop.AsyncEngine.add>`.

        Raises:
            RequestRejected: the replica's engine refused it.
            APIError: 503 when no replica could take it (after the one retry).

        ``replayable``: no output reaches the client before the request finishes (not
        streamed), so a replica failure after outputs were produced is retried too.
            RuntimeError: the loop is not running.
        """
        if not self._running:
            raise RuntimeError("engine loop: expected a running loop, got a stopped one")
        ids, _ = _prompt_parts(prompt)
        name, drawn = self.selector.route(
            len(ids), int(getattr(params, "max_tokens", 1) or 1), int(getattr(params, "n", 1))
        )
        group = self.groups[name]
        self._placements[request_id] = {"group": name}
        self.observer.request(group.name)
        if name != drawn:
            self.observer.fallback(drawn, name)
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(
            self._run(group, request_id, prompt, params, arrival_time, priority, q, ack, replayable)
        )
        self._tasks[request_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(request_id, None))
        try:
            await asyncio.shield(ack)
        except asyncio.CancelledError:
            task.cancel()
            raise
        return q

    def take_placement(self, request_id: str) -> dict[str, str] | None:
        """``{"group", "replica"}`` of ``request_id`` (``replica`` once a replica produced
        its first output, or the one that failed it), forgotten here; the server takes it
        once :meth:`add` returned or raised, when it no longer changes."""
        return self._placements.pop(request_id, None)

    def _place(self, request_id: str, replica: str) -> None:
        p = self._placements.get(request_id)
        if p is not None:
            p["replica"] = replica

    def abort_nowait(self, request_id: str) -> None:
        """Cancel ``request_id``'s call (its replica aborts it); never blocks."""
        t = self._tasks.pop(request_id, None)
        if t is not None:
            t.cancel()

    async def abort(self, request_id: str) -> None:
        """Cancel ``request_id`` and wait until its call has ended."""
        t = self._tasks.pop(request_id, None)
        if t is not None:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def call(self, fn: Callable[[Any], _T]) -> _T:
        """Not available: there is no local engine.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("engine loop: expected a local engine, got replica groups")

    # ------------------------------------------------------------ one request
    async def _run(
        self,
        group: ReplicaGroup,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival: float | None,
        priority: int,
        q: asyncio.Queue[EngineOutput],
        ack: asyncio.Future[None],
        replayable: bool = False,
    ) -> None:
        ids, salt = _prompt_parts(prompt)
        exclude: list[str] = []
        try:
            for attempt in range(2):
                route = {
                    "request_id": request_id,
                    "prompt_token_ids": ids,
                    "cache_salt": salt,
                    "exclude": exclude,
                }
                run = _Attempt(group, request_id, arrival, q, ack)
                try:
                    await self._stream(run, prompt, params, route, priority)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    where = self._replica_failed(group, request_id)
                    if (not run.got_any or replayable) and attempt == 0:
                        logger.warning(
                            "kvpage ingress: replica %s of group %s failed %s of %s (%s); "
                            "retrying on another replica",
                            where,
                            group.name,
                            "during the non-streamed run" if run.got_any else "before the first output",
                            request_id,
                            type(exc).__name__,
                        )  # fmt: skip
                        self.observer.retry(group.name)
                        exclude = [where]
                        continue
                    first = str(exc).splitlines()[0][:200] if str(exc) else ""
                    msg = f"replica {where} of group {group.name} failed ({type(exc).__name__}: {first})"  # fmt: skip
                    self._fail(q, ack, EngineFailure(msg))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of ours: fail the request, never leave add() waiting
            logger.exception("kvpage ingress: request %s failed in the ingress", request_id)
            self._fail(q, ack, EngineFailure(f"ingress: {type(exc).__name__}: {exc}"[:300]))
        finally:
            group.core.finished(request_id)

    async def _stream(
        self,
        run: _Attempt,
        prompt: PromptInput,
        params: SamplingParams,
        route: dict[str, Any],
        priority: int,
    ) -> None:
        """One attempt: stream the replica's outputs into ``run.q`` until the request
        ends, is rejected or fails by the replica's own report (all returned); a
        transport or replica crash raises (``run.got_any`` says whether output was
        already sent)."""
        group, request_id, q, ack = run.group, run.request_id, run.q, run.ack
        gen = group.handle.options(stream=True).generate.remote(
            request_id, prompt, params, route=route, priority=priority
        )
        try:
            async for item in gen:
                if isinstance(item, dict):
                    if "rejected" in item:
                        ack.set_exception(RequestRejected(item["rejected"], reason=item["reason"]))
                    else:
                        self._fail(q, ack, EngineFailure(item["failure"], item["oom"]))
                    return
                out = _shift_times(item, run.arrival)
                if not run.got_any:
                    run.got_any = True
                    self._first_output(group, request_id)
                q.put_nowait(out)
                if not ack.done():
                    ack.set_result(None)
                if out.finished:
                    self._record_hits(group, request_id, out)
                    return
            self._fail(q, ack, EngineFailure("replica: stream ended without a result"))
        except asyncio.CancelledError:
            gen.cancel()
            raise

    def _first_output(self, group: ReplicaGroup, request_id: str) -> None:
        """Place the request on the replica the router chose, and tell ``on_first``."""
        d = group.core.decisions.get(request_id)
        if d is not None:
            self._place(request_id, d.replica_id)
            if self._on_first is not None:
                self._on_first(group.name, d.replica_id)

    def _replica_failed(self, group: ReplicaGroup, request_id: str) -> str:
        """A replica failed the request: release its routing decision, count the
        failure; returns the replica's id ("?" when unknown)."""
        d = group.core.finished(request_id)
        where = d.replica_id if d is not None else "?"
        if d is not None:
            self._place(request_id, where)
        self.observer.failure(group.name)
        return where

    @staticmethod
    def _fail(
        q: asyncio.Queue[EngineOutput], ack: asyncio.Future[None], failure: EngineFailure
    ) -> None:
        if ack.done():
            q.put_nowait(failure)
            return
        ack.set_exception(
            APIError(
                503,
                f"replicas: expected one to run the request, got a failure ({failure})",
                type="server_error",
                code="replica_unavailable",
                headers={"Retry-After": "1"},
                reason="replica_unavailable",
            )
        )

    def _record_hits(self, group: ReplicaGroup, request_id: str, out: RequestOutput) -> None:
        d = group.core.decisions.get(request_id)
        if d is None:
            return
        actual = int(out.num_cached_tokens) // max(1, group.block_size)
        self.observer.hits(group.name, d.predicted_blocks, actual)
