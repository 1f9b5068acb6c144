"""Tokenizers behind one small interface: llama2.c's ``tokenizer.bin`` format and an
adapter for Hugging Face tokenizers.

Every tokenizer has ``encode(text, bos=True) -> list[int]``, ``decode(ids) -> str``,
``bos_id``, ``eos_id``, ``stop_token_ids`` and ``vocab_size``, plus
``incremental_decoder(prefix_ids)`` for streaming output that never splits a UTF-8
character.

The interface and streaming decode are in :mod:`kvpage.models.tokenizer_base`, the
llama2.c tokenizer in :mod:`kvpage.models.tokenizer_llama2c`; this module holds the
Hugging Face adapter and the byte fallback and re-exports the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpage.errors import SpecError
from kvpage.models.tokenizer_base import IncrementalDecoder, Tokenizer, decode_continuation
from kvpage.models.tokenizer_llama2c import Llama2cTokenizer, bundled_tokenizer_path


class HFTokenizer:
    """Adapter giving a ``transformers`` tokenizer the kvpage interface.

    Encoding follows the tokenizer: ``encode(text, bos=True)`` is
    ``hf.encode(text, add_special_tokens=True)``, so BOS (and any other special token
    the tokenizer adds) is there exactly when the tokenizer adds it — a Llama-style
    tokenizer prepends ``<s>``, a Qwen-style one adds nothing. ``config.json``'s
    ``bos_token_id`` is never prepended on its own (transformers and vLLM follow the
    tokenizer too).

    Stop ids (vLLM's rule, ``SamplingParams.update_from_generation_config``): the
    tokenizer's ``eos_token_id`` is ``eos_id``; ``eos_token_ids`` (= ``stop_token_ids``)
    is the ordered union of it, ``config.json``'s ``eos_token_id`` and
    ``generation_config.json``'s ``eos_token_id`` (each an int or a list).

    Args:
        tokenizer: a ``PreTrainedTokenizerBase`` (e.g. from ``AutoTokenizer``).
        eos_id: more EOS ids, e.g. ``config.json``'s ``eos_token_id`` (int or list).
        extra_eos_ids: more EOS ids, e.g. ``generation_config.json``'s.

    Attributes:
        hf: the wrapped transformers tokenizer (what ``LLM.get_tokenizer()`` returns).
        chat_template: the tokenizer's Jinja chat template (None when it has none).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_id: int | Sequence[int] | None = None,
        extra_eos_ids: int | Sequence[int] | None = None,
    ) -> None:
        self.hf = tokenizer
        self.bos_id: int | None = tokenizer.bos_token_id
        stops = _union(_id_list(tokenizer.eos_token_id), _id_list(eos_id), _id_list(extra_eos_ids))
        self.eos_id: int | None = stops[0] if stops else None
        self.vocab_size = len(tokenizer)
        self.eos_token_ids: tuple[int, ...] = tuple(stops)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) and t else None

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, eos_id: int | Sequence[int] | None = None
    ) -> HFTokenizer:
        """Load with ``transformers.AutoTokenizer.from_pretrained(path)`` (local only);
        ``generation_config.json``'s EOS ids in ``path`` join the stop ids.

        Raises:
            SpecError: transformers is missing, the folder has no tokenizer, or its
                generation_config.json is malformed.
        """
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is an extra
            raise SpecError("tokenizer: expected transformers installed, got ImportError") from e
        from kvpage.models.generation_config import generation_eos_ids, read_generation_config

        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            tok_json = Path(path) / "tokenizer.json"
            if not tok_json.is_file():
                raise SpecError(f"tokenizer {path}: expected a loadable tokenizer, got {e}") from e
            # a bare tokenizer.json (no tokenizer_config.json): load it as it is
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_json))  # type: ignore[no-untyped-call]
        extra = generation_eos_ids(read_generation_config(path))
        return cls(tok, eos_id=eos_id, extra_eos_ids=extra)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids of ``text``: ``hf.encode(text, add_special_tokens=bos)`` (``bos=True``
        adds the specials the tokenizer adds, which may be none)."""
        return [int(i) for i in self.hf.encode(text, add_special_tokens=bos)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    def incremental_decoder(self, prefix_ids: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self, prefix_ids)


def _union(*lists: list[int]) -> list[int]:
    """The ids of ``lists`` in order of first appearance."""
    out: list[int] = []
    for ids in lists:
        out.extend(i for i in ids if i not in out)
    return out


def _id_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(i) for i in x]
    return [int(x)]


class ByteTokenizer:
    """Fallback for models without a tokenizer (e.g. random-weight test models): ids
    0..255 are UTF-8 bytes, other ids produce no text.

    Args:
        vocab_size: the model's vocabulary size (>= 1).
        bos_id / eos_id: from the model config (may be None; ``eos_id`` may be a list,
            see HFTokenizer).
    """

    def __init__(
        self, vocab_size: int, bos_id: int | None = None, eos_id: int | Sequence[int] | None = None
    ):
        self.vocab_size = int(vocab_size)
        self.bos_id = bos_id
        stops = _id_list(eos_id)
        self.eos_id: int | None = stops[0] if stops else None
        self.eos_token_ids: tuple[int, ...] = tuple(stops)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """UTF-8 bytes of ``text`` as ids (BOS first if asked).

        Raises:
            SpecError: the vocabulary is smaller than 256.
        """
        if self.vocab_size < 256:
            raise SpecError(
                f"ByteTokenizer.vocab_size: expected >= 256 to encode text, got {self.vocab_size}"
            )
        ids = list(text.encode("utf-8"))
        if bos and self.bos_id is not None:
            ids.insert(0, int(self.bos_id))
        return ids

    def token_bytes(self) -> list[bytes]:
        """The bytes each id decodes to, by id: ids 0..255 their byte, BOS/EOS and ids
        from 256 ``b""`` (see ``kvpage.engine.structured.tokenizer_info``)."""
        specials = {self.bos_id, *self.stop_token_ids}
        return [
            bytes([i]) if i < 256 and i not in specials else b"" for i in range(self.vocab_size)
        ]

    def decode(self, ids: Sequence[int]) -> str:
        specials = {self.bos_id, *self.stop_token_ids}
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256 and int(i) not in specials)
        return data.decode("utf-8", errors="replace")

    def incremental_decoder(self, prefix_ids: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self, prefix_ids)


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDecoder",
    "Llama2cTokenizer",
    "Tokenizer",
    "bundled_tokenizer_path",
    "decode_continuation",
]
