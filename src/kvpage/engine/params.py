"""User-facing request parameters and results: SamplingParams, RequestOutput.

The names, defaults and semantics follow vLLM's ``SamplingParams`` / ``RequestOutput``
(vLLM 0.10, V1 engine) so that users of vLLM feel at home; only the subset kvpage
implements is here, and an unknown keyword argument is a ``TypeError`` naming it (the
dataclass constructor), so nothing is silently ignored. docs/vllm-checklist.md lists
every difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvpage.cache.explain import CacheMissExplanation
from kvpage.cache.retention import KVRetention
from kvpage.engine.structured import StructuredOutputsParams
from kvpage.engine.vllm_compat import SAMPLING_NOT_IMPLEMENTED, check_not_implemented
from kvpage.errors import RequestRejected, SpecError, got_repr

#: most top log-probabilities per token a request may ask for (vLLM's default
#: ``max_logprobs``)
MAX_LOGPROBS = 20

#: finish reasons of a completion: "stop" (EOS, a stop token id, a stop string, or the
#: end of a ``structured_outputs`` grammar) or "length" (max_tokens or max_model_len
#: reached); "abort" when aborted by the user; "grammar_dead_end" when the
#: ``structured_outputs`` grammar allows no next token (kvpage.engine.structured).
FINISH_REASONS = ("stop", "length", "abort", "grammar_dead_end")


#: largest value of a signed 64-bit integer (torch.int64); every integer parameter
#: must fit it, as the sampler puts them in int64 tensors and torch generators
INT64_MAX = 2**63 - 1


def _is_int(v: object, lo: int) -> bool:
    """True for a real int (not bool) in ``[lo, INT64_MAX]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= INT64_MAX


def _is_num(v: object) -> bool:
    """True for a finite int or float (not bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad(name: str, expected: str, got: object) -> RequestRejected:
    return RequestRejected(
        f"{name}: expected {expected}, got {got_repr(got)}", reason="invalid_sampling_params"
    )


class _VLLMCompatible(type):
    """Metaclass: vLLM keyword arguments kvpage does not implement are refused by name
    (or dropped when their value asks for nothing) before the constructor runs."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        check_not_implemented(cls.__name__, SAMPLING_NOT_IMPLEMENTED, kwargs)
        return super().__call__(*args, **kwargs)


