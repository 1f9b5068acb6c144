"""The model's linears: oneDNN-prepacked weights (``PackedWeight``) and several
projections of one input fused into one matmul (``FusedLinear``), with the settings
that decide when the oneDNN path is taken. Results equal ``F.linear`` up to float
summation order.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: run CPU float32/bfloat16 linears through oneDNN with prepacked weights (measured
#: 2.3-2.9x less CPU time than ``F.linear`` in float32 at 16-256 rows and 1.2-2.5x in
#: bfloat16 on an AVX-512 EPYC, docs/benchmarks.md); False = plain ``F.linear``
PACK_LINEARS = True
#: ... for products of at least this many multiply-adds (rows * out * in): a oneDNN call
#: costs ~10 us more than ``F.linear``, which wins below ~1M (e.g. 13 vs 15 us at
#: 16 x 512 x 64, 22 vs 18 us at 256 x 64 x 64, float32, one thread; docs/benchmarks.md)
PACK_MIN_MACS = 1 << 20
#: ... and only weights of at least this many elements (``out * in``): below it
#: ``F.linear`` costs less CPU in the engine at any row count (stories260K-hd32, weights
#: of 8-33k elements, 200-2,048 rows: linears 3.0-3.3 vs 3.4-5.9 ms per step, the
#: step's non-attention CPU 0.79-0.86x, alternating in one process; the attention
#: kernel's K/V stream leaves the caches cold between layers, where oneDNN's larger
#: call path costs more than its faster kernel saves; docs/benchmarks.md). The ~125M
#: Llama's weights (>= 590k elements) keep the oneDNN path that made them 1.9-2.0x
#: faster.
PACK_MIN_WEIGHT = 1 << 16
#: bfloat16's :data:`PACK_MIN_MACS`: oneDNN's bf16 kernel (AVX-512-BF16 / AMX) beat
#: ``F.linear`` (which reaches torch's own bf16 gemm) at every weight of at least
#: :data:`PACK_MIN_WEIGHT` elements and every row count measured, 1.4-2.1x at one row
#: and 1.4-3.0x at 64 rows on the ~125M Llama's shapes (2-core Xeon with AMX, one
#: thread; docs/benchmarks.md, issue 28), so bf16 packs from the first row
PACK_MIN_MACS_BF16 = 0
#: float32 takes the oneDNN path only from this many rows on: at 1-2 rows
#: ``F.linear`` runs MKL's matrix-vector kernel, which read the weights 1.05-2.5x
#: faster than oneDNN's packed kernel on the ~125M Llama's shapes (same Xeon, one
#: thread; docs/benchmarks.md, issue 28); from 4 rows on oneDNN wins (1.04-2.1x at 4, 1.2-2.5x at 8)
PACK_MIN_ROWS_FP32 = 3


def _version(t: torch.Tensor) -> int:
    """In-place modification counter (-1 for inference tensors, which have none)."""
    return -1 if t.is_inference() else t._version


#: :func:`pack_min_rows` of a weight that never takes the oneDNN path
NEVER_PACK = 1 << 62


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN build can prepack ``dtype`` linear weights. Probed once
    per dtype with a small reorder: oneDNN refuses bfloat16 packing on CPUs without
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (``RuntimeError: mkldnn_reorder_linear_weight:
    bf16 path needs the cpu support ...``, e.g. on AVX2-only EPYC hosts), where
    ``F.linear`` is the only path."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def pack_min_rows(w: torch.Tensor) -> int:
    """The fewest input rows for which ``x @ w.T`` takes the oneDNN path: the smallest
    ``rows`` with ``rows * out * in >= PACK_MIN_MACS`` and ``rows >= PACK_MIN_ROWS_FP32``
    for float32, with ``rows * out * in >= PACK_MIN_MACS_BF16`` for bfloat16, or :data:`NEVER_PACK` unless
    :data:`PACK_LINEARS` is on and ``w`` is a 2-D float32/bfloat16 CPU tensor whose
    dtype this CPU's oneDNN can pack (:func:`onednn_packs`) and ``w`` has at least :data:`PACK_MIN_WEIGHT` elements. Depends
    only on ``w``'s shape, dtype and device and the module settings, so callers
    compute it once per weight and keep it while :func:`pack_rule` of ``w`` stays the
    same
    (see ``PackedWeight.__call__``); the input's dtype must also equal ``w.dtype``.
    """
    if not (
        PACK_LINEARS
        and w.dim() == 2
        and w.device.type == "cpu"
        and w.dtype in (torch.float32, torch.bfloat16)
        and onednn_packs(w.dtype)
    ):
        return NEVER_PACK
    per_row = w.shape[0] * w.shape[1]
    if per_row < PACK_MIN_WEIGHT:
        return NEVER_PACK
    bf16 = w.dtype == torch.bfloat16
    macs = PACK_MIN_MACS_BF16 if bf16 else PACK_MIN_MACS
    floor = 0 if bf16 else PACK_MIN_ROWS_FP32
    if per_row == 0:
        return floor if macs <= 0 else NEVER_PACK
    return max(floor, -(-macs // per_row))


def pack_rule(w: torch.Tensor) -> tuple[Any, ...]:
    """What :func:`pack_min_rows` of ``w`` depends on: ``w``'s shape, dtype, device and
    the module settings."""
    return (
        w.shape,
        w.dtype,
        w.device,
        PACK_LINEARS,
        PACK_MIN_MACS,
        PACK_MIN_WEIGHT,
        PACK_MIN_MACS_BF16,
        PACK_MIN_ROWS_FP32,
    )


class PackedWeight:
    """A oneDNN-prepacked copy of one linear weight (``torch.ops.mkldnn``), rebuilt
    whenever the weight is replaced or modified in place (its data pointer or version
    counter changes), so it never goes stale. Costs a second copy of the weight.

    Call ``packed(x, w, b)`` = ``F.linear(x, w, b)``: x ``[rows, in]``, w ``[out, in]``,
    b ``[out]`` or None; falls back to ``F.linear`` off the CPU, for float16, below
    :data:`PACK_MIN_MACS` or :data:`PACK_MIN_WEIGHT` or with :data:`PACK_LINEARS` off. Results equal ``F.linear``
    up to float summation order.
    """

    def __init__(self) -> None:
        self.key: tuple[int, Any] | None = None
        self.packed: torch.Tensor | None = None
        #: what ``min_rows`` was computed from: :func:`pack_rule` of the last weight seen
        self.rule: tuple[Any, ...] = ()
        #: ``pack_min_rows`` of that weight
        self.min_rows = NEVER_PACK

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        version: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """``version``: the caller's own change marker of ``w`` (default its version
        counter; inference tensors have none and are keyed by their storage alone).
        Whether ``w`` can be packed is decided once per weight (``pack_min_rows``, kept
        while the weight's shape, dtype and device and the module settings stay the
        same); per call only the input's rows and dtype are compared."""
        rule = pack_rule(w)
        if rule != self.rule:
            self.rule, self.min_rows = rule, pack_min_rows(w)
        if x.dim() != 2 or x.shape[0] < self.min_rows or x.dtype != w.dtype:
            return F.linear(x, w, b)
        return self.packed_linear(x, w, b, version)

    def packed_linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        version: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """The oneDNN path of :meth:`__call__`, for a caller that checked
        ``x.shape[0] >= pack_min_rows(w)`` and the dtypes itself."""
        key = (w.data_ptr(), version if version is not None else _version(w))
        if key != self.key or self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self.key = key
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, b, "none", [None], ""
        )
        return y


