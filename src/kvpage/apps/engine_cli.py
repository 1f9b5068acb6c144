"""``kvpage generate`` and ``kvpage replay`` (registered by ``kvpage.cli``); the engine
options they share are in :mod:`kvpage.apps.engine_args`."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpage.apps.cli_util import Subparsers, miss_markdown, prepare_output, write_output
from kvpage.apps.engine_args import INT64_MAX as INT64_MAX  # re-exported
from kvpage.apps.engine_args import (
    _add_engine_args,
    _engine,
    _float_type,
    _int_type,
    _top_k,
)
from kvpage.errors import KVPageError
from kvpage.jsonout import dumps
from kvpage.report import render_table

DEFAULT_TRACE = "azure-conv"
DEFAULT_NUM_REQUESTS = 200
DEFAULT_PROMPT = "Once upon a time"


# ---- generate -------------------------------------------------------------------------------
def add_generate_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``kvpage generate``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="generate text from prompts with the bundled model"
    )
    p.add_argument(
        "prompts",
        nargs="*",
        default=[DEFAULT_PROMPT],
        help=f"prompt text(s) (default: {DEFAULT_PROMPT!r} when none is given)",
    )
    p.add_argument(
        "--max-tokens", type=_int_type(1), default=256, help="tokens to generate per sample"
    )
    p.add_argument(
        "--temperature", type=_float_type(0.0, lo_open=False), default=0.0, help="0 = greedy"
    )
    p.add_argument(
        "--top-p", type=_float_type(0.0, lo_open=True, hi=1.0), default=1.0, help="in (0, 1]"
    )
    p.add_argument("--top-k", type=_top_k, default=-1, help="-1 or 0 = off")
    p.add_argument("-n", "--n", type=_int_type(1), default=1, help="samples per prompt")
    p.add_argument(
        "--sample-seed",
        type=_int_type(0),
        default=None,
        help="per-request seed (sample i uses seed + i; seed + n - 1 <= 2**63 - 1)",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_engine_args(p)
    p.set_defaults(func=generate_main)
    return p


def generate_main(args: argparse.Namespace) -> int:
    """Handler of ``kvpage generate``."""
    from kvpage.engine import LLM, SamplingParams

    try:
        params = SamplingParams(  # checked before the model loads
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            n=args.n,
            seed=args.sample_seed,
            ignore_eos=args.ignore_eos,
            stop=args.stop,
        )
        engine = _engine(args)
        # The tokenizer's stop ids end a completion by default (TinyStories models end a
        # story with BOS, not EOS, as llama2.c's run.c does); --ignore-eos turns that off.
        stops = getattr(engine.tokenizer, "stop_token_ids", ())
        params.stop_token_ids = None if args.ignore_eos else list(stops) or None
        params.validate()
        llm = LLM.from_engine(engine)
        t0 = time.perf_counter()
        outs = llm.generate(list(args.prompts), params, use_tqdm=False)
        dt = time.perf_counter() - t0
    except KVPageError as e:
        print(f"kvpage generate: {e}", file=sys.stderr)
        return 2
    if args.json:
        rows = [
            {
                "prompt": o.prompt,
                "error": str(o.error) if o.error else None,
                "num_cached_tokens": o.num_cached_tokens,
                "completions": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "token_ids": c.token_ids,
                        "finish_reason": c.finish_reason,
                    }
                    for c in o.outputs
                ],
            }
            for o in outs
        ]
        print(dumps(rows))
    else:
        for o in outs:
            if o.error is not None:
                print(f"[rejected] {o.error}", file=sys.stderr)
                continue
            for c in o.outputs:
                head = f"--- sample {c.index} ---\n" if len(o.outputs) > 1 else ""
                print(f"{head}{o.prompt or ''}{c.text}")
    ntok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(
        f"[{ntok} tokens in {dt:.2f} s, {ntok / dt if dt else 0:.0f} tokens/s, "
        f"backend {llm.llm_engine.backend_name}]",
        file=sys.stderr,
    )
    return 1 if any(o.error is not None for o in outs) else 0


# ---- replay ---------------------------------------------------------------------------------
def add_replay_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``kvpage replay``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="replay a serving trace through the engine and report latency/KV metrics",
        description="Replays a request trace (Azure LLM CSV or Mooncake JSONL) through the "
        "engine at its arrival times, with lengths scaled into the model's context (see "
        "kvpage.apps.replay), then prints a table and writes JSON.",
    )
    p.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="azure-conv (default), azure-code, mooncake-conv, or a .csv/.jsonl path",
    )
    p.add_argument(
        "--num-requests",
        type=_int_type(0),
        default=DEFAULT_NUM_REQUESTS,
        help=f"replay the first N requests (default {DEFAULT_NUM_REQUESTS}; 0 = all)",
    )
    gt0 = _float_type(0.0, lo_open=True)
    p.add_argument("--speedup", type=gt0, default=1.0, help="divide arrival times by this (> 0)")
    p.add_argument(
        "--prompt-scale",
        type=gt0,
        default=None,
        help="divide prompt lengths by this (> 0); default: 8 Azure, 32 Mooncake",
    )
    p.add_argument(
        "--output-scale", type=gt0, default=1.0, help="divide output lengths by this (> 0)"
    )
    p.add_argument("--output", default="out/replay.json", help="JSON summary path ('' = none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_engine_args(p)
    p.set_defaults(func=replay_main)
    return p


def _rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    def pct(k: str) -> str:
        d = s[k]
        return " / ".join(  # no sample: None (JSON null) or NaN (kvpage.stats.summarize)
            "n/a" if d[q] is None or d[q] != d[q] else f"{d[q]:,.1f}" for q in ("p50", "p95", "p99")
        )

    rej = f"{s['rejected']}" + (f" ({', '.join(s['rejected_reasons'])})" if s["rejected"] else "")
    return [
        ("requests (completed / replayed)", f"{s['completed']} / {s['requests']}"),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        ("generated tokens", f"{s['generated_tokens']:,}"),
        ("TTFT p50 / p95 / p99 (ms)", pct("ttft_ms")),
        ("TPOT p50 / p95 / p99 (ms)", pct("tpot_ms")),
        ("end-to-end p50 / p95 / p99 (ms)", pct("e2e_ms")),
        ("prefill tokens/s", f"{s['prefill_tokens_per_s']:,.0f}"),
        ("decode tokens/s", f"{s['decode_tokens_per_s']:,.0f}"),
        ("KV cache usage peak / mean", f"{s['kv_usage_peak']:.1%} / {s['kv_usage_mean']:.1%}"),
        (
            "prefix hits, first admission",
            f"{s['first_admission_hit_ratio']:.1%} ("
            + (", ".join(f"{k} {v:,}" for k, v in s["prefix_hit_tokens_by_tier"].items()) or "0")
            + " tokens)",
        ),
        (
            "prefix hits, all lookups",
            f"{s['prefix_hit_ratio']:.1%} ({s['prefix_hit_tokens']:,} tokens; readmissions "
            "after preemption included)",
        ),
        ("preemptions", f"{s['preemptions']}"),
        ("block allocation failures", f"{s['allocation_failures']}"),
        ("rejected requests", rej),
        ("engine steps / wall time", f"{s['steps']:,} / {s['duration_s']:.1f} s"),
    ]


def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    print(render_table(title, rows, width=None), end="")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While active, the first SIGTERM raises :class:`kvpage.apps.replay.Terminated`
    (a KeyboardInterrupt) in the main thread, so ``kill`` stops a replay the way Ctrl-C
    does; a second SIGTERM gets the previous handler (default: end the process). Does
    nothing outside the main thread (signal handlers can only be set there)."""
    from kvpage.apps.replay import Terminated

    try:
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
            raise Terminated()

        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def replay_main(args: argparse.Namespace) -> int:
    """Handler of ``kvpage replay``."""
    with sigterm_as_interrupt():
        return _replay_main(args)


