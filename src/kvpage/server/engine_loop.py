"""The background engine loop: one thread owns the engine; HTTP handlers talk to it.

The engine is not thread-safe, so exactly one thread (``kvpage-engine``) calls it.
Handlers on the asyncio event loop send commands (add, abort, call) through a
thread-safe queue; the engine thread applies all pending commands between steps, then
runs ``engine.step()`` while any request is unfinished, and hands each
``RequestOutput`` to the asyncio queue of its request with ``call_soon_threadsafe``.
When idle it blocks on the command queue (with a timeout, so stopping is bounded).

Aborts are fire-and-forget (:meth:`AsyncEngine.abort_nowait`) so that they can be sent
from a cancelled task's ``finally`` (a client that disconnects mid-stream); the engine
thread applies them before its next step, so the blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from kvpage.engine.params import SamplingParams
from kvpage.server.engine_client import EngineFailure, EngineOutput, PromptInput, StepEngine

__all__ = ["AsyncEngine", "EngineFailure", "StepStats", "is_out_of_memory"]

logger = logging.getLogger("kvpage.server.engine")

_T = TypeVar("_T")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: Python's ``MemoryError``, torch's
    ``OutOfMemoryError`` (CUDA and other devices), or a ``RuntimeError`` whose message
    is an allocator's out-of-memory report (CPU ``DefaultCPUAllocator``, cuBLAS/cuDNN)."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return (
            "out of memory" in msg
            or "can't allocate memory" in msg
            or "cublas_status_alloc_failed" in msg
        )
    return False


@dataclass(frozen=True)
class StepStats:
    """One engine step as the loop saw it.

    Attributes:
        duration_s: wall time of ``engine.step()`` in seconds.
        num_outputs: request outputs the step returned.
        metrics: ``engine.get_metrics()`` right after the step.
        failed: the step raised (its requests were failed and aborted).
        oom: the failure was an out-of-memory error.
    """

    duration_s: float
    num_outputs: int
    metrics: Mapping[str, float]
    failed: bool = False
    oom: bool = False


@dataclass
class AddRequest:
    """``engine.add_request``'s arguments (see :meth:`AsyncEngine.add`); the engine
    process sends it down its socket as it is (it pickles)."""

    prompt: PromptInput
    params: SamplingParams
    arrival_time: float | None
    priority: int
    #: deliver only the outputs a non-streamed handler reads (see AsyncEngine.add)
    final_only: bool


@dataclass
class _Command:
    """One command for the engine thread: ``add`` (with ``add``), ``abort``, ``call``
    (``fn(engine)``) or ``wake`` (nothing: ends the idle wait); ``future`` gets its
    result (None but for call) or exception."""

    kind: Literal["add", "abort", "call", "wake"]
    request_id: str = ""
    add: AddRequest | None = None
    fn: Callable[[Any], object] | None = None  # the engine as EngineClient.call takes it
    future: concurrent.futures.Future[object] | None = field(default=None)


class AsyncEngine:
    """Runs an ``LLMEngine`` in a background thread for asyncio handlers (an
    :class:`~kvpage.server.engine_client.EngineClient`).

    Args:
        engine: an object with the Engine contract (``add_request``, ``abort_request``,
            ``step``, ``has_unfinished_requests``, ``get_metrics``).
        on_step: called on the engine thread after every step with a :class:`StepStats`
            (keep it cheap and thread-safe).
        idle_wait_s: how long the idle thread blocks waiting for a command before
            re-checking the stop flag.

    Attributes:
        metrics_snapshot: the latest ``engine.get_metrics()`` (replaced atomically).
    """

    def __init__(
        self,
        engine: StepEngine,
        *,
        on_step: Callable[[StepStats], None] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[EngineOutput]] = {}  # touched on the event loop only
        self._live: set[str] = set()  # touched on the engine thread only
        #: final-only requests -> (a token seen, choices finished) at the last delivery
        #: (engine thread only; pruned to the live requests)
        self._final_only: dict[str, tuple[bool, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.metrics_snapshot: Mapping[str, float] = dict(engine.get_metrics())

    # ---------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``loop``."""
        if self._thread is not None:
            raise RuntimeError("engine loop: expected a stopped loop, got a running one")
        self._loop = loop
        self._start_thread()

    def _start_thread(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvpage-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and wait for it (bounded); it aborts every live request and
        fails every waiting handler with :class:`EngineFailure` on its way out."""
        if self._thread is None:
            return
        self._stop.set()
        self._commands.put(_Command("wake"))
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- handler API
    async def add(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        replayable: bool = False,
    ) -> asyncio.Queue[EngineOutput]:
        """Add a request; return the queue its ``RequestOutput``s arrive on.

        ``arrival_time`` (``time.monotonic()`` seconds) is passed to the engine, and
        ``priority`` when it is not 0 (engines without priorities keep working).
        ``replayable`` (no output of the request reaches its client before it
        finishes: a non-streamed request) lets an engine loop that can run the request
        again elsewhere do so after a failure (the scaled-out ingress,
        :class:`kvpage.cluster.remote.RemoteEngineLoop`). Here it means the handler
        reads only the outputs that change what it keeps (outputs are cumulative): the
        queue then receives an output only when the request's first token appears, a
        choice finishes, or the request finishes, not one per step, so a large
        non-streamed fan-out costs the event loop a few deliveries per sequence instead
        of one per token.

        The queue receives each output the engine produces for the request (the last one
        has ``finished=True``; with ``replayable``, the ones above) or an
        :class:`EngineFailure`.

        Raises:
            RequestRejected: the engine refused the request (no state changed).
            RuntimeError: the loop is not running.
        """
        if not self.running:
            raise RuntimeError("engine loop: expected a running loop, got a stopped one")
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._streams[request_id] = q
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        add = AddRequest(prompt, params, arrival_time, priority, replayable)
        self._commands.put(_Command("add", request_id, add, future=fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # Cancelled while the add was in flight: the add is either skipped or already
            # applied; the abort queued behind it is a no-op in the first case.
            self.abort_nowait(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return q

    def abort_nowait(self, request_id: str) -> None:
        """Ask the engine thread to abort ``request_id`` (no-op if it already finished).

        Safe to call from anywhere, including a cancelled task; never blocks.
        """
        self._streams.pop(request_id, None)
        self._commands.put(_Command("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` and wait until the engine thread has freed its blocks."""
        self._streams.pop(request_id, None)
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._commands.put(_Command("abort", request_id, future=fut))
        await asyncio.wrap_future(fut)

    async def call(self, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        untyped = cast("concurrent.futures.Future[object]", fut)  # the thread sets fn's result
        self._commands.put(_Command("call", fn=fn, future=untyped))
        return await asyncio.wrap_future(fut)

    # ---------------------------------------------------------------- engine thread
    def _apply(self, cmd: _Command) -> None:
        if cmd.future is not None and not cmd.future.set_running_or_notify_cancel():
            return  # the caller gave up before the command ran: skip it
        try:
            result: object = None
            if cmd.kind == "add":
                assert cmd.add is not None
                a = cmd.add
                self.engine.add_request(
                    cmd.request_id, a.prompt, a.params, a.arrival_time, priority=a.priority
                )
                self._live.add(cmd.request_id)
                if a.final_only:
                    self._final_only[cmd.request_id] = (False, -1)
            elif cmd.kind == "abort":
                if cmd.request_id in self._live:
                    self._live.discard(cmd.request_id)
                    self.engine.abort_request(cmd.request_id)
            elif cmd.kind == "call":
                assert cmd.fn is not None
                result = cmd.fn(self.engine)
        except BaseException as exc:  # delivered to the waiting handler
            if cmd.future is not None:
                cmd.future.set_exception(exc)
            else:
                logger.exception("engine loop: %s %s failed", cmd.kind, cmd.request_id)
            return
        if cmd.future is not None:
            cmd.future.set_result(result)

    def _drain(self, block: bool) -> None:
        try:
            cmd = (
                self._commands.get(timeout=self._idle_wait_s)
                if block
                else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        self._apply(cmd)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._apply(cmd)

    def _deliver(self, request_id: str, item: EngineOutput) -> None:
        # Runs on the event loop.
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(item)
            if isinstance(item, EngineFailure) or item.finished:
                self._streams.pop(request_id, None)

    # Delivery hooks (the engine process, kvpage.server.engine_process, overrides them to
    # send over its pipe instead): called on the engine thread.
    def _emit(self, request_id: str, item: EngineOutput) -> None:
        """Hand ``item`` (a RequestOutput or EngineFailure) to ``request_id``'s handler."""
        loop = self._loop
        assert loop is not None
        loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _flush(self) -> None:
        """End of a step's deliveries (no-op here)."""

    def _publish_idle(self, snapshot: dict[str, float]) -> None:
        """The engine is idle after applying commands: publish its metrics."""
        self.metrics_snapshot = snapshot

    def _on_exit(self) -> None:
        """The engine thread is leaving: fail every handler still waiting."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_all, "engine loop stopped")

    def _fail_all(self, message: str) -> None:
        # Runs on the event loop: every waiting handler gets an EngineFailure.
        for rid in list(self._streams):
            self._deliver(rid, EngineFailure(message))

    def _abort_live(self, why: str) -> None:
        for rid in list(self._live):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("engine loop: abort of %s (%s) failed", rid, why)
        self._live.clear()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain(block=not busy)
                if self._stop.is_set():
                    break
                if not self.engine.has_unfinished_requests():
                    self._publish_idle(dict(self.engine.get_metrics()))
                    continue
                self._step()
        except BaseException:
            logger.exception("engine loop: crashed; failing all requests")
            raise
        finally:
            # Leaving (stop or crash): abort whatever is still live so the pool ends empty,
            # and fail every handler still waiting so none hangs.
            self._abort_live("shutdown")
            self._drain(block=False)
            self._abort_live("shutdown")
            self.metrics_snapshot = dict(self.engine.get_metrics())
            self._on_exit()

    def _fail_step(self, exc: BaseException, oom: bool, mark: str | None) -> None:
        """Fail the requests of a step that raised; the others keep running.

        The engine's ``failed_request_ids`` (``LLMEngine`` drops exactly the requests of
        the failed step and lists them there) names the requests failed; when it listed
        none (the failure happened outside its step bookkeeping), every live request is
        failed and aborted. ``mark`` is the record's last
        entry before the step. After an out-of-memory error the device allocator's cache
        is emptied so the next step starts from a clean slate.
        """
        failed = self._step_failed_ids(mark)
        for rid in failed if failed else self._live:
            self._emit(rid, EngineFailure(str(exc), oom))
        if failed:
            self._live.difference_update(failed)  # the engine already dropped them
        else:
            self._abort_live("step failure")
        if oom:
            _empty_device_cache()

    def _failed_mark(self) -> str | None:
        ids = self.engine.failed_request_ids
        return ids[-1] if ids else None

    def _step_failed_ids(self, mark: str | None) -> list[str]:
        """Live ids the engine recorded as failed after ``mark`` ([] if none/unknown)."""
        ids = self.engine.failed_request_ids
        if not ids:
            return []
        recent = list(ids)
        if mark is not None and mark in recent:
            recent = recent[len(recent) - recent[::-1].index(mark) :]
        return [rid for rid in recent if rid in self._live]

    def _step(self) -> None:
        t0 = time.perf_counter()
        failed = oom = False
        mark = self._failed_mark()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            oom = is_out_of_memory(exc)
            logger.exception(
                "engine loop: step failed%s; failing its requests",
                " (out of memory)" if oom else "",
            )
            failed = True
            outputs = []
            self._fail_step(exc, oom, mark)
        dt = time.perf_counter() - t0
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
                self._final_only.pop(out.request_id, None)
            elif out.request_id in self._final_only:
                comps = out.outputs
                key = (
                    any(len(c.token_ids) for c in comps),
                    sum(c.finish_reason is not None for c in comps),
                )
                if key == self._final_only[out.request_id]:
                    continue  # nothing a non-streamed handler keeps changed
                self._final_only[out.request_id] = key
            self._emit(out.request_id, out)
        if len(self._final_only) > len(self._live):  # aborted or failed requests
            self._final_only = {k: v for k, v in self._final_only.items() if k in self._live}
        snap = dict(self.engine.get_metrics())
        self.metrics_snapshot = snap
        if self._on_step is not None:
            try:
                self._on_step(StepStats(dt, len(outputs), snap, failed, oom))
            except Exception:
                logger.exception("engine loop: on_step callback failed")
        self._flush()


def _empty_device_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # best effort: a failed cleanup must not crash the loop
        logger.exception("engine loop: emptying the device cache after OOM failed")
