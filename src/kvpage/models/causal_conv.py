"""The causal depthwise conv1d of the recurrent mixers (Mamba-2, Gated DeltaNet), run on
a packed batch of sequences with each sequence's conv state in a state slot.

Per channel ``c`` and token ``t``: ``y[t, c] = act(bias[c] + sum_j w[c, j] *
x[t - (K - 1) + j, c])``, where the inputs before the sequence's first new token are the
slot's conv state (the last ``K - 1`` inputs, oldest first; zeros for a fresh sequence).
After the step the slot holds the last ``K - 1`` inputs (state then new tokens).
Source: transformers 5.23 ``causal_conv1d_fn`` / ``causal_conv1d_update``
(models/mamba2/modeling_mamba2.py, models/qwen3_next/modeling_qwen3_next.py), whose
caches keep ``K`` columns; the newest is the current token's, so ``K - 1`` is the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention.state import StateBatch
from kvpage.errors import ShapeError


def causal_conv1d(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens through the conv, without activation.

    Args:
        x: ``[L, C]`` new inputs.
        state: ``[C, K - 1]`` the previous inputs, oldest first.
        weight: ``[C, K]`` depthwise kernel (``nn.Conv1d.weight[:, 0, :]``).
        bias: ``[C]`` or None.

    Returns:
        ``(y [L, C]`` in ``x``'s dtype, ``new_state [C, K - 1])``.
    """
    k = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x.T], dim=1)  # [C, K - 1 + L]
    y = F.conv1d(full[None], weight[:, None, :].to(x.dtype), bias, groups=weight.shape[0])[0]
    return y.T, full[:, full.shape[1] - (k - 1) :]


def conv_packed(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    batch: StateBatch,
) -> torch.Tensor:
    """The conv over a packed batch (then SiLU, the activation of every mixer here).

    Args:
        x: ``[num_tokens, C]`` new inputs, sequences packed at ``batch.query_start_loc``.
        weight, bias: as :func:`causal_conv1d`.
        conv_cache: ``[num_slots, C, K - 1]`` (``StateCache.conv``); mutated: each
            sequence's slot ``batch.state_indices[s]`` gets its new state.
        batch: the step's slots; a slot with ``has_initial_state`` False reads zeros.

    Returns:
        ``[num_tokens, C]`` ``silu(conv(x))``.

    Raises:
        ShapeError: ``query_start_loc`` does not cover the tokens.
    """
    n = x.shape[0]
    qsl = batch.query_start_loc.tolist()
    if len(qsl) != batch.num_seqs + 1 or qsl[0] != 0 or qsl[-1] != n:
        raise ShapeError(
            f"StateBatch.query_start_loc: expected {batch.num_seqs + 1} offsets from 0 to "
            f"{n}, got {qsl}"
        )
    idx, init = batch.initial_rows(conv_cache)
    if batch.is_decode and n == batch.num_seqs:  # one token each: one batched update
        full = torch.cat([init.to(x.dtype), x[:, :, None]], dim=2)  # [S, C, K]
        w = weight[:, None, :].to(x.dtype)
        y = F.conv1d(full, w, bias, groups=weight.shape[0])[:, :, 0]  # HF's update op
        conv_cache[idx] = full[:, :, 1:].to(conv_cache.dtype)
        return F.silu(y)
    out = torch.empty_like(x)
    for s in range(batch.num_seqs):
        a, b = qsl[s], qsl[s + 1]
        y, st = causal_conv1d(x[a:b], init[s], weight, bias)
        out[a:b] = y
        conv_cache[idx[s]] = st.to(conv_cache.dtype)
    return F.silu(out)


def reference_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d` + SiLU as a float64 loop over tokens and taps (tests'
    reference): ``([L, C], [C, K - 1])`` in float64."""
    w = weight.double()
    k = w.shape[1]
    window = [state[:, j].double() for j in range(k - 1)]
    ys = []
    for t in range(x.shape[0]):
        window.append(x[t].double())
        acc = torch.zeros_like(window[-1]) if bias is None else bias.double().clone()
        for j in range(k):
            acc = acc + w[:, j] * window[len(window) - k + j]
        ys.append(acc * torch.sigmoid(acc))
    new = torch.stack(window[len(window) - (k - 1) :], dim=1)
    y = torch.stack(ys) if ys else x.new_zeros((0, x.shape[1]), dtype=torch.float64)
    return y, new


__all__ = ["causal_conv1d", "conv_packed", "reference_conv"]
