"""Tokenizers: llama2.c tok512.bin encode/decode, streaming decode, HF adapter."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpage.errors import SpecError
from kvpage.models import ByteTokenizer, HFTokenizer, Llama2cTokenizer, bundled_tokenizer_path


@pytest.fixture(scope="module")
def tok() -> Llama2cTokenizer:
    return Llama2cTokenizer(bundled_tokenizer_path(), vocab_size=512)


def test_vocabulary_layout(tok: Llama2cTokenizer) -> None:
    assert tok.vocab_size == 512 and tok.max_token_length == 7
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    # llama2.c stops when the model emits BOS; EOS stops too
    assert set(tok.stop_token_ids) == {1, 2}
    assert tok.id_to_piece(1) == "\n<s>\n" and tok.id_to_piece(2) == "\n</s>\n"
    assert [tok.id_to_piece(i) for i in (3, 13, 258)] == ["<0x00>", "<0x0A>", "<0xFF>"]
    assert tok.id_to_piece(259) == " t" and tok.id_to_piece(261) == " a"


def test_known_ids(tok: Llama2cTokenizer) -> None:
    ids = tok.encode("Once upon a time, there was")
    assert ids == [1, 403, 407, 261, 378, 432, 383, 286]
    pieces = [tok.id_to_piece(i) for i in ids[1:]]
    assert pieces == [" Once", " upon", " a", " time", ",", " there", " was"]
    assert tok.encode("Once", bos=False) == [403]
    assert tok.encode("x", bos=False, eos=True)[-1] == 2
    assert tok.encode("") == [1] and tok.encode("", bos=False) == []


def test_byte_fallback(tok: Llama2cTokenizer) -> None:
    # a character that is no piece becomes its UTF-8 bytes, id = byte + 3
    ids = tok.encode("🙂", bos=False)
    assert ids[1:] == [b + 3 for b in "🙂".encode()]
    assert tok.id_to_piece(ids[0]) == " "
    assert tok.encode("\n", bos=False)[-1] == 0x0A + 3


def test_greedy_merges_pick_highest_score(tok: Llama2cTokenizer) -> None:
    ids = tok.encode("the", bos=False)
    # one piece " the" (id 265) beats " t" + "he" and "t" + "he"
    assert ids == [265] and tok.id_to_piece(265) == " the"
    # no adjacent pair of the result can still merge
    for text in ["the cat sat on the mat", "Lily and Ben played", "supercalifragilistic"]:
        ids = tok.encode(text, bos=False)
        for a, b in zip(ids, ids[1:]):
            assert tok.pieces[a] + tok.pieces[b] not in tok._lookup


@given(st.text(max_size=40))
def test_round_trip(text: str) -> None:
    tok = Llama2cTokenizer(bundled_tokenizer_path(), vocab_size=512)
    # lone surrogates cannot be UTF-8; everything else round-trips exactly
    text = text.encode("utf-8", errors="ignore").decode("utf-8")
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, bos=False)) == (" " + text if text else "")


def test_decode_drops_space_only_after_bos(tok: Llama2cTokenizer) -> None:
    ids = tok.encode("Once upon")
    assert tok.decode(ids[1:]) == " Once upon"
    assert tok.decode(ids[1:], prev_id=1) == "Once upon"
    assert tok.decode([1, 2, 0]) == ""
    with pytest.raises(SpecError, match="token id"):
        tok.decode([512])


def test_decode_continuation(tok: Llama2cTokenizer) -> None:
    from kvpage.models import decode_continuation

    story = tok.encode("Once upon a time")
    assert decode_continuation(tok, story[:1], story[1:]) == "Once upon a time"
    assert decode_continuation(tok, story[:3], story[3:]) == " a time"
    emoji = tok.encode("🙂", bos=False)  # " " then four byte pieces
    assert decode_continuation(tok, [1, *emoji[:2]], emoji[2:]) == "🙂"


def test_incremental_decoder_holds_partial_utf8(tok: Llama2cTokenizer) -> None:
    ids = tok.encode("a🙂b")
    dec = tok.incremental_decoder(ids[:1])
    outs = [dec.step(i) for i in ids[1:]]
    assert "".join(outs) == "a🙂b"
    emoji_start = ids.index(0xF0 + 3) - 1
    assert outs[emoji_start : emoji_start + 3] == ["", "", ""]
    assert "🙂" in outs[emoji_start + 3]
    # a dangling partial character comes out on flush
    dec2 = tok.incremental_decoder([1])
    assert dec2.step(0xF0 + 3) == "" and dec2.flush() == "\ufffd"


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    raw = bundled_tokenizer_path().read_bytes()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(raw[:100])
    with pytest.raises(SpecError, match="expected"):
        Llama2cTokenizer(bad)
    small = tmp_path / "small.bin"
    small.write_bytes(struct.pack("<i", 1) + struct.pack("<fi", 0.0, 1) + b"a")
    with pytest.raises(SpecError, match="259"):
        Llama2cTokenizer(small)
    with pytest.raises(SpecError, match="513 records"):
        Llama2cTokenizer(bundled_tokenizer_path(), vocab_size=513)


def test_byte_tokenizer() -> None:
    t = ByteTokenizer(256, bos_id=None, eos_id=None)
    assert t.decode(t.encode("héllo")) == "héllo"
    with pytest.raises(SpecError, match="vocab_size"):
        ByteTokenizer(100).encode("x")


def _tiny_hf_tokenizer():  # type: ignore[no-untyped-def]
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from kvpage.testing.hf_folders import byte_level_bpe

    texts = ["Once upon a time there was a cat.", "The cat sat on a mat."]
    t = byte_level_bpe(texts, ["<unk>", "<s>", "</s>"], vocab_size=300)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_hf_adapter_round_trip() -> None:
    hf = _tiny_hf_tokenizer()
    tok = HFTokenizer(hf)
    assert tok.bos_id == hf.convert_tokens_to_ids("<s>")
    assert tok.stop_token_ids == (hf.convert_tokens_to_ids("</s>"),)
    ids = tok.encode("Once upon a cat 🙂")
    # BOS exactly as the tokenizer adds it: this one (no post-processor) adds none
    assert ids == hf.encode("Once upon a cat 🙂") and tok.bos_id not in ids
    assert tok.decode(ids) == "Once upon a cat 🙂"
    dec = tok.incremental_decoder(ids[:1])
    assert tok.decode(ids[:1]) + "".join(dec.step(i) for i in ids[1:]) + dec.flush() == (
        "Once upon a cat 🙂"
    )