def _replay_main(args: argparse.Namespace) -> int:
    from kvpage.apps.replay import fit_trace, replay, resolve_prompt_scale
    from kvpage.workload.traces import load_trace

    try:
        if args.output:  # before any work: a path that cannot be written is refused now
            prepare_output(args.output, "--output")
        limit = None if args.num_requests <= 0 else args.num_requests
        trace = load_trace(args.trace, limit=limit)
        eng = _engine(args)
        reqs = fit_trace(
            trace,
            max_model_len=eng.scheduler.max_model_len,
            vocab_size=eng.vocab_size,
            prompt_scale=args.prompt_scale,
            output_scale=args.output_scale,
            seed=eng.config.seed,
        )
    except (KVPageError, ValueError) as e:
        print(f"kvpage replay: {e}", file=sys.stderr)
        return 2
    cap = "" if limit is None else f" (the first {len(reqs)}; --num-requests 0 for all)"
    print(
        f"Replaying {len(reqs)} requests of trace {trace.name}{cap} over "
        f"{trace.duration_s / args.speedup:.1f} s of arrivals (speedup {args.speedup:g}) on "
        f"{eng.config.model}, backend {eng.backend_name}, {eng.cache_spec.num_blocks} blocks x "
        f"{eng.cache_spec.block_size} tokens; lengths scaled per kvpage.apps.replay.",
        file=sys.stderr,
    )
    bar: Any = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), unit="req", desc="replay", file=sys.stderr, mininterval=1.0)
        except ImportError:  # pragma: no cover
            bar = None
    res = replay(
        eng, reqs, speedup=args.speedup, on_finish=(lambda _o: bar.update(1)) if bar else None
    )
    if bar is not None:
        bar.close()
    s = dict(res.summary)
    s.update(
        trace=trace.name,
        trace_path=trace.path,
        model=eng.config.model,
        backend=eng.backend_name,
        block_size=eng.cache_spec.block_size,
        num_blocks=eng.cache_spec.num_blocks,
        max_model_len=eng.scheduler.max_model_len,
        prompt_scale=resolve_prompt_scale(trace.format, args.prompt_scale),
        output_scale=args.output_scale,
        bookkeeping_share=eng.step_stats.bookkeeping_share,
    )
    stop = " (interrupted)" if s["interrupted"] else ""
    _print_table(f"kvpage replay: {trace.name}, {s['completed']} requests{stop}", _rows(s))
    if s["miss_reasons"]:
        print("cache misses by reason (prompt tokens computed instead of served from cache):")
        print(miss_markdown([([], s["miss_reasons"])], []))
    if args.output:
        path = Path(args.output)
        text = dumps(s) + "\n"
        try:  # checked up front; written atomically (an old file stays whole)
            write_output(path, text)
        except OSError as e:  # the disk may still fill or the folder go: keep the run
            print(
                f"kvpage replay: --output: could not write {path} ({e.strerror or e}); the "
                "JSON summary follows on stdout so the run is not lost",
                file=sys.stderr,
            )
            sys.stdout.write(text)
            return 1
        print(f"wrote {path}", file=sys.stderr)
    # the shell's codes: 130 = 128 + SIGINT (Ctrl-C), 143 = 128 + SIGTERM
    return {"SIGINT": 130, "SIGTERM": 143}.get(s["interrupted_by"], 0)


__all__ = ["add_generate_parser", "add_replay_parser", "generate_main", "replay_main"]
