"""Speculative decoding settings: :class:`SpeculativeConfig`, parsed from vLLM's
``speculative_config`` dict (``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": M, "prompt_lookup_min": m, "disable_by_batch_size": B}``) plus
kvpage's ``"draft_policy"`` (``"adaptive"``, the default, or ``"fixed"``; see
:class:`kvpage.engine.spec_decode.DraftPolicy`).

Only ``method="ngram"`` (prompt lookup, no draft model) exists today; the engine side is
:mod:`kvpage.engine.spec_decode`. Defaults follow vLLM's ``SpeculativeConfig`` for
ngram: with neither lookup bound given both are 5, with one given the other takes its
value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpage.errors import SpecError, got_repr

__all__ = ["DRAFT_POLICIES", "SPEC_METHODS", "SpeculativeConfig", "parse_speculative_config"]

#: the ``method`` values kvpage implements
SPEC_METHODS: tuple[str, ...] = ("ngram",)
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "draft_policy",
)
#: the ``draft_policy`` values: ``"fixed"`` drafts up to k tokens every decode step (vLLM's
#: behaviour); ``"adaptive"`` adapts each sequence's draft length to its acceptance and
#: turns drafting off at batch sizes where it measured slower (``DraftPolicy``)
DRAFT_POLICIES: tuple[str, ...] = ("adaptive", "fixed")
#: vLLM's default lookup n-gram length when neither bound is given
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Resolved speculative-decoding settings.

    Attributes:
        method: ``"ngram"`` (prompt lookup).
        num_speculative_tokens: draft tokens proposed per sequence per step (k >= 1);
            a step verifies them in one forward over k + 1 positions.
        prompt_lookup_max / prompt_lookup_min: longest / shortest suffix n-gram (tokens)
            looked up in the sequence's earlier tokens (1 <= min <= max).
        disable_by_batch_size: vLLM's key: no drafts in a step whose running batch holds
            more than this many sequences (None = no limit). vLLM applies it to new
            requests by the number of enqueued ones; kvpage decides it per step by the
            running batch, so a batch that shrinks speculates again.
        draft_policy: ``"adaptive"`` (default) or ``"fixed"`` (:data:`DRAFT_POLICIES`).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None
    draft_policy: str = "adaptive"


def _int_ge1(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise SpecError(f"speculative_config.{name}: expected an int >= 1, got {got_repr(v)}")
    return v


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """The :class:`SpeculativeConfig` of an ``EngineConfig.speculative_config`` value.

    Args:
        value: None (off), a dict with vLLM's keys, or its JSON text (the CLI flag).

    Raises:
        SpecError: ``"speculative_config[.<key>]: expected ..., got ..."``: not a dict,
            an unknown key (vLLM's other keys such as ``model`` are refused by name), a
            method other than ``"ngram"``, a missing or bad ``num_speculative_tokens``,
            bad lookup bounds or ``prompt_lookup_min > prompt_lookup_max``, a
            ``disable_by_batch_size`` that is not an int >= 1, a ``draft_policy`` not in
            :data:`DRAFT_POLICIES`.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise SpecError(
                f"speculative_config: expected a JSON object, got {got_repr(value)}"
            ) from None
    if not isinstance(value, dict):
        raise SpecError(f"speculative_config: expected None or a dict, got {got_repr(value)}")
    unknown = sorted(str(k) for k in value if k not in _KEYS)
    if unknown:
        raise SpecError(
            f"speculative_config.{unknown[0]}: expected one of {', '.join(_KEYS)} (the only "
            f"speculative_config keys kvpage implements), got an unknown key"
        )
    method = value.get("method", "ngram")
    if method not in SPEC_METHODS:
        raise SpecError(
            f"speculative_config.method: expected 'ngram' (draft models and EAGLE are not "
            f"implemented), got {got_repr(method)}"
        )
    if "num_speculative_tokens" not in value:
        raise SpecError("speculative_config.num_speculative_tokens: expected an int >= 1, got none")
    k = _int_ge1("num_speculative_tokens", value["num_speculative_tokens"])
    hi, lo = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
    if hi is None and lo is None:
        hi = lo = DEFAULT_PROMPT_LOOKUP
    elif hi is None:
        hi = lo = _int_ge1("prompt_lookup_min", lo)
    elif lo is None:
        lo = hi = _int_ge1("prompt_lookup_max", hi)
    hi = _int_ge1("prompt_lookup_max", hi)
    lo = _int_ge1("prompt_lookup_min", lo)
    if lo > hi:
        raise SpecError(
            f"speculative_config.prompt_lookup_min: expected <= prompt_lookup_max={hi}, got {lo}"
        )
    dbs = value.get("disable_by_batch_size")
    if dbs is not None:
        dbs = _int_ge1("disable_by_batch_size", dbs)
    policy = value.get("draft_policy", "adaptive")
    if policy not in DRAFT_POLICIES:
        raise SpecError(
            f"speculative_config.draft_policy: expected one of {', '.join(DRAFT_POLICIES)}, "
            f"got {got_repr(policy)}"
        )
    return SpeculativeConfig(str(method), k, hi, lo, dbs, str(policy))