class FusedLinear:
    """One ``[sum(out_i), in]`` weight (and bias) for several ``nn.Linear`` of the same
    input, so that one matmul replaces several.

    The parts' parameters are re-pointed at row slices of the fused tensor (no second
    copy of the weights; ``state_dict`` keeps the HF names and shapes). Whenever a part's
    parameter no longer lives there (``load_state_dict(assign=True)``, ``.to(...)``),
    :meth:`weights` fuses again, so the fused view never goes stale; in-place updates
    (``copy_``) write through the views.

    Args:
        parts: the linears, in output order; same input size, dtype and device.
    """

    def __init__(self, parts: list[nn.Linear]) -> None:
        self.parts = parts
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._ptrs: tuple[int, ...] = ()
        self._packed = PackedWeight()

    def _current(self) -> tuple[int, ...]:
        ptrs = []  # a loop, not a generator: this runs for every fused linear of a step
        for m in self.parts:
            ptrs.append(m.weight.data_ptr())
        return tuple(ptrs)

    def _versions(self) -> tuple[int, ...]:
        # parameters re-pointed with ``.data =`` keep their own version counters
        vs = []
        for m in self.parts:
            vs.append(_version(m.weight))
        return tuple(vs)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight [sum(out_i), in], bias [sum(out_i)] or None)``, re-fused if needed."""
        if self.weight is None or self._current() != self._ptrs:
            with torch.inference_mode(False):  # normal tensors: in-place updates are seen
                w = torch.cat([m.weight.detach() for m in self.parts])
                b = None
                if any(m.bias is not None for m in self.parts):  # zeros for bias-free parts
                    b = torch.cat(
                        [
                            m.bias.detach()
                            if m.bias is not None
                            else m.weight.new_zeros(m.weight.shape[0])
                            for m in self.parts
                        ]
                    )
            a = 0
            for m in self.parts:
                n = m.weight.shape[0]
                m.weight.data = w[a : a + n]
                if b is not None and m.bias is not None:
                    m.bias.data = b[a : a + n]
                a += n
            self.weight, self.bias, self._ptrs = w, b, self._current()
        return self.weight, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in]`` -> ``[num_tokens, sum(out_i)]``.

        One Python call per use on the common path: the parts' data pointers are
        compared inline (:meth:`weights` re-fuses when one moved), and the oneDNN
        decision of the fused weight (``pack_min_rows``) is kept until the fused weight
        or the module settings change; version counters are read only on the oneDNN
        path."""
        w = self.weight
        stale = w is None
        if not stale:
            for m, p in zip(self.parts, self._ptrs):  # a loop: no generator per call
                if m.weight.data_ptr() != p:
                    stale = True
                    break
        if stale:
            w = self.weights()[0]
        assert w is not None
        pw = self._packed
        rule = pack_rule(w)
        if rule != pw.rule:
            pw.rule, pw.min_rows = rule, pack_min_rows(w)
        if x.dim() != 2 or x.shape[0] < pw.min_rows or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)  # small products: no version bookkeeping
        return pw.packed_linear(x, w, self.bias, self._versions())


__all__ = [
    "NEVER_PACK",
    "PACK_LINEARS",
    "PACK_MIN_MACS",
    "PACK_MIN_MACS_BF16",
    "PACK_MIN_ROWS_FP32",
    "PACK_MIN_WEIGHT",
    "FusedLinear",
    "PackedWeight",
    "pack_min_rows",
    "pack_rule",
]
