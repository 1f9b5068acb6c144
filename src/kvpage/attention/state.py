"""Recurrent-layer state storage and its per-step metadata (the tensor side of
:class:`kvpage.specs.state.StateSpec`).

One :class:`StateCache` per recurrent mixer holds the states of every *state slot*:
the live state of each running sequence and the prefix-cache snapshots
(``kvpage.cache`` decides which slot is which; a snapshot is a row copy). One
:class:`StateBatch` per step tells the mixers which slot each sequence of the packed
batch reads and updates — the recurrent counterpart of a block table and slot mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.attention.metadata import MODEL_DTYPES
from kvpage.errors import ShapeError
from kvpage.specs.state import StateSpec


@dataclass
class StateCache:
    """The state slots of one recurrent mixer.

    Attributes:
        conv: ``[num_slots, conv_dim, conv_kernel - 1]`` the causal conv1d's last
            inputs, oldest first (``StateSpec.dtype``).
        ssm: ``[num_slots, *StateSpec.ssm_shape]`` the recurrent state
            (``StateSpec.ssm_dtype``).
        num_slots: rows of both tensors (read from ``conv`` at construction).
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    num_slots: int = field(init=False)

    def __post_init__(self) -> None:
        if self.conv.dim() != 3 or self.ssm.dim() != 4:
            raise ShapeError(
                "StateCache: expected conv [num_slots, conv_dim, conv_kernel - 1] and ssm "
                f"[num_slots, a, b, c], got {tuple(self.conv.shape)} and "
                f"{tuple(self.ssm.shape)}"
            )
        if self.conv.shape[0] != self.ssm.shape[0]:
            raise ShapeError(
                f"StateCache.ssm: expected {self.conv.shape[0]} slots (as conv), "
                f"got {self.ssm.shape[0]}"
            )
        self.num_slots = int(self.conv.shape[0])

    @classmethod
    def allocate(cls, spec: StateSpec, num_slots: int, device: torch.device) -> StateCache:
        """Zeroed storage for ``num_slots`` states of ``spec``'s layer."""
        conv = torch.zeros(
            (num_slots, *spec.conv_state_shape), dtype=MODEL_DTYPES[spec.dtype], device=device
        )
        ssm = torch.zeros(
            (num_slots, *spec.ssm_shape), dtype=MODEL_DTYPES[spec.ssm_dtype], device=device
        )
        return cls(conv, ssm)

    def copy_slots(self, pairs: torch.Tensor) -> None:
        """For each row ``(src, dst)`` of ``pairs`` (``[n, 2]`` int64): slot ``dst`` :=
        slot ``src`` in both tensors (snapshot take and restore). Mutates this cache.

        Raises:
            ShapeError: bad pairs or slots out of range; nothing is copied.
        """
        if pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ShapeError(f"pairs: expected [n, 2], got {tuple(pairs.shape)}")
        if pairs.numel() == 0:
            return
        lo, hi = int(pairs.min()), int(pairs.max())
        if lo < 0 or hi >= self.num_slots:
            raise ShapeError(f"pairs: expected slots in [0, {self.num_slots}), got {lo}..{hi}")
        src, dst = pairs[:, 0].to(self.conv.device), pairs[:, 1].to(self.conv.device)
        self.conv[dst] = self.conv[src]
        self.ssm[dst] = self.ssm[src]


def run_slot_copies(
    caches: list[StateCache],
    pairs: list[tuple[int, int]],
    host: list[StateCache] | None = None,
) -> None:
    """Run slot copies ``(src, dst)`` one after another on every cache of ``caches``, so
    a later pair reads what an earlier one wrote (the state pool's ordered copy queue:
    ``kvpage.cache.state_pool``). With ``host`` (one host-memory ``StateCache`` per
    cache, the pool's host snapshot rows), a slot ``>= caches[i].num_slots`` means host
    row ``slot - num_slots`` of ``host[i]`` (device <-> host copies). Mutates the caches.

    Raises:
        ShapeError: a slot out of range (the pairs before it were copied).
    """
    for a, b in pairs:
        n = caches[0].num_slots if caches else 0
        if host is None or (a < n and b < n):
            t = torch.tensor([[a, b]], dtype=torch.int64)
            for sc in caches:
                sc.copy_slots(t)
            continue
        for sc, hc in zip(caches, host, strict=True):
            src, i = (sc, a) if a < n else (hc, a - n)
            dst, j = (sc, b) if b < n else (hc, b - n)
            if not (0 <= i < src.num_slots and 0 <= j < dst.num_slots):
                raise ShapeError(f"pairs: slot out of range: ({a}, {b})")
            dst.conv[j].copy_(src.conv[i])
            dst.ssm[j].copy_(src.ssm[i])


@dataclass(frozen=True)
class StateBatch:
    """Which state slot each sequence of a step reads and updates.

    Attributes:
        state_indices: ``[num_seqs]`` int64 slot of each sequence (the packed order of
            the step's ``AttentionMetadata``).
        has_initial_state: ``[num_seqs]`` bool: False = the sequence's first token is
            at position 0, so its slot is read as zeros (and overwritten); True = the
            slot holds the state after the sequence's ``context_len`` tokens.
        query_start_loc: ``[num_seqs + 1]`` int64 offsets of each sequence's new tokens
            in the packed batch (the metadata's ``query_start_loc``).
        is_decode: every sequence has one new token (the recurrent step, no scan).
    """

    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    query_start_loc: torch.Tensor
    is_decode: bool

    @property
    def num_seqs(self) -> int:
        return int(self.state_indices.shape[0])

    def initial_rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx, rows)``: each sequence's slot index ``[num_seqs]`` on ``slots``'
        device and its row of ``slots`` (``StateCache.conv`` or ``.ssm``, ``[num_slots,
        ...]``), zeros where ``has_initial_state`` is False (a NaN-poisoned slot reads
        0). Reads only; the caller writes the new state back at ``idx``."""
        idx = self.state_indices.to(slots.device)
        rows = slots[idx]
        has = self.has_initial_state.to(rows.device).view(-1, *([1] * (rows.dim() - 1)))
        return idx, torch.where(has, rows, torch.zeros_like(rows))


__all__ = ["StateBatch", "StateCache", "run_slot_copies"]
