"""The parent's handle on the engine process (:class:`SpawnedEngine`): spawn the child, wait for its "ready"
(or its construction error), stand in for the engine where the server reads it.

See :mod:`kvpage.server.engine_process` for the design and the message protocol; the
child's side is :mod:`kvpage.server.engine_core`.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import weakref
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from kvpage.server.engine_core import EngineInfo, child_main
from kvpage.server.framing import FrameError, FrameReader, recv_frame

__all__ = ["SpawnedEngine"]


@dataclass(frozen=True)
class _SchedulerView:
    """The child's scheduler limits (``ServedScheduler``)."""

    max_model_len: int
    max_servable_len: int
    policy: str


def _terminate(process: BaseProcess) -> None:
    if process.is_alive():
        process.terminate()
        process.join(5)
        if process.is_alive():
            process.kill()


class SpawnedEngine:
    """An ``LLMEngine`` built and run in a child process (``spawn``).

    Stands in for the engine where the server reads it
    (:class:`~kvpage.server.engine_client.ServedEngine`): ``tokenizer``, ``cache_spec``,
    ``backend_name``, ``scheduler`` (``max_model_len``, ``max_servable_len``,
    ``policy``), the generation defaults and :meth:`get_metrics` (the snapshot at
    start). Requests go through
    :class:`kvpage.server.engine_process.EngineProcess`, this class with
    ``make_async_engine``.

    Args:
        engine_kwargs: ``LLMEngine.from_config`` keyword arguments.
        log_level: the child's logging level.
        niceness: added to the child's nice value (0-19; ``os.nice``): the OS then
            prefers the server process's threads when both want a CPU.
        start_timeout_s: how long the child may take to build the engine.

    Attributes:
        sock: this side of the socket pair (blocking until a loop takes it over).
        reader, backlog: the frame reader of ``sock`` and frames read but not handled
            (handed to :class:`ProcessAsyncEngine`).

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
        self.sock, child = socket.socketpair()
        self.reader = FrameReader()
        self.backlog: list[bytes] = []
        self.process = ctx.Process(
            target=child_main,
            args=(child, dict(engine_kwargs), log_level, niceness),
            name="kvpage-engine-core",
            daemon=True,
        )
        try:
            self.process.start()
        finally:
            child.close()
        self._finalizer = weakref.finalize(self, _terminate, self.process)
        try:
            self.sock.settimeout(start_timeout_s)
            msg = recv_frame(self.sock, self.reader, self.backlog)
        except TimeoutError:
            self.close()
            raise RuntimeError(
                f"engine process: expected it ready within {start_timeout_s:g}s, got no answer"
            ) from None
        except (EOFError, FrameError, OSError):
            self.process.join(5)
            code = self.process.exitcode
            self.close()
            raise RuntimeError(
                f"engine process: expected it to start, got exit code {code}"
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
        self.scheduler = _SchedulerView(info.max_model_len, info.max_servable_len, info.policy)
        self._metrics = info.metrics
        self.default_sampling_params = dict(info.default_sampling_params)
        self.generation_config_path = info.generation_config_path

    def get_metrics(self) -> dict[str, float]:
        """The engine metrics as of the child's start (live ones: the loop's snapshot)."""
        return dict(self._metrics)

    def close(self) -> None:
        """Terminate the child (if still alive) and close the socket."""
        self._finalizer()
        self.sock.close()
