"""Streamed responses: an SSE response that always runs its cleanup however it ends,
and iterating a generation while watching for the client to leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

_T = TypeVar("_T")

__all__ = ["sse_event"]


def sse_event(data: Any) -> str:
    """One server-sent event whose ``data`` is ``data`` as JSON."""
    return "data: " + json.dumps(data) + "\n\n"


class _Stream(StreamingResponse):
    """An SSE response that always runs ``cleanup`` when the response ends, however it
    ends (completed, client disconnected before or during the stream, server stopping)."""

    def __init__(
        self,
        content: AsyncIterator[str],
        cleanup: Callable[[], Awaitable[object]],
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


async def _until_disconnect(
    gen: AsyncIterator[_T], request: Request, every_s: float = 0.25
) -> AsyncIterator[_T]:
    """Iterate ``gen``; stop (closing it, which aborts the request) if the client leaves.

    The connection is checked at least every ``every_s`` seconds, whether or not ``gen``
    is producing items.
    """
    loop = asyncio.get_running_loop()
    it = gen.__aiter__()
    next_check = loop.time() + every_s
    nxt: asyncio.Future[_T] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=max(0.0, next_check - loop.time()))
                if loop.time() >= next_check:
                    next_check = loop.time() + every_s
                    if await request.is_disconnected():
                        return
                if done:
                    break
            try:
                yield nxt.result()
            except StopAsyncIteration:
                return
    finally:
        # leave no __anext__ of ``gen`` running (also when this generator is cancelled or
        # closed from outside): closing ``gen`` while one runs raises "aclose(): asynchronous
        # generator is already running" (seen when Ray's proxy dropped a connection)
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await nxt
