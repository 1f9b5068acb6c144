"""Streaming several prompts of one ``/v1/completions`` request at once.

The tenant is charged once for the summed cost of all prompts, then every prompt is
admitted (KV budget), then each becomes its own engine request (accepted or refused by
the engine before the 200 is sent, so a refusal is a plain 4xx, refunds the whole
charge and aborts the ones already started, counted as cancellations with cause
``sibling_failed``); their deltas are merged into one SSE stream as they arrive, choice ``i`` of
prompt ``j`` with index ``j * n + i``. When the response ends however it ends (done,
client gone, server stopping) every prompt's generator is closed, which aborts what is
still running, and every admission is released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from kvpage.server import protocol as P
from kvpage.server.generation import Delta
from kvpage.server.responses import stream_chunk
from kvpage.server.service import APIError, ServingState, Usage
from kvpage.server.sse import sse_event

__all__ = ["stream_many"]

_R = TypeVar("_R")


async def stream_many(
    state: ServingState,
    reqs: list[P.GenerationRequest],
    echo_texts: list[str],
    make_response: Callable[[AsyncIterator[str], Callable[[], Awaitable[None]]], _R],
) -> _R:
    """Admit and start every request, then return ``make_response(sse, cleanup)``.

    Raises:
        APIError: a prompt was refused (the others were aborted and released).
    """
    stream = _MultiStream(state, reqs, echo_texts)
    await stream.start()
    return make_response(stream.events(), stream.cleanup)


class _MultiStream:
    """One streamed request of several prompts: their admissions, engine generations
    and the merged SSE events (choice ``i`` of prompt ``j`` is choice ``j * n + i``)."""

    def __init__(
        self, state: ServingState, reqs: list[P.GenerationRequest], echo_texts: list[str]
    ) -> None:
        self.state, self.reqs, self.echo_texts = state, reqs, echo_texts
        self.usages = [Usage() for _ in reqs]
        self.charging = state.charged(reqs)
        self.admissions: list[contextlib.AbstractAsyncContextManager[None]] = []
        self.gens: list[AsyncGenerator[Delta, None]] = []
        self.firsts: list[Delta | None] = []
        #: (prompt, delta | None at its end | the APIError it failed with)
        self.queue: asyncio.Queue[tuple[int, Delta | APIError | None]] = asyncio.Queue()
        self.pumps: list[asyncio.Task[None]] = []
        self.started: set[tuple[int, int]] = set()  # (prompt, choice) with a chunk sent
        self.offsets: dict[tuple[int, int], int] = {}

    async def start(self) -> None:
        """Charge the tenant, admit every prompt (KV budget), then start each one and
        wait for its first output; on any failure unwind all of it and re-raise."""
        state, reqs = self.state, self.reqs
        # One request, one charge: the tenant pays the summed cost before any prompt is
        # admitted (refused -> nothing charged, nothing runs); every prompt is admitted
        # (KV budget) before the first one reaches the engine.
        charge = await self.charging.__aenter__()
        try:
            for r in reqs:
                adm = state.admitted(r, charge)
                await adm.__aenter__()
                self.admissions.append(adm)
            charge.started = True
            for r, u in zip(reqs, self.usages):
                self.gens.append(state.generation.generate(r, u))
                try:
                    self.firsts.append(await self.gens[-1].__anext__())
                except StopAsyncIteration:
                    self.firsts.append(None)
        except BaseException as exc:
            if isinstance(exc, APIError):  # the ones already started did not fail
                for r in reqs:
                    state.generation.cancel_causes[r.request_id] = "sibling_failed"
            for g in self.gens:
                await g.aclose()
            for r in reqs:
                state.generation.cancel_causes.pop(r.request_id, None)
            for held in reversed(self.admissions):
                await held.__aexit__(type(exc), exc, exc.__traceback__)
            await self.charging.__aexit__(type(exc), exc, exc.__traceback__)
            raise

    async def _pump(self, j: int) -> None:
        queue = self.queue
        try:
            first = self.firsts[j]
            if first is not None:
                await queue.put((j, first))
            async for d in self.gens[j]:
                await queue.put((j, d))
            await queue.put((j, None))
        except APIError as e:
            await queue.put((j, e))
        except Exception as e:  # defensive: never leave the stream waiting forever
            await queue.put((j, APIError(500, f"server: {type(e).__name__}", type="server_error")))

    async def events(self) -> AsyncIterator[str]:
        """The merged SSE events: chunks as they come, an error event per failed prompt,
        the summed usage chunk when asked, then ``[DONE]``."""
        reqs = self.reqs
        self.pumps.extend(asyncio.create_task(self._pump(j)) for j in range(len(reqs)))
        open_ = len(reqs)
        while open_:
            j, d = await self.queue.get()
            if d is None or isinstance(d, APIError):
                open_ -= 1
                if isinstance(d, APIError):
                    yield sse_event(P.error_body(d.message, type=d.type, code=d.code))
                continue
            yield sse_event(self._chunk(j, d))
        if reqs[0].include_usage:
            yield sse_event(self._usage_chunk())
        yield "data: [DONE]\n\n"

    def _chunk(self, j: int, d: Delta) -> dict[str, Any]:
        r, key, echo_text = self.reqs[j], (j, d.index), self.echo_texts[j]
        echo = None
        if r.echo:
            plp = self.usages[j].prompt_logprobs or [None] * len(r.prompt_token_ids)
            echo = (r.prompt_token_ids, list(plp))
        c = stream_chunk(
            r,
            d,
            first=key not in self.started,
            echo_text=echo_text,
            echo_entries=echo,
            offset=self.offsets.get(key, 0),
            tokenizer=self.state.tokenizer,
        )
        if key not in self.started:
            self.offsets[key] = len(echo_text) if r.echo else 0
        self.offsets[key] += len(d.text)
        self.started.add(key)
        c["choices"][0]["index"] = j * r.n + d.index
        c["id"], c["created"] = self.reqs[0].request_id, self.reqs[0].created
        return c

    def _usage_chunk(self) -> dict[str, Any]:
        reqs, usages = self.reqs, self.usages
        u = P.usage_chunk(
            reqs[0],
            sum(x.completion_tokens for x in usages),
            sum(x.cached_tokens for x in usages),
            [x.cache_info for x in usages],
        )
        u["usage"]["prompt_tokens"] = p = sum(len(r.prompt_token_ids) for r in reqs)
        u["usage"]["total_tokens"] = p + u["usage"]["completion_tokens"]
        return u

    async def cleanup(self) -> None:
        """Stop the pumps, abort what still runs (client gone), release everything."""
        for t in self.pumps:
            t.cancel()
        for t in self.pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for g in self.gens:
            await g.aclose()  # aborts a request still running (client gone)
        for adm in reversed(self.admissions):
            await adm.__aexit__(None, None, None)
        await self.charging.__aexit__(None, None, None)
