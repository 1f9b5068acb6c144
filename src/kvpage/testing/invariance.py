"""Invariance checks: chunking of prefill and placement of blocks change nothing.

* chunked prefill in any chunking == one-shot prefill == token-by-token decode
  (each chunk writes its K/V with the backend's ``write_kv`` first, as the engine does);
* the same logical K/V under another block size and physical permutation gives the
  same output.

Outputs are compared with the query dtype's tolerance (``kvpage.testing.tolerances``)
against the float64 reference of the one-shot step, so every variant is held to the
same bound.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.attention.protocol import AttentionBackend
from kvpage.attention.reference import reference_attention, reference_write_kv
from kvpage.testing.cases import AttentionCase, materialize, slot_at
from kvpage.testing.runner import error_scale, run_attention
from kvpage.testing.tolerances import assert_close, tolerance_for


def chunked_outputs(
    backend: AttentionBackend[Any],
    case: AttentionCase,
    chunks: list[list[int]],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Compute the case's new tokens in rounds: in round ``r`` sequence ``i`` runs its
    ``chunks[i][r]`` next tokens (if any), after writing their K/V with the backend.

    Args:
        chunks: per sequence, positive chunk lengths summing to its query length.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in the query order of the case.
    """
    for i, (c, q) in enumerate(zip(chunks, case.query_lens)):
        if sum(c) != q or any(x <= 0 for x in c):
            raise ValueError(f"chunks[{i}]: expected positive lengths summing to {q}, got {c}")
    m = materialize(case, device, write_context=False)
    bs = case.block_size
    ctx_slots, ks, vs = [], [], []
    for i, (n, q) in enumerate(zip(case.seq_lens, case.query_lens)):
        ctx_slots += [slot_at(case.block_tables[i], p, bs) for p in range(n - q)]
        ks.append(m.keys[i][: n - q])
        vs.append(m.values[i][: n - q])
    if ctx_slots:
        reference_write_kv(
            torch.cat(ks).to(device),
            torch.cat(vs).to(device),
            m.cache,
            torch.tensor(ctx_slots, dtype=torch.int64, device=device),
        )
    qstarts = [0]
    for q in case.query_lens:
        qstarts.append(qstarts[-1] + q)
    out = torch.full_like(m.query, float("nan"))
    done = [0] * len(chunks)
    for r in range(max(len(c) for c in chunks)):
        seqs = [i for i in range(len(chunks)) if r < len(chunks[i])]
        qlens = [chunks[i][r] for i in seqs]
        starts = [case.seq_lens[i] - case.query_lens[i] + done[i] for i in seqs]
        slens = [s + q for s, q in zip(starts, qlens)]
        meta = AttentionMetadata.build(
            qlens, slens, [list(case.block_tables[i]) for i in seqs], bs, device=device
        )
        rows = torch.tensor(
            [qstarts[i] + done[i] + j for i, q in zip(seqs, qlens) for j in range(q)],
            dtype=torch.int64,
        )
        kc = torch.cat([m.keys[i][s : s + q] for i, s, q in zip(seqs, starts, qlens)])
        vc = torch.cat([m.values[i][s : s + q] for i, s, q in zip(seqs, starts, qlens)])
        backend.write_kv(kc.to(device), vc.to(device), m.cache, meta.slot_mapping)
        q_rows = m.query[rows.to(device)]
        o = run_attention(backend, q_rows, m.cache, backend.plan(meta), case.spec, sinks=m.sinks)
        out[rows.to(device)] = o
        for i, q in zip(seqs, qlens):
            done[i] += q
    return out


def check_chunking_invariance(
    backend: AttentionBackend[Any],
    case: AttentionCase,
    chunks: list[list[int]],
    device: torch.device | str = "cpu",
) -> None:
    """One-shot prefill, the given chunking, and token-by-token decode all match the
    float64 reference of the one-shot step within the query dtype's tolerance.

    Raises:
        AssertionError: a variant is outside the tolerance.
    """
    m = materialize(case, device)
    ref = reference_attention(m.query, m.cache, m.meta, case.spec, m.sinks)
    tol = tolerance_for(case.torch_dtype)
    scale = error_scale(case, m.keys, m.values, m.query)
    variants = {
        "one-shot": [[q] for q in case.query_lens],
        f"chunks {chunks}": chunks,
        "token-by-token": [[1] * q for q in case.query_lens],
    }
    for name, ch in variants.items():
        got = chunked_outputs(backend, case, ch, device)
        assert_close(
            got, ref, tol, scale=scale, what=f"{name} vs one-shot reference [{case.describe()}]"
        )


def check_layout_invariance(
    backend: AttentionBackend[Any],
    case: AttentionCase,
    block_size: int,
    block_tables: list[list[int]],
    num_blocks: int,
    device: torch.device | str = "cpu",
) -> None:
    """The case under its own layout and under ``(block_size, block_tables,
    num_blocks)`` gives the same output (both within tolerance of the reference of
    the original layout, hence of each other).

    Raises:
        AssertionError: an output is outside the tolerance.
    """
    other = case.with_layout(block_size, block_tables, num_blocks)
    m = materialize(case, device)
    ref = reference_attention(m.query, m.cache, m.meta, case.spec, m.sinks)
    tol = tolerance_for(case.torch_dtype)
    scale = error_scale(case, m.keys, m.values, m.query)
    for c in (case, other):
        mm = materialize(c, device)
        plan = backend.plan(mm.meta)
        got = run_attention(backend, mm.query, mm.cache, plan, c.spec, sinks=mm.sinks)
        assert_close(
            got,
            ref,
            tol,
            scale=scale,
            what=f"layout bs={c.block_size} vs reference [{case.describe()}]",
        )
