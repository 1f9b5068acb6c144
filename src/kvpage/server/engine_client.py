"""The contract between the serving layer and whatever runs the engine.

:class:`~kvpage.server.service.ServingState` holds one :class:`EngineClient`; three
implement it:

- :class:`kvpage.server.engine_loop.AsyncEngine`: the engine in a thread of the server;
- :class:`kvpage.server.engine_process.ProcessAsyncEngine`: the engine in a child
  process, commands and outputs over a socket;
- :class:`kvpage.cluster.remote.RemoteEngineLoop`: the scaled-out ingress, the engine
  being a set of Ray Serve replica groups.

Outputs of a request arrive on an ``asyncio.Queue`` returned by :meth:`EngineClient.add`:
each item is a cumulative :class:`~kvpage.engine.params.RequestOutput` (the last one has
``finished=True``) or an :class:`EngineFailure` (then no more
items follow).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, NotRequired, Protocol, TypeAlias, TypedDict, TypeVar, runtime_checkable

from kvpage.engine.params import RequestOutput, SamplingParams

__all__ = [
    "EngineClient",
    "EngineFailure",
    "EngineOutput",
    "PromptInput",
    "StepEngine",
    "TokensPrompt",
]

_T = TypeVar("_T")


class TokensPrompt(TypedDict):
    """A tokenized prompt with the options that travel with it.

    ``cache_salt``: isolates the request's prefix-cache entries (blocks are shared only
    between requests with the same salt).
    """

    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


class EngineFailure(RuntimeError):
    """Delivered to a request's stream when an engine step raised.

    Attributes:
        oom: the step ran out of device or host memory (see :func:`kvpage.server.engine_loop.is_out_of_memory`).
    """

    def __init__(self, message: str, oom: bool = False) -> None:
        super().__init__(message)
        self.oom = oom

    def __reduce__(self) -> tuple[object, ...]:
        return (EngineFailure, (str(self), self.oom))


#: what the serving layer sends as a prompt: token ids (the server tokenizes)
PromptInput: TypeAlias = list[int] | TokensPrompt
#: one item of a request's output queue
EngineOutput: TypeAlias = RequestOutput | EngineFailure


class StepEngine(Protocol):
    """The synchronous engine an engine loop drives on its thread: ``LLMEngine`` (its
    signatures), or a test double with the same methods. The loop reads the optional
    ``failed_request_ids`` (ids of the requests a failed step dropped) with ``getattr``.
    """

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def get_metrics(self) -> Mapping[str, float]: ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the HTTP handlers see it (one event loop; see module doc).

    Attributes:
        metrics_snapshot: the latest engine counters and gauges (name -> value),
            replaced whole, never mutated in place.
    """

    @property
    def metrics_snapshot(self) -> Mapping[str, float]: ...

    @property
    def running(self) -> bool:
        """Whether requests are accepted (the engine side is alive and started)."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin serving; outputs are delivered on ``loop``.

        Raises:
            RuntimeError: already started.
        """
        ...

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop (bounded by ``timeout_s`` seconds); live requests are aborted and their
        handlers get an :class:`EngineFailure`. Callable from
        any thread; a no-op when stopped."""
        ...

    async def add(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        replayable: bool = False,
    ) -> asyncio.Queue[EngineOutput]:
        """Queue a request; return the queue its outputs arrive on.

        Args:
            request_id: unique among unfinished requests.
            prompt: token ids, or :class:`TokensPrompt`.
            params: the request's sampling parameters.
            arrival_time: ``time.monotonic()`` seconds when the server received it.
            priority: the scheduler priority (lower runs first; 0 with ``fcfs``).
            replayable: no output reaches the client before the request finishes (not
                streamed): the implementation may deliver only the outputs that change
                what a non-streamed handler keeps, and may run the request again after
                a failure.

        Raises:
            RequestRejected: the engine refused the request (no state changed).
            APIError: 503 when no engine could take it (the ingress).
            RuntimeError: not running.
        """
        ...

    def abort_nowait(self, request_id: str) -> None:
        """Abort ``request_id`` (a no-op when it finished); never blocks, safe from a
        cancelled task."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` and wait until the engine freed its blocks."""
        ...

    async def call(self, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(engine)`` where the engine lives, between steps; return its result.

        Raises:
            RuntimeError: there is no single engine to run it on (the ingress).
        """
        ...
