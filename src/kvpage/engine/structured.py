"""Structured outputs (constrained decoding): JSON schema, JSON object, regex, choice and
grammar constraints on what a request may generate, with xgrammar.

Pieces and who owns what:

* :class:`StructuredOutputsParams` — the constraint of one request
  (``SamplingParams.structured_outputs``), vLLM's class and field names (vLLM
  ``vllm/sampling_params.py``): exactly one of ``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object`` is set.
* :class:`GrammarCompilerPool` — one per engine: the tokenizer's vocabulary as
  ``xgrammar.TokenizerInfo`` (built from kvpage's tokenizer objects, see
  :func:`tokenizer_info`), an ``xgrammar.GrammarCompiler`` and one background thread.
  :meth:`GrammarCompilerPool.submit` checks a constraint at once (a tokenizer-free parse,
  a few ms; a bad one raises ``RequestRejected``) and compiles it against the vocabulary
  on the thread, so the engine loop never waits on a compile; compiled grammars are
  cached per constraint key (the pool is per tokenizer).
* :class:`GrammarState` — one per constrained sequence (each of ``n`` samples has its
  own): an ``xgrammar.GrammarMatcher`` that has accepted every generated token of the
  sequence. It lives with the user request's engine-side state
  (``OutputProcessor``), not with the scheduler's sequence, so a preempted sequence
  (recompute or swap) keeps it: recompute re-prefills the generated tokens, it does not
  re-sample them, so the matcher must not be reset or replayed.
* :func:`apply_token_bitmask` — the sampler's call: ``-inf`` on the logits of the tokens
  the grammar forbids, for the constrained rows only.

A sequence whose grammar leaves no token allowed (every logit ``-inf`` after the mask,
penalties and the ``min_tokens`` mask, e.g. a finished grammar with ``min_tokens`` not
reached, or a vocabulary that cannot spell what the grammar needs) finishes with
:data:`DEAD_END_FINISH_REASON`; a grammar that has accepted its end finishes the
sequence with ``"stop"``.

JSON whitespace: as vLLM with xgrammar, whitespace between JSON elements is allowed
unless ``disable_any_whitespace``; unlike vLLM, each run of it is bounded to
:data:`MAX_WHITESPACE` characters, so a model cannot loop on spaces until ``max_tokens``.
Objects are strict (xgrammar ``strict_mode``): no properties or items beyond the schema.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kvpage.errors import RequestRejected

__all__ = [
    "DEAD_END_FINISH_REASON",
    "MAX_WHITESPACE",
    "GrammarCompilerPool",
    "GrammarState",
    "StructuredOutputsParams",
    "apply_token_bitmask",
    "check_constraint",
    "preload",
    "tokenizer_info",
    "xgrammar_version",
]

#: finish reason of a sequence whose grammar allows no next token
DEAD_END_FINISH_REASON = "grammar_dead_end"

#: most whitespace characters between two JSON elements (xgrammar ``max_whitespace_cnt``)
MAX_WHITESPACE = 4

#: compiled grammars kept per pool (least recently used dropped first)
CACHE_SIZE = 256

#: longest library message quoted in a refusal
MESSAGE_CHARS = 200

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:[0-9]+: ")


def _bad(name: str, expected: str, got: object) -> RequestRejected:
    return RequestRejected(
        f"{name}: expected {expected}, got {got!r}"[:300], reason="invalid_structured_outputs"
    )


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``).

    Exactly one of the constraint fields is set.

    Attributes:
        json: a JSON schema (dict or its JSON text): the output is one JSON value that
            validates against it. Supported subset: xgrammar's (types, ``properties``,
            ``required``, ``additionalProperties``, ``items``/``prefixItems``,
            ``minItems``/``maxItems``, ``enum``/``const``, ``anyOf``/``oneOf``,
            ``$ref``/``$defs``, integer and number bounds, string ``minLength``/
            ``maxLength``/``pattern``/``format``); anything else is refused with xgrammar's
            message.
        regex: the output matches this regular expression (xgrammar's dialect, anchored).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar: xgrammar EBNF (GBNF-style, ``root ::= ...``)
            when the text contains ``::=``, else Lark (``start: ...``).
        json_object: the output is a JSON object (any keys).
        disable_any_whitespace: JSON without whitespace between elements.
        disable_fallback: accepted for vLLM compatibility; kvpage has one backend, so
            there is nothing to fall back to.
        disable_additional_properties: accepted; kvpage's JSON schemas are always strict
            (no properties beyond the schema), which is what it asks for.
        whitespace_pattern: not implemented (refused unless None).
        structural_tag: not implemented (refused unless None).

    Raises:
        RequestRejected: reason ``"invalid_structured_outputs"``: not exactly one
            constraint, a field of the wrong type, or an unimplemented option.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields (called on construction).

        Raises:
            RequestRejected: reason ``"invalid_structured_outputs"``.
        """
        p = "structured_outputs"
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise _bad(p, f"exactly one of {', '.join(_KINDS)}", set_ or "none")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _bad(f"{p}.json", "a JSON schema (a dict or its JSON text)", self.json)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise _bad(f"{p}.{name}", "a non-empty string", v)
        ch = self.choice
        if ch is not None and (
            not isinstance(ch, (list, tuple)) or not ch or not all(isinstance(c, str) for c in ch)
        ):
            raise _bad(f"{p}.choice", "a non-empty list of strings", ch)
        if self.json_object not in (None, True, False):
            raise _bad(f"{p}.json_object", "a bool", self.json_object)
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{p}.{name}", "a bool", getattr(self, name))
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise _bad(f"{p}.{name}", "None (not implemented by kvpage)", getattr(self, name))

    @property
    def kind(self) -> str:
        """Which constraint is set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"``
        or ``"json_object"``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """The compile-cache key: ``(kind, canonical text, any whitespace)``."""
        kind = self.kind
        if kind == "json":
            v = self.json
            text = json.dumps(v, sort_keys=True) if isinstance(v, dict) else str(v)
        elif kind == "choice":
            text = json.dumps(list(self.choice or ()))
        elif kind == "json_object":
            text = ""
        else:
            text = str(getattr(self, kind))
        return kind, text, not self.disable_any_whitespace


def xgrammar_version() -> str:
    """The installed xgrammar's version.

    Raises:
        RequestRejected: reason ``"structured_outputs_unavailable"`` when it is missing.
    """
    _xgr()
    from importlib.metadata import version

    return version("xgrammar")


def preload() -> bool:
    """Import xgrammar now (about 1.4 s on the measured machine) so the first
    constrained request does not pay for it on the server's event loop; True when it is
    installed."""
    try:
        _xgr()
    except RequestRejected:
        return False
    return True


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - a pinned dependency
        raise RequestRejected(
            "structured_outputs: expected the xgrammar package installed (pip install "
            "xgrammar, pinned in requirements/lock.txt), got ImportError",
            reason="structured_outputs_unavailable",
        ) from None
    return xgrammar


def _library_message(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else type(exc).__name__
    return _XGR_PREFIX.sub("", first)[:MESSAGE_CHARS]


def _ebnf_choice(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals in xgrammar (same escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _bounded_strings(node: Any) -> Any:
    """``node`` with each ``{"type": "string"}`` schema that has ``minLength`` /
    ``maxLength`` (and no ``pattern``, ``format``, ``enum`` or ``const``) given the
    equivalent ``pattern`` of unescaped characters other than ``"``, ``\\`` and
    U+0000-U+001F. A type list such as ``["string", "null"]``
    becomes an ``anyOf`` of that string and the other types.

    Why: xgrammar 0.2.8's grammar for a length-bounded string lets raw control
    characters through (``"a\\x0c"`` is accepted for ``{"type": "string", "maxLength":
    12}``), which is not JSON; its pattern grammar does not. The cost: such strings are
    written without escapes.
    """
    if isinstance(node, list):
        return [_bounded_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: (v if k in ("enum", "const", "default", "examples") else _bounded_strings(v))
        for k, v in node.items()
    }
    types = out.get("type")
    if (
        (types == "string" or (isinstance(types, list) and "string" in types))
        and ("minLength" in out or "maxLength" in out)
        and not {"pattern", "format", "enum", "const"} & set(out)
    ):
        lo = int(out.pop("minLength", 0))
        hi = out.pop("maxLength", None)
        pattern = f'^[^"\\\\\\x00-\\x1f]{{{lo},{"" if hi is None else int(hi)}}}$'
        if types == "string":
            out["pattern"] = pattern
            return out
        # a type list: the string branch gets the pattern, the others keep the rest
        others = [t for t in types if t != "string"]
        rest = {k: v for k, v in out.items() if k != "type"}
        other = {**rest, "type": others[0] if len(others) == 1 else others}
        return {"anyOf": [{"type": "string", "pattern": pattern}, other]}
    return out


def _grammar(key: tuple[str, str, bool]) -> Any:
    """The tokenizer-free ``xgrammar.Grammar`` of a constraint key (raises the library's
    error)."""
    xgr = _xgr()
    kind, text, any_ws = key
    ws: dict[str, Any] = {"any_whitespace": any_ws, "strict_mode": True}
    if any_ws:
        ws["max_whitespace_cnt"] = MAX_WHITESPACE
    if kind == "json":
        schema = _bounded_strings(json.loads(text))
        return xgr.Grammar.from_json_schema(json.dumps(schema), **ws)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', **ws)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_ebnf_choice(json.loads(text)))
    if "::=" in text:
        return xgr.Grammar.from_ebnf(text)
    return xgr.Grammar.from_lark(text)


def check_constraint(params: StructuredOutputsParams, field: str | None = None) -> None:
    """Parse ``params``' constraint without a tokenizer (a few ms): a schema, regex or
    grammar xgrammar cannot use is refused here.

    Args:
        params: the constraint.
        field: the name to blame (default ``"structured_outputs.<kind>"``); the server
            passes its HTTP field (``"response_format.json_schema.schema"``, ``"guided_json"``).

    Raises:
        RequestRejected: reason ``"invalid_structured_outputs"``, message ``"<field>:
            expected a <kind> xgrammar accepts, got <xgrammar's message, at most 200
            characters>"``.
    """
    key = params.key()
    if key[0] == "json":
        try:
            json.loads(key[1])
        except ValueError as e:
            name = field or "structured_outputs.json"
            raise RequestRejected(
                f"{name}: expected a JSON schema (valid JSON), got {str(e)[:MESSAGE_CHARS]}",
                reason="invalid_structured_outputs",
            ) from None
        where = _ignored_keyword(json.loads(key[1]), "")
        if where is not None:
            name = field or "structured_outputs.json"
            raise RequestRejected(
                f"{name}: expected a JSON schema without {where[1]!r} (xgrammar "
                f"{xgrammar_version()} accepts it but does not enforce it), got it at "
                f"{where[0] or '/'}",
                reason="invalid_structured_outputs",
            )
    try:
        _grammar(key)
    except (RuntimeError, ValueError, TypeError) as e:
        name = field or f"structured_outputs.{key[0]}"
        what = {"json": "JSON schema", "grammar": "grammar", "regex": "regex"}.get(key[0], "value")
        raise RequestRejected(
            f"{name}: expected a {what} xgrammar {xgrammar_version()} supports, got error: "
            f"{_library_message(e)}",
            reason="invalid_structured_outputs",
        ) from None


#: JSON schema keywords xgrammar parses without enforcing (checked on xgrammar 0.2.8:
#: ``{"not": {"type": "integer"}}`` accepts ``5``); refused rather than ignored
IGNORED_KEYWORDS = ("not", "if", "then", "else")


def _ignored_keyword(node: Any, path: str) -> tuple[str, str] | None:
    """``(JSON pointer, keyword)`` of the first keyword xgrammar would silently ignore
    (:data:`IGNORED_KEYWORDS`, or an ``allOf`` of more than one schema), else None."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            got = _ignored_keyword(v, f"{path}/{i}")
            if got is not None:
                return got
        return None
    if not isinstance(node, dict):
        return None
    for k in IGNORED_KEYWORDS:
        if k in node:
            return path, k
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return path, "allOf"
    for k, v in node.items():
        if k in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        if k == "properties" and isinstance(v, dict):
            for name, sub in v.items():
                got = _ignored_keyword(sub, f"{path}/properties/{name}")
                if got is not None:
                    return got
            continue
        got = _ignored_keyword(v, f"{path}/{k}")
        if got is not None:
            return got
    return None


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """The ``xgrammar.TokenizerInfo`` of a kvpage tokenizer.

    Args:
        tokenizer: ``kvpage.models.tokenizer.HFTokenizer`` (its ``transformers``
            tokenizer is read by ``TokenizerInfo.from_huggingface``), or any tokenizer
            with ``token_bytes() -> list[bytes]`` (the exact bytes each id decodes to, ``b""``
            for control ids: ``Llama2cTokenizer``, ``ByteTokenizer``).
        vocab_size: the model's logits width (>= the tokenizer's size; ids past the
            tokenizer are never allowed).
        stop_token_ids: ids that end a sequence (the engine's EOS); empty = the grammar
            ends without a stop token.

    Raises:
        RequestRejected: reason ``"structured_outputs_unavailable"`` for a tokenizer
            whose vocabulary kvpage cannot read.
    """
    xgr = _xgr()
    hf = getattr(tokenizer, "hf", None)
    stops = list(stop_token_ids) or None
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=max(vocab_size, len(hf)), stop_token_ids=stops
        )
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if not callable(token_bytes):
        raise RequestRejected(
            f"structured_outputs: expected a tokenizer whose vocabulary kvpage can read "
            f"(HFTokenizer, Llama2cTokenizer, ByteTokenizer), got {type(tokenizer).__name__}",
            reason="structured_outputs_unavailable",
        )
    vocab = list(token_bytes())
    vocab += [b""] * (vocab_size - len(vocab))
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=stops)


