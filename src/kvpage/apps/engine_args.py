"""The engine options shared by ``kvpage generate`` and ``kvpage replay``: argparse
option types that name the accepted range, the ``engine`` argument group, and building
the ``LLMEngine`` from the parsed options.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvpage.engine.cli_flags import add_prefix_caching_flags, add_tier_flags, tier_kwargs

INT64_MAX = 2**63 - 1


# ---- option types: argparse prints "argument --x: expected X, got Y" and exits 2 -------
def _int_type(lo: int, hi: int = INT64_MAX, extra: str = "") -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            rng = f"an int >= {lo}" if hi == INT64_MAX else f"an int in [{lo}, {hi}]"
            if v is not None and v > hi:  # name the bound that was crossed
                top = "2**63 - 1" if hi == INT64_MAX else f"{hi}"
                rng = f"an int in [{lo}, {top}] (upper bound {hi})"
            raise argparse.ArgumentTypeError(f"expected {rng}{extra}, got {text!r}")
        return v

    parse.__name__ = "int"
    return parse


def _top_k(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not -1 <= v <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected -1 or 0 (off) or an int >= 1, got {text!r}")
    return v


def _float_type(lo: float, *, lo_open: bool, hi: float | None = None) -> Any:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
            if hi is not None:
                rng = f"in ({lo:g}, {hi:g}]" if lo_open else f"in [{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a finite number {rng}, got {text!r}")
        return v

    parse.__name__ = "float"
    return parse


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="stories260K", help="stories260K (bundled) or an HF folder")
    pos = _int_type(1)
    g.add_argument("--block-size", type=pos, default=16, help="tokens per block")
    g.add_argument(
        "--num-blocks",
        type=_int_type(2, extra=" (block 0 is the reserved null block)"),
        default=None,
        help="blocks in the pool, >= 2 (default: sized)",
    )
    g.add_argument("--kv-cache-memory-bytes", type=pos, default=None, help="KV cache budget")
    g.add_argument("--max-num-seqs", type=pos, default=256, help="most running sequences")
    g.add_argument("--max-num-batched-tokens", type=pos, default=2048, help="token budget per step")
    g.add_argument(
        "--max-model-len", type=pos, default=None, help="default (and most): the model's"
    )
    add_prefix_caching_flags(g)
    g.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"]
    )
    g.add_argument("--backend", default="auto", help="attention backend (auto, torch, ...)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    g.add_argument("--seed", type=_int_type(0), default=0, help="engine seed")
    g.add_argument(
        "--threads",
        type=_int_type(0),
        default=None,
        help="CPU compute threads (default 1: the fast setting on a small or shared "
        "machine, see docs/benchmarks.md; 0 = torch's default, one per core)",
    )
    g.add_argument(
        "--kv-retention-max-share",
        type=_float_type(0.0, lo_open=False, hi=1.0),
        default=0.5,
        help="most of the KV pool kv_retention policies may hold (default 0.5)",
    )
    add_tier_flags(g)


def _engine(args: argparse.Namespace) -> Any:
    from kvpage.engine import LLMEngine

    return LLMEngine.from_config(
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        num_threads=args.threads,
        kv_retention_max_share=args.kv_retention_max_share,
        **tier_kwargs(args),
    )
