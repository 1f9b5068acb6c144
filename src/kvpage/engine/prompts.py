"""Prompt parsing of ``LLMEngine.add_request``: text, strict token ids or a dict."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kvpage.errors import RequestRejected

#: the keys a dict prompt may have
PROMPT_KEYS = ("prompt_token_ids", "prompt", "cache_salt")


def token_ids(seq: Any, vocab_size: int) -> list[int]:
    """A strict token-id list from a list/tuple of ints (Python or numpy integers; no
    bool, float or str) or a 1-D integer numpy array / torch tensor.

    Raises:
        RequestRejected: reason ``"invalid_prompt"``, e.g.
            ``"prompt_token_ids[1]: expected int, got str '403'"``, or an id outside
            ``[0, vocab_size)``.
    """
    if isinstance(seq, (np.ndarray, torch.Tensor)):
        kind = "integer"
        if isinstance(seq, np.ndarray):
            ok = seq.dtype.kind in "iu"
            dt = str(seq.dtype)
        else:
            ok = not seq.dtype.is_floating_point and not seq.dtype.is_complex
            ok = ok and seq.dtype is not torch.bool
            dt = str(seq.dtype)
        if seq.ndim != 1 or not ok:
            raise RequestRejected(
                f"prompt_token_ids: expected a 1-D {kind} array, got {seq.ndim}-D {dt}",
                reason="invalid_prompt",
            )
        seq = seq.tolist()
    ids: list[int] = []
    for i, t in enumerate(seq):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise RequestRejected(
                f"prompt_token_ids[{i}]: expected int, got {type(t).__name__} {t!r}",
                reason="invalid_prompt",
            )
        ids.append(int(t))
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(
            f"prompt_token_ids: expected ids in [0, {vocab_size}), got {bad[:5]}",
            reason="invalid_prompt",
        )
    return ids


def parse_prompt(
    prompt: Any, tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int], str | None]:
    """Split a prompt into ``(text or None, token ids, cache_salt or None)``.

    Args:
        prompt: text, token ids (see :func:`token_ids`) or a dict with exactly one of
            ``"prompt_token_ids"`` / ``"prompt"`` and optionally ``"cache_salt"``
            (:data:`PROMPT_KEYS`; other keys are rejected).
        tokenizer: encodes text (``encode(text, bos=True)``); None = token ids only.
        vocab_size: token ids must be in ``[0, vocab_size)``.

    Raises:
        RequestRejected: reason ``"invalid_prompt"``.
    """
    text: str | None = None
    salt = None
    if isinstance(prompt, Mapping):
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise RequestRejected(
                f"prompt: expected keys among {list(PROMPT_KEYS)}, got unknown {unknown}",
                reason="invalid_prompt",
            )
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            # "" is refused, not read as "no salt" (the HTTP API refuses it likewise)
            raise RequestRejected(
                f"cache_salt: expected None or a non-empty string, got {salt!r}",
                reason="invalid_prompt",
            )
        if "prompt_token_ids" in prompt and "prompt" in prompt:
            raise RequestRejected(
                "prompt: expected one of 'prompt_token_ids' or 'prompt', got both",
                reason="invalid_prompt",
            )
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
            if isinstance(prompt, (str, bytes, bytearray)):
                raise RequestRejected(
                    f"prompt_token_ids: expected a list of ints, got {type(prompt).__name__}",
                    reason="invalid_prompt",
                )
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise RequestRejected(
                    f"prompt: expected a string, got {type(prompt).__name__}",
                    reason="invalid_prompt",
                )
        else:
            raise RequestRejected(
                f"prompt: expected a dict with 'prompt_token_ids' or 'prompt', "
                f"got keys {sorted(prompt)}",
                reason="invalid_prompt",
            )
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejected(
                "prompt: expected token ids (this model has no tokenizer), got a string",
                reason="invalid_prompt",
            )
        text = prompt
        ids = list(tokenizer.encode(prompt, bos=True)) if prompt else []
    elif isinstance(prompt, (list, tuple, np.ndarray, torch.Tensor)):
        ids = token_ids(prompt, vocab_size)
    else:
        raise RequestRejected(
            f"prompt: expected a string, a list of token ids (or a 1-D integer numpy "
            f"array / torch tensor) or a dict, got {type(prompt).__name__}",
            reason="invalid_prompt",
        )
    return text, ids, salt


__all__ = ["PROMPT_KEYS", "parse_prompt", "token_ids"]
