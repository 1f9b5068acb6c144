"""llama2.c's BPE tokenizer (``tokenizer.bin``), pure Python, and the bundled one.

llama2.c format (Karpathy, ``llama2.c/tokenizer.py`` ``export`` and ``run.c``): an int32
``max_token_length``, then per token a float32 score, an int32 byte length and the raw
bytes. Id 0 is ``<unk>``, 1 BOS, 2 EOS, ids 3..258 the byte-fallback tokens
``<0x00>``..``<0xFF>`` (id = byte + 3), the rest BPE merges with SentencePiece's ``▁``
already turned into a space.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

from kvpage.errors import SpecError
from kvpage.models.tokenizer_base import IncrementalDecoder

_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")


class Llama2cTokenizer:
    """The llama2.c BPE tokenizer (``tokenizer.bin`` format), pure Python.

    Encoding follows ``run.c``'s ``encode``: a leading space is put before non-empty text
    (SentencePiece's dummy prefix), each UTF-8 character is looked up as a piece, bytes
    of characters that are not pieces become byte tokens (id = byte + 3), then the
    adjacent pair whose concatenation is a piece with the highest score is merged
    (leftmost on ties) until nothing merges. Control and byte-fallback pieces (ids
    0..258) are never produced by lookup. Decoding follows ``run.c``'s ``decode``: the
    first piece after BOS loses its leading space, ``<0xHH>`` pieces become raw bytes,
    BOS/EOS/UNK produce no text.

    Stopping: llama2.c's ``generate`` stops when the model emits BOS (id 1) — the
    TinyStories models end a story with BOS, not EOS — so ``stop_token_ids`` is
    ``(eos_id, bos_id)`` = ``(2, 1)``.

    Args:
        path: a ``tokenizer.bin`` file.
        vocab_size: number of records to read (the file does not store it; llama2.c takes
            it from the model header). Default: read records until the file ends.

    Raises:
        SpecError: the file is truncated or has fewer than 259 records.
    """

    unk_id = 0
    bos_id: int | None = 1
    eos_id: int | None = 2
    num_byte_tokens = 256
    byte_offset = 3

    def __init__(self, path: str | Path, vocab_size: int | None = None) -> None:
        raw = Path(path).read_bytes()
        if len(raw) < 4:
            raise SpecError(f"tokenizer {path}: expected >= 4 bytes, got {len(raw)}")
        (self.max_token_length,) = struct.unpack_from("<i", raw, 0)
        pieces: list[bytes] = []
        scores: list[float] = []
        off = 4
        while off < len(raw) and (vocab_size is None or len(pieces) < vocab_size):
            if off + 8 > len(raw):
                raise SpecError(f"tokenizer {path}: expected a record at byte {off}, got EOF")
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            if n < 0 or off + n > len(raw):
                raise SpecError(f"tokenizer {path}: expected {n} piece bytes at {off}, got EOF")
            pieces.append(raw[off : off + n])
            scores.append(score)
            off += n
        if vocab_size is not None and len(pieces) != vocab_size:
            raise SpecError(f"tokenizer {path}: expected {vocab_size} records, got {len(pieces)}")
        first = self.byte_offset + self.num_byte_tokens
        if len(pieces) < first:
            raise SpecError(f"tokenizer {path}: expected >= {first} records, got {len(pieces)}")
        self.pieces = pieces
        self.scores = scores
        self.vocab_size = len(pieces)
        self.stop_token_ids: tuple[int, ...] = (2, 1)
        #: what the engine ends a sequence at by default: EOS only (``kvpage generate``
        #: adds BOS as a stop id, as run.c does)
        self.eos_token_ids: tuple[int, ...] = (2,)
        # lookup of mergeable pieces only (never control or byte-fallback ids)
        self._lookup: dict[bytes, int] = {}
        for i in range(first, len(pieces)):
            self._lookup.setdefault(pieces[i], i)
        self._piece_bytes = [self._bytes_of(i) for i in range(len(pieces))]

    def _bytes_of(self, i: int) -> bytes:
        if i in (self.unk_id, self.bos_id, self.eos_id):
            return b""
        m = _BYTE_PIECE.match(self.pieces[i])
        if m and self.byte_offset <= i < self.byte_offset + self.num_byte_tokens:
            return bytes([int(m.group(1), 16)])
        return self.pieces[i]

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: any Python string (encoded as UTF-8).
            bos: prepend BOS (id 1).
            eos: append EOS (id 2).

        Returns:
            The ids, each in ``[0, vocab_size)``.
        """
        if not isinstance(text, str):
            raise SpecError(f"text: expected str, got {type(text).__name__}")
        ids: list[int] = []
        if text:
            for ch in " " + text:
                b = ch.encode("utf-8", errors="surrogatepass")
                tid = self._lookup.get(b)
                if tid is not None:
                    ids.append(tid)
                else:
                    ids.extend(x + self.byte_offset for x in b)
        ids = self._merge(ids)
        if bos:
            ids.insert(0, 1)
        if eos:
            ids.append(2)
        return ids

    def _merge(self, ids: list[int]) -> list[int]:
        """Greedy BPE: repeatedly merge the adjacent pair whose concatenation is a piece
        with the highest score, leftmost on ties (llama2.c ``run.c`` ``encode``).

        Same result as rescanning all pairs after every merge, in O(n log n): the
        symbols form a doubly linked list indexed by their start position, and a heap
        holds candidate pairs keyed by ``(-score, left start)``. A merge bumps the
        version of the merged node and kills its right node; heap entries naming an old
        version or a dead node are skipped when popped (lazy invalidation). Merging keeps the left node's start,
        so start order is list order and "smallest start" is "leftmost". Pairs whose
        score is not ``> -inf`` (NaN or -inf) never merge, as in the rescan.
        """
        n = len(ids)
        if n < 2:
            return ids
        pieces, scores, lookup = self.pieces, self.scores, self._lookup
        tok = list(ids)
        nxt = list(range(1, n + 1))  # n = end of list
        prv = list(range(-1, n - 1))  # -1 = start of list
        ver = [0] * n
        alive = [True] * n
        heap: list[tuple[float, int, int, int, int, int]] = []
        neg_inf = float("-inf")

        def push(i: int) -> None:
            j = nxt[i]
            if j >= n:
                return
            tid = lookup.get(pieces[tok[i]] + pieces[tok[j]])
            if tid is None:
                return
            score = scores[tid]
            if not score > neg_inf:  # NaN or -inf: never the best in a rescan
                return
            heapq.heappush(heap, (-score, i, ver[i], j, ver[j], tid))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, vi, j, vj, tid = heapq.heappop(heap)
            if not (alive[i] and alive[j] and ver[i] == vi and ver[j] == vj and nxt[i] == j):
                continue  # stale: one side was merged since this entry was pushed
            tok[i] = tid
            ver[i] += 1
            alive[j] = False
            k = nxt[j]
            nxt[i] = k
            if k < n:
                prv[k] = i
            p = prv[i]
            if p >= 0:
                push(p)  # (p, i) entries with i's old version are now stale
            push(i)
        out: list[int] = []
        i = 0
        while i < n:
            out.append(tok[i])
            i = nxt[i]
        return out

    def decode_bytes(self, ids: Iterable[int], prev_id: int | None = None) -> bytes:
        """Raw bytes of ``ids`` (see class doc); ``prev_id`` is the id before them."""
        out = bytearray()
        prev = prev_id
        for raw_id in ids:
            i = int(raw_id)
            if not 0 <= i < self.vocab_size:
                raise SpecError(f"token id: expected 0 <= id < {self.vocab_size}, got {i}")
            piece = self._piece_bytes[i]
            if prev == self.bos_id and piece.startswith(b" "):
                piece = piece[1:]
            out += piece
            prev = i
        return bytes(out)

    def decode(self, ids: Sequence[int], prev_id: int | None = None) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD).

        Args:
            ids: token ids.
            prev_id: the id just before ``ids`` (e.g. the last prompt id) — a leading
                space is dropped when it is BOS, as in llama2.c.

        Raises:
            SpecError: an id is outside the vocabulary.
        """
        return self.decode_bytes(ids, prev_id).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """The bytes each id decodes to, by id (``b""`` for UNK/BOS/EOS, one byte for the
        byte-fallback ids, the piece otherwise): the vocabulary a grammar library needs
        (``kvpage.engine.structured.tokenizer_info``). A leading space is kept: it is
        dropped only right after BOS, which generated text never starts with."""
        return list(self._piece_bytes)

    def id_to_piece(self, token_id: int) -> str:
        """The stored piece text of one id (e.g. ``"<0x0A>"``, ``" the"``)."""
        return self.pieces[token_id].decode("utf-8", errors="replace")

    def incremental_decoder(self, prefix_ids: Sequence[int] = ()) -> IncrementalDecoder:
        """A streaming decoder that starts after ``prefix_ids`` (see IncrementalDecoder)."""
        return IncrementalDecoder(self, prefix_ids)


def bundled_tokenizer_path() -> Path:
    """Path of the bundled ``tok512.bin`` (works from a wheel via importlib.resources)."""
    return Path(str(resources.files("kvpage.models") / "data" / "tok512.bin"))


__all__ = ["Llama2cTokenizer", "bundled_tokenizer_path"]
