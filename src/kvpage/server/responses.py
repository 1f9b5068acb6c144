"""Assembling responses from :class:`~kvpage.server.service.Delta` streams: choices with
logprobs, ``echo``, ``stop_reason``, several prompts per ``/v1/completions`` request,
``usage.prompt_tokens_details.cached_tokens`` and the degraded-mode cap marker.

Several prompts (``"prompt": ["a", "b"]`` or a list of token-id lists) run as separate
engine requests at once; choice ``i`` of prompt ``j`` gets index ``j * n + i`` (OpenAI's
order) and ``usage`` sums over prompts (streamed: ``kvpage.server.multi_stream``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpage.engine.params import PositionLogprobs
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server import protocol as P
from kvpage.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from kvpage.server.request_models import CompletionPrompt
from kvpage.server.service import Delta, Usage

__all__ = [
    "CAPPED_HEADER",
    "GROUP_HEADER",
    "REPLICA_HEADER",
    "ChoiceState",
    "RequestResult",
    "build_body",
    "stream_chunk",
]

#: response header set when degraded mode capped ``max_tokens`` (value: the cap)
CAPPED_HEADER = "X-KVPage-Max-Tokens-Capped"
#: response headers naming the replica group / replica of a scaled-out server that
#: served the request (operators only: ``kvpage.server.security.may_see_topology``)
GROUP_HEADER = "X-KVPage-Group"
#: chat responses: which chat template rendered the prompt ("request", "server",
#: "model" or "kvpage", the plain template of a model without one)
CHAT_TEMPLATE_HEADER = "X-KVPage-Chat-Template"
REPLICA_HEADER = "X-KVPage-Replica"


@dataclass
class ChoiceState:
    """One choice as collected from its deltas."""

    text: str = ""
    finish: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.finish = d.finish_reason or self.finish
        if d.finish_reason is not None:
            self.stop_reason = d.stop_reason
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)


@dataclass
class RequestResult:
    """A finished request: its choices and usage."""

    req: P.GenerationRequest
    choices: list[ChoiceState]
    usage: Usage
    echo_text: str = ""


def prompt_text(
    req: P.GenerationRequest, prompt: CompletionPrompt | None, tokenizer: Tokenizer
) -> str:
    """The text ``echo`` prepends: the prompt string, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return str(tokenizer.decode(list(req.prompt_token_ids)))


def _logprobs(
    req: P.GenerationRequest,
    ids: list[int],
    entries: list[PositionLogprobs],
    *,
    echo: tuple[list[int], list[PositionLogprobs | None]] | None,
    offset: int,
    tokenizer: Tokenizer | None = None,
    echo_text: str = "",
) -> dict[str, Any] | None:
    if req.logprobs is None:
        return None
    if req.kind == "chat":
        return chat_logprobs(ids, entries, req.logprobs)

    def decode(t: int) -> str:
        return str(t) if tokenizer is None else str(tokenizer.decode([t]))

    return completion_logprobs(
        ids,
        entries,
        prompt=echo,
        offset=offset,
        decode=decode,
        prompt_text=echo_text if echo is not None else None,
    )


def build_body(
    results: list[RequestResult], asked_prompt_logprobs: bool, tokenizer: Tokenizer | None = None
) -> dict[str, Any]:
    """The non-streamed body of one or several prompts' results (see module docstring);
    ``tokenizer`` decodes the echoed first prompt token, which has no logprob entry."""
    first = results[0].req
    choices = []
    for j, res in enumerate(results):
        req = res.req
        plp = res.usage.prompt_logprobs
        plp_json = prompt_logprobs_json(plp) if asked_prompt_logprobs else None
        echo = (req.prompt_token_ids, list(plp or [None] * len(req.prompt_token_ids)))
        for i, c in enumerate(res.choices):
            lp = _logprobs(
                req,
                c.token_ids,
                c.logprobs,
                echo=echo if req.echo else None,
                offset=0,
                tokenizer=tokenizer,
                echo_text=res.echo_text,
            )
            choices.append(
                P.choice(
                    req,
                    j * req.n + i,
                    res.echo_text + c.text,
                    c.finish,
                    logprobs=lp,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=plp_json if req.kind == "completion" else None,
                )
            )
    chat_plp = None
    if first.kind == "chat" and asked_prompt_logprobs:
        chat_plp = prompt_logprobs_json(results[0].usage.prompt_logprobs)
    return P.completion_body(
        first,
        choices,
        sum(r.usage.completion_tokens for r in results),
        cached_tokens=sum(r.usage.cached_tokens for r in results),
        prompt_tokens=sum(len(r.req.prompt_token_ids) for r in results),
        prompt_logprobs=chat_plp,
        cache_info=[r.usage.cache_info for r in results],
    )


def stream_chunk(
    req: P.GenerationRequest,
    d: Delta,
    *,
    first: bool,
    echo_text: str,
    echo_entries: tuple[list[int], list[PositionLogprobs | None]] | None,
    offset: int,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """One SSE chunk for a delta; the first chunk of a choice carries the ``echo`` text
    (and, with logprobs, the prompt tokens' logprobs)."""
    text = (echo_text if first else "") + d.text
    lp = _logprobs(
        req,
        d.token_ids,
        d.logprobs or [],
        echo=echo_entries if first and req.echo else None,
        offset=offset,
        tokenizer=tokenizer,
        echo_text=echo_text,
    )
    return P.chunk(
        req,
        d.index,
        text,
        d.finish_reason,
        first=first,
        logprobs=lp,
        stop_reason=d.stop_reason,
    )
