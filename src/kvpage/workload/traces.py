"""Request traces: load real serving traces into one record type, and give them tokens.

The common model (:class:`TraceRequest`, :class:`Trace`, :class:`TraceError`) is in
:mod:`kvpage.workload.trace_types`, the readers of the formats (Azure LLM inference 2023
CSV, Mooncake FAST'25 JSON lines; row order, ``limit``) in
:mod:`kvpage.workload.trace_readers`; both are re-exported here. This module holds the
bundled traces, :func:`load_trace` (by short name or path) and the token mapping.

Token ids (:func:`prompt_token_ids`) — the documented mapping from hash ids to tokens:

* Hash block ``h`` (512 tokens) becomes the fixed run
  ``numpy.random.default_rng([seed, 0, h]).integers(0, vocab_size, 512)``. It depends
  only on ``(h, seed, vocab_size)``, so requests sharing a leading run of hash ids share
  exactly the same leading tokens, in any process.
* The last hash block of a prompt is usually partial: it contributes the first
  ``input_length - 512 * (len(hash_ids) - 1)`` tokens of its run, so a shorter
  request's tail is a prefix of a longer request's block with the same id.
* At a simulated block size ``B`` that divides 512 (1, 2, 4, ..., 256, 512) each hash
  block is ``512 / B`` simulated blocks; a prefix hit of ``k`` hash blocks is a hit of
  ``k * 512 / B`` simulated blocks, and inside a shared partial last block the sub-blocks
  that are full also hit (finer than the trace's own granularity, never coarser). When
  ``B`` does not divide 512 a simulated block may straddle two hash blocks and hits only
  if both are shared — the cache then hits fewer tokens than the trace would allow.
* Requests without hash ids (Azure) get a run unique to the request:
  ``default_rng([seed, 1, index])``. Generated (output) tokens use
  ``default_rng([seed, 2, index])``; output tokens are never shared between requests.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from kvpage.workload.trace_readers import MAX_TRACE_SPAN_S as MAX_TRACE_SPAN_S  # re-exported
from kvpage.workload.trace_readers import load_azure_csv, load_mooncake_jsonl
from kvpage.workload.trace_types import (
    MOONCAKE_BLOCK_TOKENS,
    Trace,
    TraceError,
    TraceRequest,
)

#: short names of the bundled traces -> file names in ``kvpage/data/traces``
BUNDLED_TRACES: dict[str, str] = {
    "azure-conv": "azure_llm_conv_2023.csv",
    "azure-code": "azure_llm_code_2023.csv",
    "mooncake-conv": "mooncake_conversation_trace.jsonl",
}


def bundled_trace_path(name: str) -> Path:
    """Path of a bundled trace by short name (see :data:`BUNDLED_TRACES`).

    Raises:
        TraceError: unknown name.
    """
    if name not in BUNDLED_TRACES:
        raise TraceError(f"trace: expected one of {sorted(BUNDLED_TRACES)}, got {name!r}")
    return Path(str(resources.files("kvpage") / "data" / "traces" / BUNDLED_TRACES[name]))


def load_trace(source: str | Path, *, limit: int | None = None) -> Trace:
    """Load a trace by bundled short name or by path (format from the suffix).

    Args:
        source: ``"azure-conv"``, ``"azure-code"``, ``"mooncake-conv"``, or a path
            ending in ``.csv`` (Azure) or ``.jsonl`` (Mooncake).
        limit: keep only the first ``limit`` rows of the file (None = all; >= 1).

    Raises:
        TraceError: unknown name, unknown suffix, a malformed file, or no requests.
    """
    name = ""
    if isinstance(source, str) and source in BUNDLED_TRACES:
        name = source
        source = bundled_trace_path(source)
    p = Path(source)
    if p.suffix == ".csv":
        return load_azure_csv(p, limit=limit, name=name)
    if p.suffix in (".jsonl", ".json"):
        return load_mooncake_jsonl(p, limit=limit, name=name)
    raise TraceError(
        f"trace: expected one of {sorted(BUNDLED_TRACES)} or a .csv/.jsonl path, got {str(source)!r}"
    )


class TokenMapper:
    """Deterministic token ids for trace requests (see the module docstring).

    Memoizes hash-block runs, so requests that share hash ids reuse one array.

    Args:
        seed: the mapping's seed (any int >= 0).
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        hash_block_tokens: tokens per hash id (512 for Mooncake).
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        vocab_size: int = 32000,
        hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    ) -> None:
        if seed < 0:
            raise TraceError(f"seed: expected >= 0, got {seed}")
        if vocab_size < 2:
            raise TraceError(f"vocab_size: expected >= 2, got {vocab_size}")
        if hash_block_tokens < 1:
            raise TraceError(f"hash_block_tokens: expected >= 1, got {hash_block_tokens}")
        self.seed = seed
        self.vocab_size = vocab_size
        self.hash_block_tokens = hash_block_tokens
        self._runs: dict[int, np.ndarray] = {}

    def hash_block(self, hash_id: int) -> np.ndarray:
        """``[hash_block_tokens]`` int64: the fixed token run of one hash id."""
        run = self._runs.get(hash_id)
        if run is None:
            if hash_id < 0:
                raise TraceError(f"hash_id: expected >= 0, got {hash_id}")
            rng = np.random.default_rng([self.seed, 0, hash_id])
            run = rng.integers(0, self.vocab_size, self.hash_block_tokens, dtype=np.int64)
            self._runs[hash_id] = run
        return run

    def prompt(self, req: TraceRequest) -> list[int]:
        """The request's ``prompt_tokens`` token ids.

        Raises:
            TraceError: the hash ids cannot cover the prompt.
        """
        n = req.prompt_tokens
        if req.hash_ids is None:
            rng = np.random.default_rng([self.seed, 1, req.index])
            ids: list[int] = rng.integers(0, self.vocab_size, n, dtype=np.int64).tolist()
            return ids
        hb = self.hash_block_tokens
        if len(req.hash_ids) * hb < n:
            raise TraceError(
                f"hash_ids (request {req.index}): expected >= {-(-n // hb)} ids for {n} tokens, "
                f"got {len(req.hash_ids)}"
            )
        parts = [self.hash_block(h) for h in req.hash_ids[: -(-n // hb)]]
        if not parts:
            return []
        out: list[int] = np.concatenate(parts)[:n].tolist()
        return out

    def output(self, req: TraceRequest) -> list[int]:
        """The request's ``output_tokens`` generated token ids (unique per request)."""
        rng = np.random.default_rng([self.seed, 2, req.index])
        ids: list[int] = rng.integers(
            0, self.vocab_size, req.output_tokens, dtype=np.int64
        ).tolist()
        return ids


def prompt_token_ids(req: TraceRequest, *, seed: int = 0, vocab_size: int = 32000) -> list[int]:
    """Token ids of one request's prompt (a one-off :class:`TokenMapper`)."""
    return TokenMapper(seed=seed, vocab_size=vocab_size).prompt(req)


def sim_blocks_per_hash_block(block_size: int) -> float:
    """Simulated blocks per 512-token hash block (``512 / block_size``; fractional
    when ``block_size`` does not divide 512 — see the module docstring)."""
    if block_size < 1:
        raise TraceError(f"block_size: expected >= 1, got {block_size}")
    return MOONCAKE_BLOCK_TOKENS / block_size


__all__ = [
    "BUNDLED_TRACES",
    "MOONCAKE_BLOCK_TOKENS",
    "TokenMapper",
    "Trace",
    "TraceError",
    "TraceRequest",
    "bundled_trace_path",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "load_trace",
    "prompt_token_ids",
    "sim_blocks_per_hash_block",
]
