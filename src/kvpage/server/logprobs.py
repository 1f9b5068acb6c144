"""Log-probabilities on the wire: the engine's ``PositionLogprobs`` in OpenAI's formats.

* ``/v1/completions`` (OpenAI's legacy format, as vLLM writes it)::

      {"tokens": [str], "token_logprobs": [float | null],
       "top_logprobs": [{token_text: logprob} | null], "text_offset": [int]}

  ``top_logprobs`` holds the chosen token plus the ``logprobs`` most likely ones. With
  ``echo`` the prompt's tokens come first (the first prompt token has ``null``).
* ``/v1/chat/completions``::

      {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
        "logprob", "bytes"}]}]}

  ``top_logprobs`` holds the ``top_logprobs`` most likely tokens, best first.
* ``prompt_logprobs`` (vLLM's extension): a list with ``null`` for the first prompt
  token, then ``{token_id: {"logprob", "rank", "decoded_token"}}`` per prompt token.

Token texts are ``tokenizer.decode([id])`` (the engine's ``decoded_token``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpage.engine.params import PositionLogprobs

__all__ = ["chat_logprobs", "completion_logprobs", "prompt_logprobs_json"]


def _text(
    entry: PositionLogprobs | None, token_id: int, decode: Callable[[int], str] | None = None
) -> str:
    lp = entry.get(token_id) if entry else None
    t = lp.decoded_token if lp is not None else None
    if t is not None:
        return str(t)
    return decode(token_id) if decode is not None else str(token_id)


def completion_logprobs(
    token_ids: list[int],
    entries: Sequence[PositionLogprobs | None],
    *,
    prompt: tuple[list[int], Sequence[PositionLogprobs | None]] | None = None,
    offset: int = 0,
    decode: Callable[[int], str] | None = None,
    prompt_text: str | None = None,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object.

    ``text_offset[i]`` is where ``tokens[i]`` starts in the choice's ``text`` (OpenAI's
    field; ``text[text_offset[i]:]`` starts with ``tokens[i]``). With ``echo`` the text
    starts with ``prompt_text``: a prompt token whose single-token text has a leading
    space that the echoed text lacks at that point (the SentencePiece dummy prefix, which
    decoding a whole sequence drops before its first word) is listed without it (in
    ``tokens`` and in that position's ``top_logprobs`` keys alike), and
    the generated tokens' offsets start at ``offset + len(prompt_text)`` whatever the
    prompt tokens' texts add up to.

    Args:
        token_ids: generated token ids.
        entries: one PositionLogprobs per generated token.
        prompt: with ``echo``, the prompt's ids and its prompt logprobs (first None).
        offset: ``text_offset`` of the first token (characters before it in ``text``).
        decode: token id -> text, for tokens without an entry (the first prompt token).
        prompt_text: with ``echo``, the echoed prompt text (``text`` starts with it).
    """
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pairs: list[tuple[int, PositionLogprobs | None]] = []
    if prompt is not None:
        pairs.extend(zip(prompt[0], prompt[1]))
    num_prompt = len(pairs)
    pairs.extend(zip(token_ids, entries))
    pos = offset
    for i, (tid, ent) in enumerate(pairs):
        s = _text(ent, tid, decode)
        strip = False
        if prompt_text is not None and i < num_prompt:
            rest = prompt_text[pos - offset :]
            strip = s.startswith(" ") and not rest.startswith(s) and rest.startswith(s[1:])
        elif prompt_text is not None and i == num_prompt:
            pos = offset + len(prompt_text)
        if strip:
            s = s[1:]
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        token_lps.append(None if ent is None else float(ent[tid].logprob))
        tops.append(None if ent is None else _top_by_text(ent, strip))
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _top_by_text(ent: PositionLogprobs, strip: bool) -> dict[str, float]:
    """One position's ``top_logprobs``: token text -> logprob, spelled as that position's
    ``tokens[i]`` (so ``top_logprobs[i][tokens[i]]`` holds): with ``strip`` the
    alternatives lose the dummy-prefix space as well."""
    top: dict[str, float] = {}
    for t, v in ent.items():
        alt = _text(ent, t)
        top[alt[1:] if strip and alt.startswith(" ") else alt] = float(v.logprob)
    return top


def chat_logprobs(
    token_ids: list[int], entries: Sequence[PositionLogprobs], num_top: int
) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``)."""
    content = []
    for tid, ent in zip(token_ids, entries):
        s = _text(ent, tid)
        ranked = sorted(ent.items(), key=lambda kv: kv[1].rank)[:num_top]
        content.append(
            {
                "token": s,
                "logprob": float(ent[tid].logprob),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": _text(ent, t),
                        "logprob": float(v.logprob),
                        "bytes": list(_text(ent, t).encode("utf-8")),
                    }
                    for t, v in ranked
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_json(
    plp: Sequence[PositionLogprobs | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field (token ids as string keys, as JSON requires)."""
    if plp is None:
        return None
    return [
        None
        if ent is None
        else {
            str(t): {"logprob": float(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
            for t, v in ent.items()
        }
        for ent in plp
    ]
