"""The engine in its own process: the HTTP front end and the engine core share no GIL.

Why (measured, docs/serving.md "The engine process"): in one process the engine thread
holds the GIL for most of each step (Python bookkeeping around small kernels); when the
operating system deschedules it while it holds the GIL, the event loop cannot answer
even ``/health`` until the engine thread is scheduled again.

Layout (vLLM V1's AsyncLLM / EngineCore split, our own code): :class:`EngineProcess`
(its spawning half in :mod:`kvpage.server.engine_spawn`) spawns a child that builds the ``LLMEngine`` and runs the same engine loop as the
threaded server (:class:`kvpage.server.engine_loop.AsyncEngine`, with its deliveries
redirected to a socket), and stands in for the engine in the HTTP process with what the
server reads (``tokenizer``, ``cache_spec``, ``backend_name``,
``scheduler.max_model_len`` / ``.policy``). :class:`ProcessAsyncEngine` is the
HTTP-side twin of ``AsyncEngine`` (same methods): commands go down the socket, and the
child's per-step batch of outputs and step statistics comes back.

The server side has no I/O thread: the event loop watches the socket
(``loop.add_reader``) and reads it without blocking, reassembling length-prefixed
frames (:mod:`kvpage.server.framing`) from whatever pieces arrive, so a step's outputs
cost one wake-up of the loop, as in thread mode, and a child descheduled in the middle
of a frame never blocks it. Commands are written without blocking too (what the socket
does not take at once waits for ``loop.add_writer``).

Messages (one pickled frame each, over a ``socket.socketpair``):

* parent -> child: ``("add", cid, request_id, AddRequest)`` (prompt, params, arrival
  time, priority and whether it is streamed: ``kvpage.server.engine_loop.AddRequest``),
  ``("abort", cid | None, request_id)``, ``("call", cid, fn)`` (``fn`` must pickle: a
  module-level function), ``("stop",)``.
* child -> parent: ``("ready", EngineInfo)`` or ``("error", exc)`` at start;
  ``("res", cid, ok, value)``; ``("out", [(request_id, delta | EngineFailure)],
  StepStats | None)`` after each step (:mod:`kvpage.server.output_codec`);
  ``("metrics", snapshot)`` when it goes idle; ``("final", report)``
  (:func:`engine_report`) before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from kvpage.engine.params import SamplingParams
from kvpage.server.engine_client import EngineFailure, EngineOutput, PromptInput
from kvpage.server.engine_core import EngineInfo, EngineReport, engine_report
from kvpage.server.engine_loop import AddRequest, StepStats
from kvpage.server.engine_spawn import SpawnedEngine
from kvpage.server.framing import FrameError, encode_frame, recv_frame
from kvpage.server.output_codec import OutputDecoder

__all__ = ["EngineInfo", "EngineProcess", "ProcessAsyncEngine", "engine_report"]

_T = TypeVar("_T")

logger = logging.getLogger("kvpage.server.engine")

#: bytes asked of the socket per read, and most reads per wake-up of the loop (4 MiB):
#: a child that writes faster than the server reads cannot keep the loop in one callback
_READ_BYTES = 1 << 18
_MAX_READS = 16


class ProcessAsyncEngine:
    """The :class:`~kvpage.server.engine_client.EngineClient` over an
    :class:`EngineProcess` (see module doc).

    Everything runs on the event loop given to :meth:`start`: the socket is read when
    it is readable (non-blocking, framed), each complete frame is unpickled and handled
    in the same callback, and commands are written without blocking. :meth:`stop` may
    be called from another thread (the server calls it from a worker thread while the
    loop still runs) or after the loop ended.

    Attributes:
        metrics_snapshot: the latest engine metrics the child sent.
        final_report: :func:`engine_report` of the child at stop (None before).
    """

    def __init__(
        self, proc: SpawnedEngine, *, on_step: Callable[[StepStats], None] | None = None
    ) -> None:
        self.engine = proc
        self._sock = proc.sock
        self._fd = proc.sock.fileno()
        self._reader = proc.reader
        self._backlog = proc.backlog
        self._on_step = on_step
        self._streams: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._pending: dict[int, asyncio.Future[object]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._attached = False
        self._wbuf = bytearray()  # command bytes the socket has not taken yet
        self._stopped = False
        self._decoder = OutputDecoder()
        self._gone = threading.Event()  # the child closed its end (after "final" or dying)
        self.metrics_snapshot: dict[str, float] = proc.get_metrics()
        self.final_report: EngineReport | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the child's messages on ``loop`` from now on (call it on ``loop``'s
        thread, or before ``loop`` runs)."""
        if self._loop is not None:
            raise RuntimeError("engine loop: expected a stopped loop, got a running one")
        self._loop = loop
        self._sock.setblocking(False)
        loop.add_reader(self._fd, self._on_readable)
        self._attached = True
        if self._backlog:  # frames read with the "ready" answer at start
            frames, self._backlog[:] = list(self._backlog), []
            loop.call_soon(self._handle_frames, frames)

    @property
    def running(self) -> bool:
        """Whether the child is alive and this loop started and not stopped."""
        return (
            self._loop is not None
            and not self._stopped
            and not self._gone.is_set()
            and self.engine.process.is_alive()
        )

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the child (it aborts every live request and reports its end state in
        :attr:`final_report`), wait for it (bounded), fail every waiting handler."""
        if self._stopped:
            return
        self._stopped = True
        loop = self._loop
        if loop is None:  # never started
            self.engine.close()
            return
        if loop.is_running() and not loop.is_closed() and not self._on_loop_thread():
            # the loop keeps reading: it gets "final" and then the end of the stream
            try:
                loop.call_soon_threadsafe(self._write, encode_frame(("stop",)))
                self._gone.wait(timeout_s)
            except RuntimeError:  # the loop closed meanwhile
                pass
            self._run_on_loop(self._detach, timeout_s)
        else:
            self._detach()
            self._stop_blocking(timeout_s)
        self.engine.process.join(timeout_s)
        self.engine.close()
        if loop.is_running() and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._fail_waiting, "engine process stopped")
                return
        self._fail_waiting("engine process stopped")

    def _run_on_loop(self, fn: Callable[[], None], timeout_s: float) -> None:
        loop = self._loop
        assert loop is not None
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed: nothing runs on it any more
            fn()
            return
        if not done.wait(timeout_s):
            logger.warning("engine process: the event loop did not release the socket")

    def _stop_blocking(self, timeout_s: float) -> None:
        """Stop the child without the event loop: send "stop", read to the end."""
        deadline = time.monotonic() + timeout_s
        try:
            self._sock.settimeout(timeout_s)
            self._sock.sendall(bytes(self._wbuf) + encode_frame(("stop",)))
            self._wbuf.clear()
            while True:
                self._sock.settimeout(max(0.01, deadline - time.monotonic()))
                msg = recv_frame(self._sock, self._reader, self._backlog)
                if msg[0] == "final":
                    self._take_final(msg[1])
        except (EOFError, FrameError, OSError):
            pass  # the end of the stream (or a timeout): the caller joins the child
        self._gone.set()

    def _detach(self) -> None:
        """Stop watching the socket (on the loop, or with the loop not running)."""
        if not self._attached:
            return
        self._attached = False
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)
            loop.remove_writer(self._fd)

    def _fail_waiting(self, why: str) -> None:
        """Fail every pending command and waiting handler with ``why`` (on the loop)."""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"engine loop: {why}"))
        self._pending.clear()
        for rid in list(self._streams):
            self._deliver(rid, EngineFailure(why))

    # ---------------------------------------------------------------- the socket
    def _on_readable(self) -> None:
        frames: list[bytes] = []
        end: str | None = None
        try:
            for _ in range(_MAX_READS):
                data = self._sock.recv(_READ_BYTES)
                if not data:
                    self._reader.check_end()
                    end = "closed its pipe"
                    break
                frames.extend(self._reader.feed(data))
                if len(data) < _READ_BYTES:
                    break  # drained: skip the read that would say so
        except (BlockingIOError, InterruptedError):
            pass
        except FrameError as exc:
            end = f"broke its pipe mid-message ({exc})"
        except OSError as exc:
            end = f"pipe error ({exc})"
        self._handle_frames(frames)
        if end is not None:
            self._lost(end)

    def _handle_frames(self, frames: list[bytes]) -> None:
        for payload in frames:
            try:
                msg = pickle.loads(payload)
            except Exception:  # a message that does not unpickle: log it, keep reading
                logger.exception("engine process: unreadable message")
                continue
            try:
                self._handle(msg)
            except Exception:
                logger.exception("engine process: handling %r failed", msg[0])

    def _lost(self, how: str) -> None:
        """The child's end of the stream is gone: stop watching it; unless stopping,
        fail every waiting request (the child died)."""
        self._detach()
        self._gone.set()
        if self._stopped:
            return
        self.engine.process.join(0.05)  # a dying child: its exit code, if already there
        code = self.engine.process.exitcode
        logger.error("engine process: %s (exit code %s); failing all requests", how, code)
        self._fail_waiting(f"engine process exited (code {code})")

    def _write(self, frame: bytes) -> None:
        # On the loop: send what the socket takes now, queue the rest for add_writer.
        if self._gone.is_set() or not self._attached:
            return
        if self._wbuf:
            self._wbuf += frame
            return
        try:
            n = self._sock.send(frame)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            return  # the child is gone: the reader reports it
        if n < len(frame):
            self._wbuf += frame[n:]
            assert self._loop is not None
            self._loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        assert self._loop is not None
        try:
            n = self._sock.send(self._wbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = len(self._wbuf)  # the child is gone: drop it, the reader reports it
        del self._wbuf[:n]
        if not self._wbuf:
            self._loop.remove_writer(self._fd)

    def _send(self, msg: tuple[object, ...]) -> None:
        if not self.running and msg[0] != "abort":
            raise RuntimeError("engine loop: expected a running engine process, got none")
        loop = self._loop
        if loop is None:
            return  # never started: nothing to abort
        frame = encode_frame(msg)
        if self._on_loop_thread():
            self._write(frame)
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: the child is stopping
                loop.call_soon_threadsafe(self._write, frame)

    def _take_final(self, report: EngineReport) -> None:
        self.final_report = report
        self.metrics_snapshot = dict(report["metrics"])

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
        elif kind == "final":
            self._take_final(msg[1])

    def _deliver(self, request_id: str, item: EngineOutput) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(item)
            if isinstance(item, EngineFailure) or item.finished:
                self._streams.pop(request_id, None)

    async def _request(self, msg_head: tuple[str, ...], *rest: object) -> object:
        """Send ``(kind, cid, *head[1:], *rest)``; the child's ``("res", cid, ...)``
        value (unpickled), or its exception raised."""
        loop = asyncio.get_running_loop()
        cid = next(self._ids)
        fut: asyncio.Future[object] = loop.create_future()
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
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        replayable: bool = False,
    ) -> asyncio.Queue[EngineOutput]:
        """As :meth:`AsyncEngine.add <kvpage.server.engine_loop.AsyncEngine.add>`."""
        if not self.running:
            raise RuntimeError("engine loop: expected a running loop, got a stopped one")
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._streams[request_id] = q
        add = AddRequest(prompt, params, arrival_time, priority, replayable)
        try:
            await self._request(("add",), request_id, add)
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

    async def call(self, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(engine)`` in the child between steps (``fn`` must pickle: a
        module-level function) and return its (picklable) result."""
        # fn's result, unpickled in this process (the child ran fn: the type is fn's)
        return cast(_T, await self._request(("call",), fn))


class EngineProcess(SpawnedEngine):
    """An ``LLMEngine`` built and run in a child process (``spawn``); see
    :class:`~kvpage.server.engine_spawn.SpawnedEngine` for the arguments and errors.
    Requests go through :meth:`make_async_engine`."""

    def make_async_engine(
        self, on_step: Callable[[StepStats], None] | None = None
    ) -> ProcessAsyncEngine:
        """The HTTP-side engine loop talking to this child."""
        return ProcessAsyncEngine(self, on_step=on_step)
