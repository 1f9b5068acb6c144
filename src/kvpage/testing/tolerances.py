"""The tolerance table: how close a backend must be to the float64 reference.

One row per comparison kind, each with the reason for its size. Attention outputs are
compared element-wise with ``|actual - expected| <= atol * E + rtol * |expected|``,
where the case's error scale ``E = max|V| * max(1, kappa / 8)`` and
``kappa = scale * max sum_d |q_d k_d|`` bounds the size of the logits: outputs scale
with V, and rounding errors of a logit grow with the sum of its terms' magnitudes.
Quantized caches are compared twice: the backend against the reference *on the
dequantized cache* (the query dtype's row: dequantization is exact or one float32
rounding), and, separately, the reference on the dequantized cache against the
reference on the unquantized K/V (``QUANT_ERROR_BOUNDS``: what quantization itself
may cost, propagated through softmax analytically).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|`` element-wise.

    Attributes:
        atol: absolute tolerance (units of the output, i.e. of V).
        rtol: relative tolerance.
        reason: why this size (what rounding it covers).
    """

    atol: float
    rtol: float
    reason: str


#: comparison kind -> tolerance; see docs/tolerances.md for the same table in prose
TOLERANCES: dict[str, Tolerance] = {
    "exact": Tolerance(
        0.0,
        0.0,
        "write_kv and copy_blocks move or quantize values by a fixed formula "
        "(kvpage.attention.quant): stored bits must equal the reference's, NaN included",
    ),
    "float32": Tolerance(
        1e-5,
        1e-5,
        "float32 accumulation over <= a few hundred keys gives ~1e-6; 10x margin. "
        "TF32 matmuls (~1e-3) do NOT pass: GPU kernels must use IEEE float32 dots",
    ),
    "float16": Tolerance(
        2e-3,
        2e-3,
        "the output is rounded to float16 (half ulp ~1e-3 near |x| = 2-4) and kernels may "
        "round softmax weights to float16 before P @ V (2^-11 relative each)",
    ),
    "bfloat16": Tolerance(
        1.5e-2,
        1.5e-2,
        "the output is rounded to bfloat16 (half ulp ~8e-3 near |x| = 2-4) and kernels may "
        "round softmax weights to bfloat16 before P @ V (2^-8 relative each)",
    ),
}


@dataclass(frozen=True)
class QuantErrorBound:
    """Per-element error of a quantized K/V value: ``|x_hat - x| <= rel * |x| +
    row_rel * max|row| + abs_min * scale`` (``scale`` = the fp8 scale).

    Attributes:
        rel: relative rounding bound (half an ulp of the format's mantissa).
        row_rel: bound relative to the row's absmax (int8: half a code step).
        abs_min: absolute bound below the smallest normal (half the smallest subnormal).
        reason: where the numbers come from.
    """

    rel: float
    row_rel: float
    abs_min: float
    reason: str


#: kv dtype -> per-element quantization error. ``check_quantization_error`` turns it
#: into a bound on the attention output: with logits perturbed by at most ``d`` (from
#: the K error) and V by at most ``e``, every softmax weight moves by a factor in
#: ``[exp(-2d), exp(2d)]``, so ``|out_hat - out| <= (exp(2d) - 1) * max|V| + e``.
QUANT_ERROR_BOUNDS: dict[str, QuantErrorBound] = {
    "int8": QuantErrorBound(
        2e-7, 1 / 254 * 1.001, 0.0, "absmax int8: codes round by <= half a step = absmax/254"
    ),
    "fp8_e4m3": QuantErrorBound(
        2.0**-4, 0.0, 2.0**-10, "e4m3: 3 mantissa bits (half ulp 2^-4), min subnormal 2^-9"
    ),
    "fp8_e5m2": QuantErrorBound(
        2.0**-3, 0.0, 2.0**-17, "e5m2: 2 mantissa bits (half ulp 2^-3), min subnormal 2^-16"
    ),
}

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def tolerance_for(query_dtype: torch.dtype) -> Tolerance:
    """The attention-output tolerance for queries (and outputs) of ``query_dtype``."""
    return TOLERANCES[_DTYPE_NAMES[query_dtype]]


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, *, what: str, scale: float = 1.0
) -> float:
    """Assert ``actual`` is within ``tol`` of ``expected`` (both compared in float64 on
    the CPU); ``scale`` multiplies ``atol`` (e.g. ``max|V|`` for quantization bounds).

    Returns:
        the largest absolute error.

    Raises:
        AssertionError: shapes differ, ``actual`` has a non-finite value, or an element
            is outside the tolerance (the message names the worst element).
    """
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: expected shape {list(e.shape)}, got {list(a.shape)}")
    if not bool(torch.isfinite(a).all()):
        bad = torch.nonzero(~torch.isfinite(a))[0].tolist()
        raise AssertionError(f"{what}: expected finite values, got {a[tuple(bad)]} at {bad}")
    if a.numel() == 0:
        return 0.0
    err = (a - e).abs()
    limit = tol.atol * scale + tol.rtol * e.abs()
    worst = int(torch.argmax(err - limit))
    idx = list(torch.unravel_index(torch.tensor(worst), a.shape))
    over = float((err - limit).reshape(-1)[worst])
    if over > 0:
        raise AssertionError(
            f"{what}: expected |actual - expected| <= {tol.atol * scale:.3g} + "
            f"{tol.rtol:.3g}*|expected|, got {float(err.reshape(-1)[worst]):.3g} at "
            f"{[int(i) for i in idx]} (actual {float(a.reshape(-1)[worst]):.6g}, expected "
            f"{float(e.reshape(-1)[worst]):.6g}); tolerance reason: {tol.reason}"
        )
    return float(err.max())


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, *, what: str) -> None:
    """Assert two tensors hold identical bits (NaN payloads included).

    Raises:
        AssertionError: shape, dtype or any bit differs (the message names the first
            differing index).
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: expected {list(expected.shape)} {expected.dtype}, got "
            f"{list(actual.shape)} {actual.dtype}"
        )
    a = actual.detach().cpu().contiguous().view(torch.uint8)
    e = expected.detach().cpu().contiguous().view(torch.uint8)
    if not torch.equal(a, e):
        el = actual.element_size()
        diff = int(torch.nonzero((a != e).view(-1, el).any(dim=1))[0, 0])
        idx = [int(i) for i in torch.unravel_index(torch.tensor(diff), actual.shape)]
        raise AssertionError(
            f"{what}: expected bit-identical tensors, first difference at {idx}: actual "
            f"{actual.reshape(-1)[diff].item()!r}, expected {expected.reshape(-1)[diff].item()!r}"
        )
