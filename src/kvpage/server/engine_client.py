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

:class:`ServedEngine` is what the serving layer reads of the engine it serves (the
tokenizer, the cache facts, the scheduler's limits, the generation defaults); three
implement it too: ``kvpage.engine.LLMEngine``, the engine process's handle
(:class:`kvpage.server.engine_spawn.SpawnedEngine`) and the ingress's facade over a
replica's ``info()`` (``kvpage.cluster.ingress``). Which :class:`EngineClient` serves an
engine is decided by its type (:func:`kvpage.server.service.engine_client_for`): an
engine that runs in this process is a :class:`LocalEngine` (driven by the thread loop),
the engine process makes its own client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NotRequired, Protocol, TypeAlias, TypedDict, TypeVar, runtime_checkable

from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.models.tokenizer_base import Tokenizer

__all__ = [
    "EngineClient",
    "EngineFailure",
    "EngineOutput",
    "LocalEngine",
    "PromptInput",
    "ServedCacheSpec",
    "ServedEngine",
    "ServedScheduler",
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


@runtime_checkable
class StepEngine(Protocol):
    """The synchronous engine an engine loop drives on its thread: ``LLMEngine`` (its
    signatures), or a test double with the same methods.

    Attributes:
        failed_request_ids: ids of the user requests failed steps dropped, oldest first
            (the loop fails their streams; ``LLMEngine.failed_request_ids``).
    """

    @property
    def failed_request_ids(self) -> Sequence[str]: ...

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
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


class ServedCacheSpec(Protocol):
    """The KV cache facts the serving layer reads (``kvpage.specs.CacheSpec`` has them):
    ``block_size`` tokens per block; ``num_blocks`` blocks (the reserved null block
    included); ``kv_dtype`` the storage dtype's name; ``total_bytes`` bytes of the pool."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def kv_dtype(self) -> str: ...

    @property
    def total_bytes(self) -> int: ...


class ServedScheduler(Protocol):
    """The scheduler limits the serving layer reads (``kvpage.engine.scheduler.Scheduler``
    has them): ``max_model_len`` tokens configured; ``max_servable_len`` tokens one
    sequence can really reach (``max_model_len``, or less when the KV pool cannot hold
    one sequence that long); ``policy`` ``"fcfs"`` or ``"priority"``."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_servable_len(self) -> int: ...

    @property
    def policy(self) -> str: ...


@runtime_checkable
class ServedEngine(Protocol):
    """The engine a :class:`~kvpage.server.service.ServingState` serves (see the module
    doc for its three implementations).

    Attributes:
        tokenizer: the model's tokenizer (None: a model without one; the server refuses
            to serve it).
        cache_spec: the KV cache facts.
        backend_name: the attention backend's name.
        scheduler: the scheduler's limits.
        default_sampling_params: request defaults read from generation_config.json
            (sampling field -> JSON value; empty: kvpage's own defaults).
        generation_config_path: the folder those came from (None: none).
    """

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def cache_spec(self) -> ServedCacheSpec: ...

    @property
    def backend_name(self) -> str: ...

    @property
    def scheduler(self) -> ServedScheduler: ...

    @property
    def default_sampling_params(self) -> Mapping[str, Any]: ...

    @property
    def generation_config_path(self) -> str | None: ...

    def get_metrics(self) -> Mapping[str, float]:
        """The engine's counters and gauges (name -> value) as of now."""
        ...


@runtime_checkable
class LocalEngine(ServedEngine, StepEngine, Protocol):
    """An engine that runs in this process (``LLMEngine``): served through the thread
    loop (:class:`kvpage.server.engine_loop.AsyncEngine`)."""
