"""The engine in its own process: the HTTP front end and the engine core share no GIL.

Why (measured, docs/serving.md "Health under load"): in one process the engine thread
holds the GIL for most of each step (Python bookkeeping around small kernels); when the
operating system deschedules it while it holds the GIL, the event loop cannot answer
even ``/health`` until the engine thread is scheduled again. On an oversubscribed CPU
that wait is tens to hundreds of milliseconds. A CPU-bound thread in the same process
tripled a trivial app's ``/health`` p99; the same load in another process did not.

Layout (vLLM V1's AsyncLLM / EngineCore split, our own code): :class:`EngineProcess`
spawns a child that builds the ``LLMEngine`` and runs the same engine loop as the
threaded server (:class:`kvpage.server.engine_loop.AsyncEngine`, with its deliveries
redirected to a pipe), and stands in for the engine in the HTTP process with what the
server reads (``tokenizer``, ``cache_spec``, ``backend_name``,
``scheduler.max_model_len`` / ``.policy``). :class:`ProcessAsyncEngine` is the
HTTP-side twin of ``AsyncEngine`` (same methods): commands go down the pipe, and the
child's per-step batch of outputs and step statistics comes back. Two small I/O threads
move the messages so the event loop never waits on the pipe.

Messages (pickled, one ``Connection`` each way):

* parent -> child: ``("add", cid, request_id, (prompt, params, arrival_time), kwargs)``,
  ``("abort", cid | None, request_id)``, ``("call", cid, fn)`` (``fn`` must pickle: a
  module-level function), ``("stop",)``.
* child -> parent: ``("ready", EngineInfo)`` or ``("error", exc)`` at start;
  ``("res", cid, ok, value)``; ``("out", [(request_id, RequestOutput | EngineFailure)],
  StepStats | None)`` after each step; ``("metrics", snapshot)`` when it goes idle;
  ``("final", report)`` (:func:`engine_report`) before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from kvpage.server.engine_core import EngineInfo, child_main, engine_report
from kvpage.server.engine_loop import EngineFailure, StepStats
from kvpage.server.output_codec import OutputDecoder

__all__ = ["EngineInfo", "EngineProcess", "ProcessAsyncEngine", "engine_report"]

logger = logging.getLogger("kvpage.server.engine")


@dataclass(frozen=True)
class _SchedulerView:
    max_model_len: int
    policy: str


def _terminate(process: Any) -> None:
    if process.is_alive():
        process.terminate()
        process.join(5)
        if process.is_alive():
            process.kill()


class EngineProcess:
    """An ``LLMEngine`` built and run in a child process (``spawn``).

    Stands in for the engine where the server reads it: ``tokenizer``, ``cache_spec``,
    ``backend_name``, ``scheduler.max_model_len`` / ``scheduler.policy`` and
    :meth:`get_metrics` (the latest snapshot); requests go through
    :meth:`make_async_engine`.

    Args:
        engine_kwargs: ``LLMEngine.from_config`` keyword arguments.
        log_level: the child's logging level.
        niceness: added to the child's nice value (0-19; ``os.nice``): the OS then
            prefers the server process's threads when both want a CPU.
        start_timeout_s: how long the child may take to build the engine.

    Raises:
        SpecError, RequestRejected, ...: the child's engine construction error, re-raised.
        RuntimeError: the child died or did not answer within ``start_timeout_s``.
    """

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        *,
        log_level: str = "warning",
        niceness: int = 0,
        start_timeout_s: float = 300.0,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=child_main,
            args=(child, dict(engine_kwargs), log_level, niceness),
            name="kvpage-engine-core",
            daemon=True,
        )
        self.process.start()
        child.close()
        self._finalizer = weakref.finalize(self, _terminate, self.process)
        try:
            if not self.conn.poll(start_timeout_s):
                raise RuntimeError(
                    f"engine process: expected it ready within {start_timeout_s:g}s, got no answer"
                )
            msg = self.conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(
                f"engine process: expected it to start, got exit code {self.process.exitcode}"
            ) from None
        except BaseException:
            self.close()
            raise
        if msg[0] == "error":
            self.close()
            raise msg[1]
        info: EngineInfo = msg[1]
        self.tokenizer = info.tokenizer
        self.cache_spec = info.cache_spec
        self.backend_name = info.backend_name
        self.scheduler = _SchedulerView(info.max_model_len, info.policy)
        self._metrics = info.metrics

    def get_metrics(self) -> dict[str, float]:
        """The engine metrics as of the child's start (live ones: the loop's snapshot)."""
        return dict(self._metrics)

    def make_async_engine(self, on_step: Any = None) -> ProcessAsyncEngine:
        """The HTTP-side engine loop talking to this child."""
        return ProcessAsyncEngine(self, on_step=on_step)

    def close(self) -> None:
        """Terminate the child (if still alive) and close the pipe."""
        self._finalizer()
        self.conn.close()


class ProcessAsyncEngine:
    """``AsyncEngine``'s interface over an :class:`EngineProcess` (see module doc).

    Two daemon threads move the messages, so the event loop never blocks on the pipe
    (a message larger than the pipe's buffer arrives in pieces, and the child may be
    descheduled between them): ``kvpage-engine-rx`` receives (the blocking read
    releases the GIL) and hands each message to the loop; ``kvpage-engine-tx`` sends
    what the handlers queue.

    Attributes:
        metrics_snapshot: the latest engine metrics the child sent.
        final_report: :func:`engine_report` of the child at stop (None before).
    """

    def __init__(self, proc: EngineProcess, *, on_step: Any = None) -> None:
        self.engine = proc
        self._conn = proc.conn
        self._on_step = on_step
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outq: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._decoder = OutputDecoder()
        self._gone = threading.Event()  # the child closed its end (after "final" or dying)
        self.metrics_snapshot: dict[str, float] = proc.get_metrics()
        self.final_report: dict[str, Any] | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the child's messages on ``loop`` from now on."""
        if self._loop is not None:
            raise RuntimeError("engine loop: expected a stopped loop, got a running one")
        self._loop = loop
        for name, target in (("kvpage-engine-rx", self._rx), ("kvpage-engine-tx", self._tx)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def running(self) -> bool:
        """Whether the child is alive and this loop started and not stopped."""
        return (
            self._loop is not None
            and not self._stopped
            and not self._gone.is_set()
            and self.engine.process.is_alive()
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the child (it aborts every live request and reports its end state in
        :attr:`final_report`), wait for it (bounded), fail every waiting handler."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop is None:  # never started: no threads
            self.engine.close()
            return
        self._outq.put(("stop",))
        self._gone.wait(timeout_s)
        self._outq.put(None)
        self.engine.process.join(timeout_s)
        self.engine.close()
        for t in self._threads:
            t.join(timeout_s)
        loop = self._loop
        if not loop.is_closed() and loop.is_running():
            loop.call_soon_threadsafe(self._fail_waiting, "engine process stopped")
        else:
            self._fail_waiting("engine process stopped")

    def _fail_waiting(self, why: str) -> None:
        """Fail every pending command and waiting handler with ``why`` (on the loop)."""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"engine loop: {why}"))
        self._pending.clear()
        for rid in list(self._streams):
            self._deliver(rid, EngineFailure(why))

    # ---------------------------------------------------------------- pipe threads
    def _rx(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that does not unpickle: log it, keep reading
                logger.exception("engine process: unreadable message")
                continue
            if msg[0] == "final":  # handled here: the loop may be shutting down
                self.final_report = msg[1]
                self.metrics_snapshot = dict(msg[1]["metrics"])
                continue
            with contextlib.suppress(RuntimeError):  # loop closed
                loop.call_soon_threadsafe(self._handle, msg)
        self._gone.set()
        if not self._stopped:
            code = self.engine.process.exitcode
            logger.error("engine process: exited (code %s); failing all requests", code)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(
                    self._fail_waiting, f"engine process exited (code {code})"
                )

    def _tx(self) -> None:
        while True:
            msg = self._outq.get()
            if msg is None:
                return
            try:
                self._conn.send(msg)
            except (OSError, ValueError):
                return  # the child is gone: _rx reports it

    def _send(self, msg: Any) -> None:
        if not self.running and msg[0] != "abort":
            raise RuntimeError("engine loop: expected a running engine process, got none")
        self._outq.put(msg)

    def _handle(self, msg: Any) -> None:
        kind = msg[0]
        if kind == "out":
            for rid, item in msg[1]:
                if rid in self._streams:
                    self._deliver(rid, self._decoder.decode(rid, item))
                else:  # its handler went away (abort in flight)
                    self._decoder.forget(rid)
            st: StepStats | None = msg[2]
            if st is not None:
                self.metrics_snapshot = dict(st.metrics)
                if self._on_step is not None:
                    try:
                        self._on_step(st)
                    except Exception:
                        logger.exception("engine loop: on_step callback failed")
        elif kind == "metrics":
            self.metrics_snapshot = msg[1]
        elif kind == "res":
            fut = self._pending.pop(msg[1], None)
            if fut is not None and not fut.done():
                if msg[2]:
                    fut.set_result(msg[3])
                else:
                    fut.set_exception(msg[3])

    def _deliver(self, request_id: str, item: Any) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(item)
            if isinstance(item, EngineFailure) or getattr(item, "finished", False):
                self._streams.pop(request_id, None)

    async def _request(self, msg_head: tuple[Any, ...], *rest: Any) -> Any:
        loop = asyncio.get_running_loop()
        cid = next(self._ids)
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[cid] = fut
        try:
            self._send((msg_head[0], cid, *msg_head[1:], *rest))
        except BaseException:
            self._pending.pop(cid, None)
            raise
        return await fut

    # ---------------------------------------------------------------- handler API
    async def add(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> asyncio.Queue[Any]:
        """As :meth:`AsyncEngine.add <kvpage.server.engine_loop.AsyncEngine.add>`."""
        if not self.running:
            raise RuntimeError("engine loop: expected a running loop, got a stopped one")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = q
        kw = {"priority": priority} if priority else {}
        try:
            await self._request(("add",), request_id, (prompt, params, arrival_time), kw)
        except asyncio.CancelledError:
            self.abort_nowait(request_id)  # queued behind the add: a no-op if it was skipped
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return q

    def abort_nowait(self, request_id: str) -> None:
        """Ask the child to abort ``request_id``; never blocks on the child's answer."""
        self._streams.pop(request_id, None)
        self._decoder.forget(request_id)
        if not self._stopped:
            self._send(("abort", None, request_id))

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` and wait until the child has freed its blocks."""
        self._streams.pop(request_id, None)
        self._decoder.forget(request_id)
        await self._request(("abort",), request_id)

    async def call(self, fn: Any) -> Any:
        """Run ``fn(engine)`` in the child between steps (``fn`` must pickle: a
        module-level function) and return its (picklable) result."""
        return await self._request(("call",), fn)
