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
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvpage.server import protocol as P
from kvpage.server.responses import stream_chunk
from kvpage.server.service import APIError, ServingState, Usage

__all__ = ["stream_many"]


async def stream_many(
    state: ServingState,
    reqs: list[P.GenerationRequest],
    echo_texts: list[str],
    make_response: Callable[[AsyncIterator[str], Callable[[], Any]], Any],
) -> Any:
    """Admit and start every request, then return ``make_response(sse, cleanup)``.

    Raises:
        APIError: a prompt was refused (the others were aborted and released).
    """
    usages = [Usage() for _ in reqs]
    # One request, one charge: the tenant pays the summed cost before any prompt is
    # admitted (refused -> nothing charged, nothing runs); every prompt is admitted
    # (KV budget) before the first one reaches the engine.
    charging = state.charged(reqs)
    charge = await charging.__aenter__()
    admissions: list[Any] = []
    gens: list[Any] = []
    firsts: list[Any] = []
    try:
        for r in reqs:
            adm = state.admitted(r, charge)
            await adm.__aenter__()
            admissions.append(adm)
        charge.started = True
        for r, u in zip(reqs, usages):
            gens.append(state.generate(r, u))
            try:
                firsts.append(await gens[-1].__anext__())
            except StopAsyncIteration:
                firsts.append(None)
    except BaseException as exc:
        if isinstance(exc, APIError):  # the ones already started did not fail
            for r in reqs:
                state.cancel_causes[r.request_id] = "sibling_failed"
        for g in gens:
            await g.aclose()
        for r in reqs:
            state.cancel_causes.pop(r.request_id, None)
        for adm in reversed(admissions):
            await adm.__aexit__(type(exc), exc, exc.__traceback__)
        await charging.__aexit__(type(exc), exc, exc.__traceback__)
        raise
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    pumps: list[asyncio.Task[None]] = []

    async def pump(j: int) -> None:
        try:
            if firsts[j] is not None:
                await queue.put((j, firsts[j]))
            async for d in gens[j]:
                await queue.put((j, d))
            await queue.put((j, None))
        except APIError as e:
            await queue.put((j, e))
        except Exception as e:  # defensive: never leave the stream waiting forever
            await queue.put((j, APIError(500, f"server: {type(e).__name__}", type="server_error")))

    async def sse() -> AsyncIterator[str]:
        pumps.extend(asyncio.create_task(pump(j)) for j in range(len(reqs)))
        started: set[tuple[int, int]] = set()
        offsets: dict[tuple[int, int], int] = {}
        open_ = len(reqs)
        while open_:
            j, d = await queue.get()
            if d is None or isinstance(d, APIError):
                open_ -= 1
                if isinstance(d, APIError):
                    err = P.error_body(d.message, type=d.type, code=d.code)
                    yield "data: " + json.dumps(err) + "\n\n"
                continue
            r, key = reqs[j], (j, d.index)
            echo = None
            if r.echo:
                plp = usages[j].prompt_logprobs or [None] * len(r.prompt_token_ids)
                echo = (r.prompt_token_ids, list(plp))
            c = stream_chunk(
                r,
                d,
                first=key not in started,
                echo_text=echo_texts[j],
                echo_entries=echo,
                offset=offsets.get(key, 0),
                tokenizer=state.tokenizer,
            )
            if key not in started:
                offsets[key] = len(echo_texts[j]) if r.echo else 0
            offsets[key] += len(d.text)
            started.add(key)
            c["choices"][0]["index"] = j * r.n + d.index
            c["id"], c["created"] = reqs[0].request_id, reqs[0].created
            yield "data: " + json.dumps(c) + "\n\n"
        if reqs[0].include_usage:
            u = P.usage_chunk(
                reqs[0],
                sum(x.completion_tokens for x in usages),
                sum(x.cached_tokens for x in usages),
                [x.cache_info for x in usages],
            )
            u["usage"]["prompt_tokens"] = p = sum(len(r.prompt_token_ids) for r in reqs)
            u["usage"]["total_tokens"] = p + u["usage"]["completion_tokens"]
            yield "data: " + json.dumps(u) + "\n\n"
        yield "data: [DONE]\n\n"

    async def cleanup() -> None:
        for t in pumps:
            t.cancel()
        for t in pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for g in gens:
            await g.aclose()  # aborts a request still running (client gone)
        for adm in reversed(admissions):
            await adm.__aexit__(None, None, None)
        await charging.__aexit__(None, None, None)

    return make_response(sse(), cleanup)
