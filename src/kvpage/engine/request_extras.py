"""Per-request extras of an engine step, only for requests that ask for them: penalty
contexts, prompt logprobs and vLLM's ``stop_reason``.

``parents`` below is the engine's ``{user request id: parent request}`` table; each has
``logprobs`` / ``cumulative`` (per sample), ``prompt_logprobs`` (per prompt position,
None until computed), ``stop_reasons`` (per sample) and ``params``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvpage.engine.processing import RowContext, compute_logprobs, position_logprobs
from kvpage.engine.request import Request
from kvpage.engine.scheduler import SchedulerOutput

__all__ = [
    "prompt_logprob_spans",
    "record_prompt_logprobs",
    "row_context",
    "stop_reason",
]


def row_context(req: Request) -> RowContext:
    """The penalty context of a sequence's logits row (``min_tokens`` masks the
    sequence's EOS unless ``ignore_eos``, and its stop token ids)."""
    stop: list[int] = list(req.stop_token_set)
    if not req.params.ignore_eos and req.eos_token_id is not None:
        stop.append(int(req.eos_token_id))
    return RowContext(req.token_ids[: req.num_prompt_tokens], req.output_token_ids, stop)


def prompt_logprob_spans(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    """``(scheduled index, first row in the chunk, rows)`` of the prompt positions whose
    logits this step computes for requests with ``prompt_logprobs`` (the logits at
    position ``p`` give the logprob of prompt token ``p + 1``)."""
    spans = []
    for i, s in enumerate(out.scheduled):
        req = s.request
        if req.params.prompt_logprobs is None or req.sample_index != 0:
            continue
        n = min(s.num_tokens, req.num_prompt_tokens - 1 - s.start)
        if n > 0:
            spans.append((i, 0, n))
    return spans


def record_prompt_logprobs(
    parents: Mapping[str, Any],
    out: SchedulerOutput,
    spans: Sequence[tuple[int, int, int]],
    logits: torch.Tensor,
    tokenizer: Any,
) -> None:
    """Fill the parent requests' prompt logprobs from the ``spans`` rows of ``logits`` (in span
    order). A position computed twice (recomputation after preemption) keeps its first
    value."""
    r = 0
    for i, _, n in spans:
        s = out.scheduled[i]
        req = s.request
        grp = parents[req.parent_id]
        nxt = req.token_ids[s.start + 1 : s.start + 1 + n]  # the tokens they predict
        k = req.params.prompt_logprobs or 0
        ents = compute_logprobs(logits[r : r + n], nxt, [k] * n)
        plp = grp.prompt_logprobs
        for j, (tok, ent) in enumerate(zip(nxt, ents)):
            pos = s.start + 1 + j
            if plp is not None and plp[pos] is None:
                plp[pos] = position_logprobs(tok, ent, tokenizer)
        r += n


def stop_reason(grp: Any, q: Request) -> int | str | None:
    """vLLM's ``stop_reason`` of a finished "stop" sample: the stop string or stop token
    id that ended it; None for the sequence's EOS."""
    got: int | str | None = grp.stop_reasons.get(q.sample_index)
    if got is not None or not q.output_token_ids:
        return got
    last = q.output_token_ids[-1]
    if not grp.params.ignore_eos and last == q.eos_token_id:
        return None
    return last if last in q.stop_token_set else None
