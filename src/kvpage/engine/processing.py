"""Logits processing and log-probabilities with vLLM's semantics.

* :func:`apply_penalties`: ``min_tokens`` masking, then repetition, frequency and
  presence penalties, in the order of vLLM's ``apply_penalties``
  (``vllm/model_executor/layers/utils.py``)::

      seen   = token in prompt or output      counts = occurrences in the output
      logit  = logit / rp  if seen and logit > 0
               logit * rp  if seen and logit <= 0
      logit -= frequency_penalty * counts + presence_penalty * (counts > 0)

  (repetition penalty: Keskar et al. 2019, CTRL; frequency/presence: OpenAI's API
  reference). Only rows that ask for it are touched; the fast path never calls it.
* :func:`compute_logprobs`: ``log_softmax`` of the raw model logits (vLLM V1's default
  ``logprobs_mode="raw_logprobs"``), the chosen token's log-probability and rank, and the
  top ``k`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpage.engine.params import Logprob, PositionLogprobs, SamplingParams

__all__ = ["RowContext", "apply_penalties", "compute_logprobs", "position_logprobs"]


@dataclass
class RowContext:
    """What the penalties of one logits row look at.

    Attributes:
        prompt_ids: the sequence's prompt token ids.
        output_ids: its generated token ids so far.
        stop_ids: token ids masked while ``len(output_ids) < min_tokens`` (EOS unless
            ``ignore_eos``, plus ``stop_token_ids``).
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    stop_ids: Sequence[int] = ()


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], contexts: Sequence[RowContext]
) -> torch.Tensor:
    """Return ``logits`` with each row's ``min_tokens`` mask and penalties applied.

    Args:
        logits: ``[num_rows, vocab_size]`` float; not mutated.
        params: each row's parameters (rows with ``needs_processing`` False are copied
            unchanged).
        contexts: each row's :class:`RowContext`.

    Returns:
        A new ``[num_rows, vocab_size]`` float32 tensor on ``logits.device``.
    """
    out = logits.float().clone()
    vocab = int(out.shape[1])
    dev = out.device
    for i, p in enumerate(params):
        if not p.needs_processing:
            continue
        c = contexts[i]
        row = out[i]
        if p.min_tokens and len(c.output_ids) < p.min_tokens:
            ids = [t for t in c.stop_ids if 0 <= t < vocab]
            if ids:
                row[torch.tensor(ids, dtype=torch.int64, device=dev)] = float("-inf")
        out_ids = torch.tensor(list(c.output_ids), dtype=torch.int64, device=dev)
        rp = float(p.repetition_penalty)
        if rp != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[torch.tensor(list(c.prompt_ids), dtype=torch.int64, device=dev)] = True
            seen[out_ids] = True
            row = torch.where(seen, torch.where(row > 0, row / rp, row * rp), row)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(out_ids, minlength=vocab).to(row.dtype)
            row = (
                row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
            )
        out[i] = row
    return out


def compute_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[tuple[float, int, list[int], list[float]]]:
    """Log-probabilities of chosen tokens and the top alternatives, per row.

    Args:
        logits: ``[num_rows, vocab_size]`` raw logits (any float dtype and device).
        token_ids: the chosen (sampled or prompt) token of each row.
        num_top: how many most likely tokens to return per row (0 = none).

    Returns:
        Per row ``(logprob, rank, top_ids, top_logprobs)``: the chosen token's
        ``log_softmax`` value (computed in float32), its rank (1 + the number of tokens
        with a strictly higher value), and the ``num_top`` best tokens, best first.
    """
    n = int(logits.shape[0])
    if n == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, tok[:, None])
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    kmax = max(num_top, default=0)
    top_v: list[list[float]] = [[] for _ in range(n)]
    top_i: list[list[int]] = [[] for _ in range(n)]
    if kmax > 0:
        v, ix = torch.topk(lp, min(kmax, int(lp.shape[1])), dim=-1)
        top_v, top_i = v.tolist(), ix.tolist()
    vals = chosen.squeeze(1).tolist()
    return [
        (float(vals[r]), int(ranks[r]), top_i[r][: num_top[r]], top_v[r][: num_top[r]])
        for r in range(n)
    ]


def position_logprobs(
    token_id: int,
    entry: tuple[float, int, list[int], list[float]],
    tokenizer: Any,
) -> PositionLogprobs:
    """vLLM's per-position dict: the chosen token first, then the top tokens (ranks
    1..k); ``decoded_token`` is ``tokenizer.decode([id])`` (None without a tokenizer)."""

    def text(t: int) -> str | None:
        return None if tokenizer is None else str(tokenizer.decode([t]))

    lp, rank, ids, vals = entry
    d: PositionLogprobs = {token_id: Logprob(lp, rank, text(token_id))}
    for j, (t, v) in enumerate(zip(ids, vals)):
        if t not in d:
            d[t] = Logprob(float(v), j + 1, text(t))
    return d