class GrammarCompilerPool:
    """Compiles constraints against one tokenizer on a background thread, cached.

    Args:
        tokenizer: the engine's tokenizer (see :func:`tokenizer_info`).
        vocab_size: the model's logits width.
        stop_token_ids: the ids that end a sequence (the engine's EOS).

    Attributes:
        num_compiled: grammars compiled so far (cache misses).
        num_cache_hits: submits served from the cache.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgr()
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = list(stop_token_ids)
        self.info = tokenizer_info(tokenizer, self.vocab_size, self.stop_token_ids)
        self.vocab_size = max(self.vocab_size, int(self.info.vocab_size))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvpage-grammar"
        )
        self._cache: OrderedDict[tuple[str, str, bool], concurrent.futures.Future[Any]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future[Any]:
        """Check ``params`` now (:func:`check_constraint`) and compile it in the
        background; a constraint seen before returns its cached future (usually done).

        Returns:
            A future of the ``xgrammar.CompiledGrammar``.

        Raises:
            RequestRejected: reason ``"invalid_structured_outputs"`` (nothing is cached).
        """
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return fut
        check_constraint(params)
        with self._lock:
            fut = self._executor.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return fut

    def _compile(self, key: tuple[str, str, bool]) -> Any:
        self.num_compiled += 1
        try:
            return self._compiler.compile_grammar(_grammar(key))
        except (RuntimeError, ValueError, TypeError) as e:
            raise RequestRejected(
                f"structured_outputs.{key[0]}: expected a constraint xgrammar can compile "
                f"for this tokenizer, got error: {_library_message(e)}",
                reason="invalid_structured_outputs",
            ) from None

    def new_state(self, compiled: Any) -> GrammarState:
        """A fresh matcher state for one sequence of a compiled grammar."""
        return GrammarState(compiled, self.vocab_size, not self.stop_token_ids)

    def shutdown(self) -> None:
        """Stop the compile thread (pending compiles finish first)."""
        self._executor.shutdown(wait=True)


class GrammarState:
    """The grammar matcher of one sequence: what it has accepted so far.

    Args:
        compiled: an ``xgrammar.CompiledGrammar``.
        vocab_size: the bitmask's width in tokens (the model's logits width).
        terminate_without_stop: the grammar ends after its last symbol (no stop token:
            the model has no EOS).
    """

    __slots__ = ("matcher", "num_accepted", "vocab_size")

    def __init__(self, compiled: Any, vocab_size: int, terminate_without_stop: bool) -> None:
        xgr = _xgr()
        self.matcher = xgr.GrammarMatcher(
            compiled, terminate_without_stop_token=terminate_without_stop
        )
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 CPU
        ``[rows, ceil(vocab_size / 32)]``, bit ``t % 32`` of word ``t // 32`` = token ``t``
        allowed); the matcher is not changed."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False when the grammar refuses it (the
        matcher then stays where it was)."""
        ok = bool(self.matcher.accept_token(int(token_id)))
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted its end (its stop token, or its last symbol when it
        has none): the sequence is complete."""
        return bool(self.matcher.is_terminated())


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to ``-inf`` (in place) the logits of ``rows`` whose token the bitmask forbids.

    Args:
        logits: ``[num_rows, vocab]`` float, any device (mutated).
        bitmask: int32 ``[len(rows), ceil(vocab / 32)]`` on the CPU (row ``i`` for logits
            row ``rows[i]``).
        rows: the constrained rows of ``logits``.
    """
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    vocab = int(logits.shape[1])
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)
    if allowed.shape[1] < vocab:
        pad = torch.zeros(len(rows), vocab - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(logits.device)], dim=1)
    allowed = allowed[:, :vocab]
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)
