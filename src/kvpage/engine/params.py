"""User-facing request parameters and results: SamplingParams, RequestOutput.

The names and defaults follow vLLM's ``SamplingParams`` / ``RequestOutput`` so that
users of vLLM feel at home; only the subset kvpage implements is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpage.errors import RequestRejected

#: finish reasons of a completion: "stop" (EOS, a stop token id or a stop string) or
#: "length" (max_tokens or max_model_len reached); "abort" when aborted by the user.
FINISH_REASONS = ("stop", "length", "abort")


#: largest value of a signed 64-bit integer (torch.int64); every integer parameter
#: must fit it, as the sampler puts them in int64 tensors and torch generators
INT64_MAX = 2**63 - 1


def _is_int(v: object, lo: int) -> bool:
    """True for a real int (not bool) in ``[lo, INT64_MAX]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= INT64_MAX


def _bad(name: str, expected: str, got: object) -> RequestRejected:
    return RequestRejected(
        f"{name}: expected {expected}, got {got!r}", reason="invalid_sampling_params"
    )


@dataclass
class SamplingParams:
    """How to sample one request (validated on construction).

    Attributes:
        max_tokens: most tokens to generate (>= 1); every integer field must also be
            <= ``2**63 - 1`` (int64, what torch accepts); None = up to ``max_model_len``.
            Default 64.
        temperature: softmax temperature (>= 0); 0 = greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of tokens whose probability
            sums to >= top_p (0 < top_p <= 1; 1 = off). Holtzman et al., 2019.
        top_k: keep the k most likely tokens (-1 or 0 = off, else >= 1).
        n: completions per prompt (>= 1); they share the prompt's blocks
            (copy-on-write) and are sampled independently.
        seed: per-request seed (>= 0, with ``seed + n - 1 <= 2**63 - 1``); completion
            ``i`` draws from a ``torch.Generator`` seeded with ``seed + i``. None = derived from the
            engine seed and the request's arrival order (reproducible per engine).
        stop_token_ids: extra token ids that end a completion (the token is kept in
            the output, finish_reason "stop").
        ignore_eos: keep generating after the model's EOS token.
        stop: strings that end a completion; the text is cut before the match
            (checked on the decoded text, needs a tokenizer).

    Raises:
        RequestRejected: reason ``"invalid_sampling_params"``, message
            ``"name: expected X, got Y"``.
    """

    max_tokens: int | None = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop: list[str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (called by the constructor; call again after mutation).

        Raises:
            RequestRejected: reason ``"invalid_sampling_params"``.
        """
        mt = self.max_tokens
        if mt is not None and not _is_int(mt, 1):
            raise _bad("max_tokens", f"None or an int in [1, {INT64_MAX}]", mt)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise _bad("temperature", "a finite number >= 0", t)
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise _bad("top_p", "a number in (0, 1]", p)
        k = self.top_k
        if not _is_int(k, -1):
            raise _bad("top_k", f"-1 or 0 (off) or an int in [1, {INT64_MAX}]", k)
        if not _is_int(self.n, 1):
            raise _bad("n", f"an int in [1, {INT64_MAX}]", self.n)
        s = self.seed
        if s is not None:
            # sample i is seeded with seed + i (torch.Generator.manual_seed takes a
            # signed or unsigned 64-bit value; kvpage keeps every seed in int64 range)
            if not _is_int(s, 0):
                raise _bad("seed", f"None or an int in [0, {INT64_MAX}]", s)
            if s + self.n - 1 > INT64_MAX:
                raise _bad("seed", f"seed + n - 1 <= {INT64_MAX} (sample i uses seed + i)", s)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(i, 0) for i in ids):
                raise _bad("stop_token_ids", f"None or a list of ints in [0, {INT64_MAX}]", ids)
            self.stop_token_ids = [int(i) for i in ids]
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", "a bool", self.ignore_eos)
        if self.stop is not None:
            st = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(st, (list, tuple)) or not all(isinstance(x, str) and x for x in st):
                raise _bad("stop", "None, a non-empty string or a list of them", self.stop)
            self.stop = list(st)

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass
class CompletionOutput:
    """One completion (sample) of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        token_ids: generated token ids so far.
        text: the decoded text ("" without a tokenizer); cut before a stop string.
        finish_reason: None while running, else one of :data:`FINISH_REASONS`.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of ``LLM.generate``).

    Attributes:
        request_id: the id given to ``add_request``.
        prompt: the prompt text when it was given as text, else None.
        prompt_token_ids: the prompt's token ids.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        outputs: one CompletionOutput per sample, by index.
        finished: True when every sample has finished.
        arrival_time: ``time.monotonic()`` seconds when the request arrived.
        first_token_time: when its first token was sampled (None before).
        finish_time: when its last sample finished (None before).
        num_preemptions: times one of its samples was preempted.
        error: the RequestRejected of a request ``LLM.generate`` could not admit
            (then ``outputs`` is empty), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    error: RequestRejected | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds (None before the first token)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish in seconds (None while running)."""
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, in seconds, over the longest
        completion (None while running or with a single generated token)."""
        if self.finish_time is None or self.first_token_time is None:
            return None
        n = max((len(o.token_ids) for o in self.outputs), default=0)
        if n < 2:
            return None
        return (self.finish_time - self.first_token_time) / (n - 1)


__all__ = ["FINISH_REASONS", "CompletionOutput", "RequestOutput", "SamplingParams"]
