"""A request as the scheduler sees it: one sequence of token ids and its progress.

A user request with ``n`` samples is ``n`` scheduler requests (sequences): sample 0
keeps the user's id; sample ``i > 0`` gets ``f"{id}#{i}"`` and is forked from sample 0
(sharing its blocks) when the prompt's last token has been computed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpage.cache.explain import CacheMissExplanation
from kvpage.engine.params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a sequence is: waiting (queued or preempted), running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def sample_id(parent_id: str, index: int) -> str:
    """Scheduler id of parallel sample ``index`` of user request ``parent_id``."""
    return parent_id if index == 0 else f"{parent_id}#{index}"


@dataclass(eq=False)
class Request:
    """One sequence: prompt plus generated tokens, and how much of it is computed.

    Attributes:
        request_id: the scheduler id (see :func:`sample_id`).
        parent_id: the user request id, shared by its ``n`` parallel samples (vLLM's
            parent request).
        sample_index: index in ``[0, n)``.
        token_ids: prompt then generated tokens (mutated: tokens are appended).
        num_prompt_tokens: prompt length in tokens.
        params: the sampling parameters (shared by all samples).
        max_tokens: effective cap on generated tokens,
            ``min(params.max_tokens, max_model_len - num_prompt_tokens)``.
        eos_token_id: the model's EOS id (None = none; honoured unless ignore_eos).
        num_computed_tokens: leading tokens whose K/V are in the cache.
        num_cached_tokens: prefix-cache hit at first admission (-1 before).
        num_pending_samples: samples still to fork from this one (``n - 1`` for sample
            0 until its prompt is computed, then 0).
        has_blocks: whether the cache manager holds blocks for it (first allocate
            call done and not freed since).
        cache_salt: isolates its prefix-cache entries (None = shared).
        num_preemptions: times this sequence was preempted.
        priority: scheduling priority under the ``priority`` policy (lower is served
            first; vLLM's convention); 0 under ``fcfs``.
        cache_miss: why the prefix hit at first admission ended where it did (None
            before admission or with an allocator that cannot tell).
        num_cached_tokens_by_tier: ``num_cached_tokens`` split by where the blocks were
            found (``Allocation.cached_tokens_by_tier``); None before admission.
        swapped_tokens: tokens whose K/V (and, on a hybrid model, the recurrent state
            after them) are swapped out to host memory (swap preemption,
            ``kvpage.engine.swap``); 0 when not swapped out.
        num_new_tokens: tokens appended by the latest step that progressed it (1, or
            up to k + 1 with speculative decoding).
    """

    request_id: str
    parent_id: str
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int
    eos_token_id: int | None = None
    cache_salt: str | None = None
    arrival_order: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_pending_samples: int = 0
    has_blocks: bool = False
    finish_reason: str | None = None
    num_preemptions: int = 0
    stop_token_set: frozenset[int] = field(default_factory=frozenset)
    priority: int = 0
    cache_miss: CacheMissExplanation | None = None
    num_cached_tokens_by_tier: dict[str, int] | None = None
    swapped_tokens: int = 0
    num_new_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens known so far."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self, token: int) -> str | None:
        """Finish reason after ``token`` was appended, or None to keep going.

        "stop": EOS (unless ``ignore_eos``) or a stop token id; "length": the
        effective ``max_tokens`` is reached.
        """
        if not self.params.ignore_eos and token == self.eos_token_id:
            return "stop"
        if token in self.stop_token_set:
            return "stop"
        if self.num_output_tokens >= self.max_tokens:
            return "length"
        return None


__all__ = ["Request", "RequestStatus", "sample_id"]
