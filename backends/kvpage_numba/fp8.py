"""FP8 (OCP e4m3 / e5m2) encode and decode in plain integer and float arithmetic.

Numba has no fp8 or bfloat16 type, so the kernels convert by hand. These functions are
plain Python on purpose: ``kvpage_numba.kernels`` compiles them as CUDA device functions
(``numba.cuda.jit(device=True)``), the CUDA simulator runs them as Python, and the tests
compare them bit for bit with torch's conversions on the host.

Conversion rules (OCP 8-bit floating point spec, 2023; torch ``float8_e4m3fn`` and
``float8_e5m2``): round to nearest, ties to even; the caller clamps to ``±fp8_max``
first (``kvpage.attention.quant``) so that nothing overflows; NaN keeps its sign and
becomes ``sign | 0x7F``; ``-0.0`` and negative values that round to zero keep the sign
bit (0x80).
"""

from __future__ import annotations

import math

#: (mantissa bits, exponent bias) of each format
E4M3 = (3, 7)
E5M2 = (2, 15)


def round_half_even(v: float) -> int:
    """Round a non-negative float to the nearest integer, ties to even (exact: no FMA)."""
    f = math.floor(v)
    r = v - f
    n = int(f)
    if r > 0.5 or (r == 0.5 and (n & 1) == 1):
        n += 1
    return n


def fp8_encode(y: float, mbits: int, bias: int) -> int:
    """Bits (0..255) of the fp8 value nearest to ``y``.

    Args:
        y: a float32 value already clamped to the format's finite range (or NaN).
        mbits: mantissa bits (3 for e4m3, 2 for e5m2).
        bias: exponent bias (7 for e4m3, 15 for e5m2).

    Returns:
        The byte as an int; ``sign | 0x7F`` for NaN.
    """
    sign = 0
    if math.copysign(1.0, y) < 0.0:
        sign = 128
    if y != y:
        return sign | 127
    a = abs(y)
    emin = 1 - bias
    sub = a < math.ldexp(1.0, emin)
    # subnormals count in units of 2^(emin - mbits); normals in 2^(e - mbits)
    e = emin if sub else math.frexp(a)[1] - 1
    v = math.ldexp(a, mbits - e)
    # round half to even, inline (this function is compiled as a CUDA device function,
    # which cannot call a plain Python helper)
    f = math.floor(v)
    q = int(f)
    r = v - f
    if r > 0.5 or (r == 0.5 and (q & 1) == 1):
        q += 1
    if sub:
        # q == 2^mbits is the smallest normal, whose code is also 2^mbits
        return sign | q
    if q == (2 << mbits):
        e += 1
        q = 1 << mbits
    return sign | ((e + bias) << mbits) | (q - (1 << mbits))


def fp8_decode(code: int, mbits: int, bias: int) -> float:
    """Value of the fp8 byte ``code`` (finite formats: e4m3fn's 0x7F/0xFF are NaN, e5m2's
    exponent field 31 is inf/NaN)."""
    sign = -1.0 if code & 128 else 1.0
    ef = (code >> mbits) & ((1 << (7 - mbits)) - 1)
    m = code & ((1 << mbits) - 1)
    emax_field = (1 << (7 - mbits)) - 1
    if mbits == 3 and ef == emax_field and m == (1 << mbits) - 1:
        return math.nan
    if mbits == 2 and ef == emax_field:
        return math.nan if m else sign * math.inf
    if ef == 0:
        return sign * math.ldexp(float(m), 1 - bias - mbits)
    return sign * math.ldexp(float(m + (1 << mbits)), ef - bias - mbits)


def bf16_bits_to_float(bits: int) -> float:
    """Value of a bfloat16 given as its 16 bits (int16 or uint16): float32 with the low
    16 mantissa bits zero, built with ldexp (no bit casts needed)."""
    b = int(bits) & 0xFFFF
    sign = -1.0 if b & 0x8000 else 1.0
    ef = (b >> 7) & 0xFF
    m = b & 0x7F
    if ef == 0xFF:
        return math.nan if m else sign * math.inf
    if ef == 0:
        return sign * math.ldexp(float(m), -133)
    return sign * math.ldexp(float(m | 0x80), ef - 134)
