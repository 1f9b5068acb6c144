"""The tokenizer interface (:class:`Tokenizer`) and streaming decode on top of any
tokenizer (:class:`IncrementalDecoder`, :func:`decode_continuation`).

Every tokenizer has ``encode(text, bos=True) -> list[int]``, ``decode(ids) -> str``,
``bos_id``, ``eos_id``, ``stop_token_ids`` and ``vocab_size``, plus
``incremental_decoder(prefix_ids)`` for streaming output that never splits a UTF-8
character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer.

    Attributes:
        bos_id: id prepended by ``encode(..., bos=True)``; None if the vocabulary has none.
        eos_id: the end-of-sequence id; None if none.
        stop_token_ids: ids that end generation by default (includes ``eos_id``).
        eos_token_ids (optional): the EOS ids the engine ends a sequence at unless
            ``ignore_eos`` (default ``(eos_id,)``); Hugging Face folders: the union of
            the tokenizer's, config.json's and generation_config.json's EOS ids.
        vocab_size: number of ids.
    """

    bos_id: int | None
    eos_id: int | None
    stop_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def incremental_decoder(self, prefix_ids: Sequence[int] = ()) -> IncrementalDecoder: ...


class IncrementalDecoder:
    """Streaming decode: feed ids one at a time, get only text that is final.

    Text is produced by decoding ``prefix_ids + ids`` and subtracting the text of
    ``prefix_ids``; a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until
    the next id completes it, or until ``flush``.

    Args:
        tokenizer: anything with ``decode_bytes``-free ``decode(ids) -> str``.
        prefix_ids: ids already shown (e.g. the prompt); they give context (leading
            space after BOS, byte pieces) but their text is not emitted.
    """

    def __init__(self, tokenizer: Tokenizer, prefix_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids = list(prefix_ids)
        self._emitted = len(tokenizer.decode(self._ids))

    def step(self, token_id: int) -> str:
        """Append one id; return the newly final text (maybe ``""``)."""
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids)
        end = len(text)
        while end > self._emitted and text[end - 1] == "\ufffd":
            end -= 1
        if end <= self._emitted:
            return ""
        out = text[self._emitted : end]
        self._emitted = end
        return out

    def flush(self) -> str:
        """Return whatever is held back (replacement characters included)."""
        text = self._tok.decode(self._ids)
        out = text[self._emitted :]
        self._emitted = len(text)
        return out


def decode_continuation(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> str:
    """Text of ``output_ids`` as it reads after ``prompt_ids``.

    ``decode(prompt + output)`` minus ``decode(prompt)``: the prompt gives the context
    that a lone ``decode(output_ids)`` lacks (llama2.c drops the leading space of the
    first piece after BOS, so a story generated from a BOS-only prompt starts "Once",
    not " Once"; a character whose UTF-8 bytes straddle the boundary is output text).
    """
    # an incomplete character at the end of the prompt belongs to the output that ends it
    head = tokenizer.decode(list(prompt_ids)).rstrip("\ufffd")
    full = tokenizer.decode([*prompt_ids, *output_ids])
    if full.startswith(head):
        return full[len(head) :]
    return tokenizer.decode(list(output_ids))  # decoding was not prefix-stable


__all__ = ["IncrementalDecoder", "Tokenizer", "decode_continuation"]
