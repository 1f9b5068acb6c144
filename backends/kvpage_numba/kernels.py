"""``@numba.cuda.jit`` kernels of the numba backend (imported lazily: imports numba).

Kernels take raw arrays (no builtin ``min``/``max``: their numba overloads compile as
device functions for the current device, which needs a driver even for ``compile_ptx``), strides come with the arrays, sizes are arguments; every check
is in the launcher (``kvpage_numba.backend``). Element kinds are compile-time choices:
each ``*_kernel(...)`` factory closes over small device functions for one storage kind
and is cached, so a kernel never branches on a dtype at run time.

Storage kinds: ``float`` (float32/float16 arrays, read natively), ``bf16`` (bfloat16
carried as int16 bits: numba has no bfloat16 type), ``int8`` (codes times a per-token,
per-head float32 scale), ``fp8`` (bytes decoded through a 256-entry float32 table that
the launcher builds with torch, times a per-head scale).

Attention work split (the same kernel serves decode and prefill): one thread block per
(query token, query head, KV split); its threads take keys ``start + tid, start + tid +
blockDim, ...``, each keeping an online-softmax state (running max, sum, accumulator
[head_dim]) as in FlashAttention (Dao et al., 2022); the block then merges its threads'
states through shared memory. With more than one KV split, each block writes a partial
output and its log-sum-exp, and ``split_reduce_kernel`` merges them (FlashDecoding,
Dao et al., 2023; vLLM paged attention v2).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numba
import numpy as np
from numba import cuda

from kvpage_numba.fp8 import bf16_bits_to_float, fp8_encode, round_half_even
from kvpage_numba.simulator import cudasim_enabled, install_locked_shared_arrays

#: largest head_dim the kernels hold in per-thread arrays
MAX_HEAD_DIM = 256
#: largest thread block the shared-memory merge supports
MAX_THREADS = 128

_SIM = cudasim_enabled()
if _SIM:  # the simulator's shared-array allocation races without it (simulator.py)
    install_locked_shared_arrays()
_NEG_INF = np.float32(-np.inf)


def _device(fn: Any) -> Any:
    """``cuda.jit(device=True)`` on a GPU; the plain function under the simulator, whose
    device-function wrapper costs microseconds per call (it rescans module globals)."""
    return fn if _SIM else cuda.jit(device=True)(fn)


_rne = _device(round_half_even)
_fp8_encode = _device(fp8_encode)
_bf16_py = _device(bf16_bits_to_float)


if _SIM:

    @_device
    def _bf16(bits: Any) -> Any:
        return np.float32(_bf16_py(bits))

else:  # pragma: no cover - compiled for a real GPU only
    from numba.cuda import libdevice

    @_device
    def _bf16(bits: Any) -> Any:
        return libdevice.int_as_float(np.int32((np.int32(bits) & 0xFFFF) << 16))


@_device
def _rne_signed(v: Any) -> Any:
    if v < 0:
        return -_rne(-v)
    return _rne(v)


def _loader(kind: str) -> Any:
    """Device function ``(arr, i0, i1, i2, i3, i4, lut) -> float32`` for a storage kind
    (unscaled: int8 codes and fp8 values before their scale)."""
    if kind == "bf16":

        @_device
        def load(a: Any, i0: Any, i1: Any, i2: Any, i3: Any, i4: Any, lut: Any) -> Any:
            return _bf16(a[i0, i1, i2, i3, i4])

    elif kind == "fp8":

        @_device
        def load(a: Any, i0: Any, i1: Any, i2: Any, i3: Any, i4: Any, lut: Any) -> Any:
            return lut[np.int32(a[i0, i1, i2, i3, i4]) & 0xFF]

    else:

        @_device
        def load(a: Any, i0: Any, i1: Any, i2: Any, i3: Any, i4: Any, lut: Any) -> Any:
            return np.float32(a[i0, i1, i2, i3, i4])

    return load


def _row_scale(kind: str) -> Any:
    """Device function ``(token_scales, fp8_scales, which, blk, off, kh) -> float32``."""
    if kind == "int8":

        @_device
        def rs(tsc: Any, fsc: Any, which: Any, blk: Any, off: Any, kh: Any) -> Any:
            return tsc[which, blk, off, kh]

    elif kind == "fp8":

        @_device
        def rs(tsc: Any, fsc: Any, which: Any, blk: Any, off: Any, kh: Any) -> Any:
            return fsc[which, kh]

    else:

        @_device
        def rs(tsc: Any, fsc: Any, which: Any, blk: Any, off: Any, kh: Any) -> Any:
            return np.float32(1.0)

    return rs


def _src_loader(kind: str) -> Any:
    """Device function ``(arr [tokens, heads, dim], t, h, d) -> float32``."""
    if kind == "bf16":

        @_device
        def load(a: Any, t: Any, h: Any, d: Any) -> Any:
            return _bf16(a[t, h, d])

    else:

        @_device
        def load(a: Any, t: Any, h: Any, d: Any) -> Any:
            return np.float32(a[t, h, d])

    return load


# ---- write_kv ---------------------------------------------------------------------------
def write_kv_pyfunc(src_kind: str, dst_kind: str, mbits: int = 3, bias: int = 7) -> Any:
    """Python source of the write kernel for one (source, destination) kind.

    Kernel ``(key, value, kv, token_scales, fp8_scales, slots, block_size, fp8_max)``;
    grid ``(num_tokens,)``, block ``(>= 2 * num_kv_heads,)``: thread ``w * H + h``
    writes K (w=0) or V (w=1) of head ``h``. ``dst_kind``: ``copy`` (same dtype, bits
    copied), ``int8`` or ``fp8`` (``mbits``/``bias`` select e4m3 or e5m2).
    """
    load = _src_loader(src_kind)

    if dst_kind == "copy":

        @_device
        def write_row(src: Any, t: Any, h: Any, kv: Any, tsc: Any, fsc: Any, w: Any, b: Any, o: Any, fmax: Any) -> None:  # fmt: skip
            for d in range(src.shape[2]):
                kv[w, b, o, h, d] = src[t, h, d]

    elif dst_kind == "int8":

        @_device
        def write_row(src: Any, t: Any, h: Any, kv: Any, tsc: Any, fsc: Any, w: Any, b: Any, o: Any, fmax: Any) -> None:  # fmt: skip
            D = src.shape[2]
            amax = np.float32(0.0)
            for d in range(D):
                a = abs(load(src, t, h, d))
                if a > amax:
                    amax = a
            scale = np.float32(amax / np.float32(127.0))
            for d in range(D):
                code = 0
                if scale > 0:
                    y = np.float32(load(src, t, h, d) / scale)
                    code = _rne_signed(y)
                    if code > 127:
                        code = 127
                    elif code < -127:
                        code = -127
                kv[w, b, o, h, d] = code
            tsc[w, b, o, h] = scale

    else:

        @_device
        def write_row(src: Any, t: Any, h: Any, kv: Any, tsc: Any, fsc: Any, w: Any, b: Any, o: Any, fmax: Any) -> None:  # fmt: skip
            sc = fsc[w, h]
            for d in range(src.shape[2]):
                y = np.float32(load(src, t, h, d) / sc)
                if y == y:
                    if y > fmax:
                        y = fmax
                    elif y < -fmax:
                        y = -fmax
                kv[w, b, o, h, d] = _fp8_encode(y, mbits, bias)

    def kernel(key: Any, value: Any, kv: Any, tsc: Any, fsc: Any, slots: Any, block_size: Any, fmax: Any) -> None:  # fmt: skip
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        H = key.shape[1]
        if tid >= 2 * H:
            return
        slot = slots[t]
        if slot < 0:
            return
        b = slot // block_size
        o = slot % block_size
        w = tid // H
        h = tid % H
        if w == 0:
            write_row(key, t, h, kv, tsc, fsc, w, b, o, fmax)
        else:
            write_row(value, t, h, kv, tsc, fsc, w, b, o, fmax)

    return kernel


@cache
def write_kv_kernel(src_kind: str, dst_kind: str, mbits: int = 3, bias: int = 7) -> Any:
    """Compiled (lazily, per argument types) write kernel; see ``write_kv_pyfunc``."""
    return cuda.jit(write_kv_pyfunc(src_kind, dst_kind, mbits, bias))


# ---- attention ----------------------------------------------------------------------------
def attention_pyfunc(q_kind: str, kv_kind: str) -> Any:
    """Python source of the paged attention kernel (decode and varlen prefill).

    Kernel arguments: ``q [num_tokens, Hq, D]``, ``kv [2, num_blocks, block_size, Hkv,
    D]``, ``tsc [2, num_blocks, block_size, Hkv]`` float32 (int8 scales or a dummy),
    ``fsc [2, Hkv]`` float32 (fp8 scales or a dummy), ``lut [256]`` float32 (fp8 table or
    a dummy), ``block_tables [num_seqs, max_blocks]`` int32, ``token_seq``/``token_pos``
    ``[num_tokens]`` int32 (sequence and absolute position of each query row), ``out
    [num_tokens, Hq, D]`` float32, ``part_out [num_tokens, Hq, splits, D]`` and
    ``part_lse [num_tokens, Hq, splits]`` float32 (used when ``num_splits > 1``), then
    scalars ``block_size, scale, window (0 = none), soft_cap (0 = none), chunk,
    num_splits, heads_per_block``. Grid ``(num_tokens, ceil(Hq / heads_per_block),
    num_splits)``, block ``(T,)``, T <= 128.
    """
    load_q = _src_loader(q_kind)
    load_kv = _loader(kv_kind)
    row_scale = _row_scale(kv_kind)

    def kernel(q: Any, kv: Any, tsc: Any, fsc: Any, lut: Any, bt: Any, token_seq: Any, token_pos: Any, out: Any, part_out: Any, part_lse: Any, block_size: Any, scale: Any, window: Any, soft_cap: Any, chunk: Any, num_splits: Any, heads_per_block: Any) -> None:  # fmt: skip
        # one block serves heads_per_block query heads in turn (1 on a GPU; all heads of a
        # token under the simulator, whose cost is per block)
        sm_m = cuda.shared.array(MAX_THREADS, numba.float32)
        sm_l = cuda.shared.array(MAX_THREADS, numba.float32)
        sm_acc = cuda.shared.array(MAX_HEAD_DIM, numba.float32)
        for hh in range(heads_per_block):
            h = cuda.blockIdx.y * heads_per_block + hh
            if h >= q.shape[1]:
                break
            t = cuda.blockIdx.x
            z = cuda.blockIdx.z
            tid = cuda.threadIdx.x
            T = cuda.blockDim.x
            D = q.shape[2]
            kh = h // (q.shape[1] // kv.shape[3])
            s = token_seq[t]
            p = token_pos[t]
            lo = 0
            if window > 0:
                lo = p - window + 1
                if lo < 0:
                    lo = 0
            start = lo + z * chunk
            end = start + chunk
            if end > p + 1:
                end = p + 1

            qv = cuda.local.array(MAX_HEAD_DIM, numba.float32)
            acc = cuda.local.array(MAX_HEAD_DIM, numba.float32)
            for d in range(D):
                qv[d] = np.float32(load_q(q, t, h, d) * scale)
                acc[d] = np.float32(0.0)
            m = _NEG_INF
            ssum = np.float32(0.0)
            j = start + tid
            while j < end:
                blk = bt[s, j // block_size]
                off = j % block_size
                dot = np.float32(0.0)
                for d in range(D):
                    dot += qv[d] * load_kv(kv, 0, blk, off, kh, d, lut)
                dot = np.float32(dot * row_scale(tsc, fsc, 0, blk, off, kh))
                if soft_cap > 0:
                    dot = np.float32(soft_cap * math.tanh(dot / soft_cap))
                if dot > m:
                    corr = np.float32(math.exp(m - dot))
                    ssum = np.float32(ssum * corr)
                    for d in range(D):
                        acc[d] = np.float32(acc[d] * corr)
                    m = dot
                pw = np.float32(math.exp(dot - m))
                ssum = np.float32(ssum + pw)
                pv = np.float32(pw * row_scale(tsc, fsc, 1, blk, off, kh))
                for d in range(D):
                    acc[d] += pv * load_kv(kv, 1, blk, off, kh, d, lut)
                j += T

            # merge the threads' states
            sm_m[tid] = m
            sm_l[tid] = ssum
            for d in range(tid, D, T):
                sm_acc[d] = np.float32(0.0)
            cuda.syncthreads()
            big = _NEG_INF
            for i in range(T):
                if sm_m[i] > big:
                    big = sm_m[i]
            total = np.float32(0.0)
            if big > _NEG_INF:
                for i in range(T):
                    if sm_m[i] > _NEG_INF:
                        total += np.float32(sm_l[i] * math.exp(sm_m[i] - big))
                if m > _NEG_INF:
                    f = np.float32(math.exp(m - big))
                    for d in range(D):
                        cuda.atomic.add(sm_acc, d, np.float32(acc[d] * f))
            cuda.syncthreads()
            if num_splits == 1:
                for d in range(tid, D, T):
                    out[t, h, d] = sm_acc[d] / total
            else:
                for d in range(tid, D, T):
                    part_out[t, h, z, d] = sm_acc[d] / total if total > 0 else np.float32(0.0)
                if tid == 0:
                    part_lse[t, h, z] = big + math.log(total) if total > 0 else _NEG_INF
            cuda.syncthreads()  # shared state is reused by the next head

    return kernel


@cache
def attention_kernel(q_kind: str, kv_kind: str) -> Any:
    """Compiled attention kernel; see ``attention_pyfunc``."""
    return cuda.jit(attention_pyfunc(q_kind, kv_kind))


def split_reduce(part_out: Any, part_lse: Any, out: Any, heads_per_block: Any) -> None:
    """Merge KV-split partials: ``out[t, h] = sum_z w_z part_out[t, h, z] / sum_z w_z``
    with ``w_z = exp(lse_z - max lse)``. Grid ``(num_tokens, ceil(Hq / heads_per_block))``,
    any block size."""
    t = cuda.blockIdx.x
    Z = part_lse.shape[2]
    D = out.shape[2]
    for hh in range(heads_per_block):
        h = cuda.blockIdx.y * heads_per_block + hh
        if h >= out.shape[1]:
            break
        big = _NEG_INF
        for z in range(Z):
            if part_lse[t, h, z] > big:
                big = part_lse[t, h, z]
        for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
            num = np.float32(0.0)
            den = np.float32(0.0)
            for z in range(Z):
                lse = part_lse[t, h, z]
                if lse > _NEG_INF:
                    w = np.float32(math.exp(lse - big))
                    num += w * part_out[t, h, z, d]
                    den += w
            out[t, h, d] = num / den


split_reduce_kernel = cuda.jit(split_reduce)


# ---- copy_blocks ----------------------------------------------------------------------------
def copy_blocks(arr: Any, pairs: Any) -> None:
    """``arr[w, dst] = arr[w, src]`` for each pair; ``arr [2, num_blocks, elems]`` of an
    integer view (bit-exact). Grid ``(num_pairs, 2)``, any block size."""
    i = cuda.blockIdx.x
    w = cuda.blockIdx.y
    src = pairs[i, 0]
    dst = pairs[i, 1]
    for e in range(cuda.threadIdx.x, arr.shape[2], cuda.blockDim.x):
        arr[w, dst, e] = arr[w, src, e]


copy_blocks_kernel = cuda.jit(copy_blocks)
