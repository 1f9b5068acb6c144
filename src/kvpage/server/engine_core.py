"""The child side of the engine process (:mod:`kvpage.server.engine_process`): builds
the ``LLMEngine`` and runs the server's engine loop with its deliveries sent down a
socket as length-prefixed frames (:mod:`kvpage.server.framing`).

See :mod:`kvpage.server.engine_process` for the message protocol. The child's own side
blocks: its main thread reads commands, the engine thread sends each step's outputs.
After the engine is built the child freezes its heap (``gc.freeze``, as vLLM's engine
core does): the model and engine objects are then never scanned again by the cyclic
garbage collector, whose full collections otherwise stall steps for hundreds of ms.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server.engine_client import EngineOutput
from kvpage.server.engine_loop import AsyncEngine, StepStats, _Command
from kvpage.server.framing import FrameError, FrameReader, recv_frame, send_frame
from kvpage.server.output_codec import OutputEncoder, WireOutput
from kvpage.specs import CacheSpec

if TYPE_CHECKING:
    from kvpage.engine import LLMEngine

__all__ = ["EngineInfo", "EngineReport", "child_main", "engine_report"]

logger = logging.getLogger("kvpage.server.engine")


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP process needs to know about the engine (sent once, at start)."""

    tokenizer: Tokenizer | None  # the engine's (None: an engine built without one)
    cache_spec: CacheSpec
    backend_name: str
    max_model_len: int
    #: ``Scheduler.max_servable_len`` (``max_model_len`` or less when the pool is smaller)
    max_servable_len: int
    policy: str
    metrics: dict[str, float]
    #: request defaults from generation_config.json (``LLMEngine.default_sampling_params``)
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    #: the generation_config.json folder they came from (None: none)
    generation_config_path: str | None = None


class EngineReport(TypedDict):
    """:func:`engine_report`: the engine's end state (blocks, requests, the integrity
    check's ``"ok"`` or error, its metrics)."""

    free_blocks: int
    usable_blocks: int
    running: int
    waiting: int
    unfinished: bool
    integrity: str
    metrics: dict[str, float]


def engine_report(engine: LLMEngine) -> EngineReport:
    """The engine's end state: free/usable blocks, running/waiting counts, the result of
    ``kv_cache_manager.check_integrity()`` ("ok" or the error) and its metrics."""
    kv = engine.kv_cache_manager
    try:
        kv.check_integrity()
        integrity = "ok"
    except Exception as exc:  # reported, not raised: the caller decides
        integrity = f"{type(exc).__name__}: {exc}"
    return {
        "free_blocks": kv.num_free_blocks,
        "usable_blocks": engine.cache_spec.num_blocks - 1,
        "running": engine.scheduler.num_running,
        "waiting": engine.scheduler.num_waiting,
        "unfinished": engine.has_unfinished_requests(),
        "integrity": integrity,
        "metrics": dict(engine.get_metrics()),
    }


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))  # both ways: a custom __init__ can fail to load
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _EngineCore(AsyncEngine):
    """The child's engine loop: ``AsyncEngine`` whose deliveries go down ``sock``."""

    def __init__(self, engine: LLMEngine, sock: socket.socket) -> None:
        super().__init__(engine, on_step=self._stats)
        self._llm = engine  # the same engine, as its own type (for the final report)
        self._sock = sock
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[str, WireOutput]] = []
        self._last: StepStats | None = None
        self._idle_sent: dict[str, float] | None = None
        self._codec = OutputEncoder()

    def _send(self, msg: tuple[object, ...]) -> None:
        with self._send_lock:
            send_frame(self._sock, msg)

    def _emit(self, request_id: str, item: EngineOutput) -> None:
        self._outbox.append((request_id, self._codec.encode(item)))

    def _stats(self, st: StepStats) -> None:
        self._last = StepStats(st.duration_s, st.num_outputs, dict(st.metrics), st.failed, st.oom)

    def _flush(self) -> None:
        if self._outbox or self._last is not None:
            self._send(("out", self._outbox, self._last))
            self._outbox, self._last = [], None
            self._idle_sent = None
        if len(self._codec) > len(self._live):  # aborted or failed requests
            self._codec.prune(self._live)

    def _publish_idle(self, snapshot: dict[str, float]) -> None:
        self.metrics_snapshot = snapshot
        if snapshot != self._idle_sent:
            self._send(("metrics", snapshot))
            self._idle_sent = snapshot

    def _on_exit(self) -> None:
        self._flush()  # the parent fails whatever still waits when it sees "final"

    def _reply(self, cid: int, fut: concurrent.futures.Future[object]) -> None:
        exc = fut.exception()
        if exc is None:
            self._send(("res", cid, True, fut.result()))
        else:
            self._send(("res", cid, False, _picklable(exc)))

    def serve(self) -> None:
        """Run the engine thread; read commands here until "stop" or the parent goes."""
        self._start_thread()
        reader = FrameReader()
        backlog: list[bytes] = []
        try:
            while True:
                try:
                    msg = recv_frame(self._sock, reader, backlog)
                except (EOFError, OSError, FrameError):
                    break  # the parent is gone
                kind = msg[0]
                if kind == "stop":
                    break
                fut: concurrent.futures.Future[object] | None = None
                if msg[1] is not None:
                    fut = concurrent.futures.Future()
                    fut.add_done_callback(functools.partial(self._reply, msg[1]))
                if kind == "add":
                    cmd = _Command("add", msg[2], msg[3], future=fut)
                elif kind == "abort":
                    cmd = _Command("abort", msg[2], future=fut)
                else:
                    cmd = _Command("call", fn=msg[2], future=fut)
                self._commands.put(cmd)
        finally:
            self._stop.set()
            self._commands.put(_Command("wake"))
            if self._thread is not None:
                self._thread.join(30)
            with contextlib.suppress(OSError, ValueError):
                self._send(("final", engine_report(self._llm)))
            self._sock.close()


def child_main(
    sock: socket.socket, engine_kwargs: dict[str, Any], log_level: str, niceness: int = 0
) -> None:
    """Entry point of the engine process: build the engine, report, serve ``sock``
    (a connected stream socket)."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if niceness:
            os.nice(niceness)  # yield the CPU to the HTTP front end when both want it
        from kvpage.engine import LLMEngine

        engine = LLMEngine.from_config(**engine_kwargs)
        sched = engine.scheduler
        info = EngineInfo(
            engine.tokenizer,
            engine.cache_spec,
            engine.backend_name,
            int(sched.max_model_len),
            int(sched.max_servable_len),
            str(sched.policy),
            dict(engine.get_metrics()),
            dict(engine.default_sampling_params),
            engine.generation_config_path,
        )
    except BaseException as exc:
        send_frame(sock, ("error", _picklable(exc)))
        sock.close()
        return
    gc.collect()
    gc.freeze()  # the engine's start-up heap is never garbage: keep it out of GC scans
    send_frame(sock, ("ready", info))
    try:
        _EngineCore(engine, sock).serve()
    finally:
        # back to the collector before the interpreter's final collection: extensions
        # that check for leaks at exit (triton's nanobind) otherwise report frozen
        # cycles as leaked
        gc.unfreeze()