@dataclass
class SamplingParams(metaclass=_VLLMCompatible):
    """How to sample one request (validated on construction).

    Attributes:
        max_tokens: most tokens to generate (>= 1); every integer field must also be
            <= ``2**63 - 1`` (int64, what torch accepts); None = up to ``max_model_len``.
            Default 16 (vLLM's).
        temperature: softmax temperature (>= 0); 0 = greedy (argmax). Default 1.0
            (vLLM's): pass ``temperature=0.0`` for greedy output.
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
        presence_penalty: subtracted once from the logit of every token that occurs
            in the output so far (in [-2, 2]; 0 = off).
        frequency_penalty: subtracted from each token's logit once per occurrence in
            the output so far (in [-2, 2]; 0 = off).
        repetition_penalty: for tokens in the prompt or the output so far, positive
            logits are divided by it and negative ones multiplied (> 0; 1 = off;
            Keskar et al. 2019, CTRL). Order (vLLM's ``apply_penalties``): repetition,
            then frequency, then presence, all before the temperature.
        min_p: drop tokens whose probability (after temperature) is below ``min_p``
            times the most likely token's (in [0, 1]; 0 = off).
        min_tokens: the EOS token and ``stop_token_ids`` are masked out (logit -inf)
            until this many tokens were generated, and stop strings are not checked
            before (>= 0; must be <= max_tokens).
        logprobs: return, for every sampled token, its log-probability and rank plus
            the ``logprobs`` most likely tokens (0..20; None = off). Log-probabilities
            are ``log_softmax`` of the model's raw logits (before penalties,
            temperature and top-k/p/min-p: vLLM V1's default ``raw_logprobs``).
        prompt_logprobs: the same for every prompt token after the first (0..20; None =
            off). Such a request does not reuse prefix-cache hits (every prompt token
            is computed), as in vLLM.
        include_stop_str_in_output: keep the matched stop string in the text.
        kv_retention: kvpage extension: how long this request's cached blocks stay
            once it is done (``kvpage.cache.KVRetention``, or its dict form
            ``{"ranges": [{"start", "end", "priority", "ttl_s"}], "decode_priority",
            "decode_ttl_s"}``, converted on validation); None = plain LRU. Needs prefix
            caching. See docs/architecture.md, "Retention".
        structured_outputs: constrain the output to a JSON schema, JSON object, regex,
            choice or grammar (``kvpage.engine.structured.StructuredOutputsParams``, or
            its dict form, converted on validation); None = unconstrained. Every sample
            of ``n`` has its own grammar state. Needs the engine's tokenizer.

    Raises:
        RequestRejected: reason ``"invalid_sampling_params"``, message
            ``"name: expected X, got Y"``.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop: list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    kv_retention: KVRetention | None = None
    structured_outputs: StructuredOutputsParams | None = None
    #: derived by validate(): penalties or min_tokens are set (logits are processed)
    needs_processing: bool = field(default=False, init=False, repr=False, compare=False)
    #: derived by validate(): nothing beyond temperature/top-k/top-p (the fast path)
    plain: bool = field(default=True, init=False, repr=False, compare=False)

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise _bad(name, "a number in [-2, 2]", v)
        rp = self.repetition_penalty
        if not _is_num(rp) or not 0.0 < rp < math.inf:
            raise _bad("repetition_penalty", "a finite number > 0", rp)
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", "a number in [0, 1]", self.min_p)
        if not _is_int(self.min_tokens, 0):
            raise _bad("min_tokens", f"an int in [0, {INT64_MAX}]", self.min_tokens)
        if mt is not None and self.min_tokens > mt:
            raise _bad("min_tokens", f"<= max_tokens ({mt})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (_is_int(v, 0) and v <= MAX_LOGPROBS):
                raise _bad(name, f"None or an int in [0, {MAX_LOGPROBS}]", v)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise _bad("include_stop_str_in_output", "a bool", self.include_stop_str_in_output)
        kr: Any = self.kv_retention
        if kr is not None and not isinstance(kr, KVRetention):
            try:
                self.kv_retention = KVRetention.from_dict(kr)
            except SpecError as e:
                raise RequestRejected(str(e), reason="invalid_sampling_params") from None
        so: Any = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if not isinstance(so, dict):
                raise _bad("structured_outputs", "None, StructuredOutputsParams or a dict", so)
            try:
                self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as e:
                raise _bad("structured_outputs", "StructuredOutputsParams fields", str(e)) from None
        self.needs_processing = bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )
        self.plain = not (
            self.needs_processing
            or self.min_p
            or self.logprobs is not None
            or self.structured_outputs is not None
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural-log probability under ``log_softmax`` of the raw logits.
        rank: 1 + the number of tokens with a strictly higher log-probability.
        decoded_token: the token's text (its piece; None without a tokenizer).
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


#: per position, token id -> Logprob: the sampled (or prompt) token plus the top-k
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion (sample) of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        token_ids: generated token ids so far.
        text: the decoded text ("" without a tokenizer); cut before a stop string
            (or just after it with ``include_stop_str_in_output``).
        finish_reason: None while running, else one of :data:`FINISH_REASONS`.
        stop_reason: what stopped a "stop" completion: the stop token id or the stop
            string; None for EOS, "length" or while running (vLLM's meaning).
        logprobs: with ``SamplingParams.logprobs``, one :data:`PositionLogprobs` per
            generated token (the sampled token first), else None.
        cumulative_logprob: with ``logprobs``, the sum of the sampled tokens'
            log-probabilities, else None.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

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
        first_scheduled_time: when a step first scheduled it (None before); queue time
            is ``first_scheduled_time - arrival_time``.
        first_token_time: when its first token was sampled (None before).
        finish_time: when its last sample finished (None before).
        num_preemptions: times one of its samples was preempted.
        error: the RequestRejected of a request ``LLM.generate`` could not admit
            (then ``outputs`` is empty), else None.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt
            token: None for the first, then its :data:`PositionLogprobs`; else None.
        num_cached_tokens_by_tier: ``num_cached_tokens`` split by where the blocks were
            found at admission: ``"device"`` (the block pool), ``"host"`` / ``"disk"``
            (promoted from that KV tier, ``EngineConfig.kv_host_tier_bytes`` /
            ``kv_disk_tier_bytes``); ``"device"`` is always there after admission,
            lower tiers only when they served tokens; empty before admission.
        cache_miss: why the prefix hit ended where it did
            (``kvpage.cache.CacheMissExplanation``: reason, first missed block, tier,
            policy and time of an eviction); None before admission. This is the
            operator's view (the server shows tenants ``cache_miss.public()``).
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
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    cache_miss: CacheMissExplanation | None = None

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


__all__ = [
    "FINISH_REASONS",
    "MAX_LOGPROBS",
    "CompletionOutput",
    "Logprob",
    "PositionLogprobs",
    "RequestOutput",
    "SamplingParams",
]
