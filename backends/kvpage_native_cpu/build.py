"""Compile ``kernel.c`` with the system C compiler at first use, cache the shared
library on disk, and load it with ``ctypes``.

The compiler is ``$CC`` (default ``cc``). The library is cached under
``$KVPAGE_CACHE_DIR/native-cpu`` (default ``$XDG_CACHE_HOME/kvpage`` or
``~/.cache/kvpage``), named by a SHA-256 of the kernel source, the compiler's path and
``--version`` output, and the flags, so a changed source, compiler or flag set builds a
new library and never loads a stale one. The compiler writes to a temporary file in the
cache directory that is renamed into place (atomic on POSIX), so concurrent processes
(test workers) can build the same library at once: the last rename wins with identical
bytes, and nobody loads a half-written file.

Flags: ``-O3 -march=native -ffp-contract=fast`` (fused multiply-add where the CPU has
one), plus ``-mprefer-vector-width=512`` on x86-64 so GCC uses whole AVX-512 registers
where it vectorizes on its own. No fast-math flag: masked logits are ``-inf`` and the
kernel's sums have the order its source writes (see ``kernel.c``).

A machine without a compiler, or where compiling fails, gets a reason (``load()``
returns it) and the backend reports itself unavailable with it; nothing raises.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("kernel.c")
#: must match KVP_ABI in kernel.c
ABI = 7
BASE_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=gnu11")

_lock = threading.Lock()
_loaded: dict[tuple[str, str], tuple[ctypes.CDLL | None, str]] = {}


class KvpArgs(ctypes.Structure):
    """The kernel's ``kvp_args`` (field order and types as in ``kernel.c``)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("kv", ctypes.c_void_p),
        ("tsc", ctypes.c_void_p),
        ("fsc", ctypes.c_void_p),
        ("lut", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("query_start", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("units", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("u0", ctypes.c_int64),
        ("u1", ctypes.c_int64),
        ("bt_stride", ctypes.c_int64),
        ("bt_int64", ctypes.c_int64),
        ("kind", ctypes.c_int64),
        ("num_q_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("soft_cap", ctypes.c_float),
    ]


_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGS = ctypes.POINTER(KvpArgs)
#: the library's functions besides ``kvp_abi_version``: name -> (argtypes, restype), as
#: declared in ``kernel.c``
SYMBOLS: dict[str, tuple[list[type], type | None]] = {
    "kvp_paged_attention": ([_ARGS], ctypes.c_int),
    "kvp_paged_attention_parts": ([_ARGS, _I64], ctypes.c_int),
    "kvp_paged_attention_layer": ([_ARGS, _I64, _P, _P, _P, _P], ctypes.c_int),
    "kvp_write_kv": ([_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64], None),
    "kvp_rms_norm": ([_P, _P, _P, _F32, _I64, _I64, _P, _P], None),
    "kvp_rope_qk": ([_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _P], None),
    "kvp_silu_mul": ([_P, _I64, _I64, _P], None),
    "kvp_rms_norm_bf16": ([_P, _P, _P, _F32, _I64, _I64, _P, _P], None),
    "kvp_rope_qk_bf16": ([_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _P], None),
    "kvp_silu_mul_bf16": ([_P, _I64, _I64, _P], None),
    "kvp_argmax_rows": ([_P, _I64, _I64, _I64, _I64, _P], None),
}


def compiler() -> str:
    """The C compiler command (``$CC``, default ``cc``)."""
    return os.environ.get("CC", "").strip() or "cc"


def flags() -> tuple[str, ...]:
    """The compile flags for this machine (see the module docstring)."""
    extra = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
    return (*BASE_FLAGS, *extra)


def cache_dir() -> Path:
    """Where built libraries are kept (created on demand)."""
    root = os.environ.get("KVPAGE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "kvpage",
    )
    return Path(root) / "native-cpu"


def library_path(cc_argv: list[str], cc_path: str) -> Path:
    """The cache path of the library for this source, compiler and flag set."""
    version = subprocess.run(
        [*cc_argv, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc_path.encode(), version.encode(), " ".join(flags()).encode()):  # fmt: skip
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"kvpage_native_cpu-{h.hexdigest()[:24]}.so"


def _build(cc_argv: list[str], target: Path) -> str:
    """Compile into ``target`` (temp file + rename). Returns "" or the failure reason."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*cc_argv, *flags(), "-o", tmp, str(SOURCE), "-lm", "-pthread"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            errors = [m for m in msg if "error" in m]
            first = (errors or msg or [f"exit status {proc.returncode}"])[0]
            return f"C compiler {shlex.join(cc_argv)!r} failed: {first}"
        os.replace(tmp, target)
        return ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernel library, building it first if needed: ``(library, "")``, or
    ``(None, reason)`` when there is no working C compiler. Memoized per ``$CC`` and
    cache directory (thread-safe)."""
    key = (compiler(), str(cache_dir()))
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(*key)
        return _loaded[key]


def _load(cc: str, _cache: str) -> tuple[ctypes.CDLL | None, str]:
    argv = shlex.split(cc)
    path = shutil.which(argv[0]) if argv else None
    if path is None:
        return None, f"no C compiler: CC={cc!r} not found (set CC or install gcc/clang)"
    try:
        target = library_path(argv, path)
        if not target.exists():
            why = _build(argv, target)
            if why:
                return None, why
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"native kernel build/load failed: {e}"
    try:
        lib.kvp_abi_version.restype = ctypes.c_int
        if lib.kvp_abi_version() != ABI:
            return None, f"native kernel ABI: expected {ABI}, got {lib.kvp_abi_version()}"
        for name, (argtypes, restype) in SYMBOLS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    except AttributeError as e:  # a symbol missing: not this kernel's library
        return None, f"native kernel library {target}: {e}"
    return lib, ""
