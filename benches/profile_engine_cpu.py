"""Where the engine's CPU goes per step, outside attention (issue 14's small-model row).

Drives ``LLMEngine`` directly on a ``bench_peers.py`` workload (token-id prompts,
greedy, ``ignore_eos``, all requests submitted at once, as ``benches/peers/worker.py``
does), warmed up on the first ``--warmup`` requests, then runs the whole workload
``--rounds`` times and prints one JSON line per round: output tokens, process CPU
seconds, tokens per CPU-second, the engine thread's CPU split into the backend's
``forward`` (attention), ``write_kv`` and ``plan`` and the rest, the number of steps
and the load average. The backend's methods are wrapped with ``time.thread_time``
counters (about 1 us per call).

``--profile FILE`` runs one more round under ``cProfile`` with ``time.thread_time`` as
its clock (CPU time, not wall time: the machine is shared) and prints the
non-attention CPU by category, per step and per call, from cumulative times of the
step's functions.

Usage (model folder and workload written by ``bench_peers.py``'s ``prepare_model``)::

    OMP_NUM_THREADS=1 .venv/bin/python benches/profile_engine_cpu.py \\
        --model out/peers/stories260K-hd32 --workload out/peers/workload-200-0.json \\
        --backend torch [--profile out/engine.prof]

For an A/B of two trees run it alternately with ``PYTHONPATH=<tree>/src:<tree>/backends``;
for a boolean setting, ``--toggle MODULE:ATTR`` alternates it round by round in one process.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from typing import Any

import kvpage  # noqa: F401  (before torch: sets OMP_WAIT_POLICY)


def _categories(backend: Any) -> list[tuple[str, list[Any]]]:
    """(category, functions whose cumulative CPU it is) of the step's non-overlapping
    parts; attention, KV writes and plan are the backend's own methods."""
    from kvpage.engine import engine, output_processor, runner, sampler, scheduler
    from kvpage.models import layers, model, rope

    cls = type(backend)
    return [
        ("attention (backend forward)", [cls.forward]),
        ("KV writes (backend write_kv)", [cls.write_kv]),
        ("backend plan", [cls.plan]),
        ("step inputs (StepInputs)", [runner.StepInputs.__init__]),
        ("metadata tensors (build_metadata, incl. plan)", [runner.ModelRunner.build_metadata]),
        ("linears (fused + packed)", [layers.FusedLinear.__call__, layers.PackedWeight.__call__]),
        ("RMSNorm", [layers.RMSNorm.forward]),
        ("RoPE rotation", [getattr(rope, "apply_rope_qkv", rope.apply_rope_qk)]),
        ("RoPE tables", [rope.RotaryEmbedding.forward]),
        ("MLP (incl. its linears)", [layers.MLP.forward]),
        ("attention layer (incl. qkv/o, rope, write, attn)", [layers.PagedAttention.forward]),
        ("model forward (all)", [model.ModelRunnerModel.forward]),
        ("runner.execute (all)", [runner.ModelRunner.execute]),
        ("sampling (Sampler)", [sampler.Sampler.sample]),
        ("scheduler.schedule", [scheduler.Scheduler.schedule]),
        ("scheduler.update", [scheduler.Scheduler.update]),
        ("outputs (_make_output)", [output_processor.OutputProcessor._make_output]),
        ("step (all)", [engine.LLMEngine.step]),
    ]


def _wrap(obj: Any, name: str, spent: dict[str, float], key: str) -> None:
    """Replace ``obj.name`` by a wrapper adding the engine thread's CPU time of each call
    to ``spent[key]``."""
    orig = getattr(obj, name)

    def timed(*a: Any, _o: Any = orig, **k: Any) -> Any:
        t = time.thread_time()
        try:
            return _o(*a, **k)
        finally:
            spent[key] += time.thread_time() - t

    setattr(obj, name, timed)


#: engine-thread CPU split of one step, (key, what it covers); the leaves do not overlap
#: except where noted, "other" columns are derived in :func:`split`
SPLIT_KEYS = [
    ("step", "LLMEngine.step, all"),
    ("schedule", "Scheduler.schedule"),
    ("execute", "ModelRunner.execute, all"),
    ("metadata", "ModelRunner.build_metadata (metadata tensors + backend plan)"),
    ("plan", "backend.plan (inside metadata)"),
    ("model", "the model's forward, all"),
    ("attention", "backend.forward"),
    ("write_kv", "backend.write_kv"),
    ("linears", "FusedLinear / PackedWeight calls"),
    ("rmsnorm", "RMSNorm.forward"),
    ("rope", "RoPE tables + rotation"),
    ("sampler", "Sampler"),
    ("update", "Scheduler.update"),
    ("outputs", "building RequestOutputs"),
    ("release", "Scheduler.release + forgetting finished requests"),
]


def instrument(eng: Any) -> dict[str, float]:
    """Wrap the engine's step parts with thread-CPU counters (about 1-2 us per call,
    ~60 calls per step of a 5-layer model)."""
    from kvpage.models import layers

    spent = {k: 0.0 for k, _ in SPLIT_KEYS}
    _wrap(eng, "step", spent, "step")
    _wrap(eng.scheduler, "schedule", spent, "schedule")
    _wrap(eng.scheduler, "update", spent, "update")
    _wrap(eng.scheduler, "release", spent, "release")
    _wrap(eng.outputs, "forget", spent, "release")
    _wrap(eng.outputs, "_make_output", spent, "outputs")
    _wrap(eng.sampler, "sample", spent, "sampler")
    _wrap(eng.runner, "execute", spent, "execute")
    _wrap(eng.runner, "build_metadata", spent, "metadata")
    _wrap(eng.runner, "model", spent, "model")
    _wrap(eng.backend, "forward", spent, "attention")
    _wrap(eng.backend, "write_kv", spent, "write_kv")
    _wrap(eng.backend, "plan", spent, "plan")
    for cls in (layers.FusedLinear, layers.PackedWeight):
        _wrap(cls, "__call__", spent, "linears")
    _wrap(layers.RMSNorm, "forward", spent, "rmsnorm")
    _wrap(layers.RotaryEmbedding, "forward", spent, "rope")
    for fn in ("apply_rope_qkv", "apply_rope_qk"):  # whichever the layer calls
        if hasattr(layers, fn):
            _wrap(layers, fn, spent, "rope")
            break
    return spent


def split(spent: dict[str, float], steps: int) -> dict[str, float]:
    """ms per step of each part, with the derived remainders."""
    ms = {k: v / steps * 1e3 for k, v in spent.items()}
    ms["metadata"] -= ms["plan"]  # metadata tensors alone
    leaves = ("attention", "write_kv", "linears", "rmsnorm", "rope")
    ms["model_other"] = ms["model"] - sum(ms[k] for k in leaves)
    ms["step_inputs"] = ms["execute"] - ms["model"] - ms["metadata"] - ms["plan"]
    parts = ("schedule", "execute", "sampler", "update", "outputs", "release")
    ms["engine_other"] = ms["step"] - sum(ms[k] for k in parts)
    ms["non_attention"] = ms["step"] - ms["attention"]
    return {k: round(v, 3) for k, v in ms.items()}


def run_once(eng: Any, work: list[Any], sp: Any) -> int:
    for i, (p, m) in enumerate(work):
        eng.add_request(
            f"r{i}-{time.perf_counter_ns()}", p, sp(max_tokens=m, ignore_eos=True, temperature=0.0)
        )
    toks = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                toks += len(o.outputs[0].token_ids)
    return toks


def _attribute(
    prof: cProfile.Profile, steps: int, total: float, backend: Any
) -> list[dict[str, Any]]:
    st = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for cat, funcs in _categories(backend):
        ct = calls = 0.0
        for f in funcs:
            f = getattr(f, "__wrapped__", f)
            code = f.__code__
            key = (code.co_filename, code.co_firstlineno, code.co_name)
            if key in st:
                ct += st[key][3]
                calls += st[key][1]
        rows.append({"category": cat, "cpu_s": ct, "ms_per_step": ct / steps * 1e3,
                     "calls_per_step": calls / steps, "share": ct / total})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="out/peers/stories260K-hd32")
    ap.add_argument("--workload", default="out/peers/workload-200-0.json")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=0, help="cap on outputs (0 = none)")
    ap.add_argument("--warmup", type=int, default=16, help="warm-up on the first N requests")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", default="", help="also one cProfile round, stats to FILE")
    ap.add_argument("--label", default="")
    ap.add_argument("--no-split", action="store_true", help="no per-part CPU counters")
    ap.add_argument(
        "--toggle",
        default="",
        help="MODULE:ATTR of a boolean setting to A/B in this process: rounds alternate "
        "it off (even rounds) and on (odd), e.g. kvpage_native_cpu.backend:LAYER_OPS",
    )
    args = ap.parse_args()

    from kvpage.engine import LLMEngine, SamplingParams

    with open(args.workload) as f:
        work = json.load(f)
    if args.max_tokens:
        work = [(p, min(m, args.max_tokens)) for p, m in work]
    eng = LLMEngine.from_config(
        model=args.model, dtype="float32", num_threads=args.threads, max_num_seqs=256,
        max_num_batched_tokens=2048, max_model_len=512, enable_prefix_caching=True,
        backend=args.backend,
    )  # fmt: skip
    spent = instrument(eng) if not args.no_split else {}
    run_once(eng, work[: args.warmup], SamplingParams)
    toggle = None
    if args.toggle:
        import importlib

        mod_name, _, attr = args.toggle.partition(":")
        toggle = (importlib.import_module(mod_name), attr)
        getattr(toggle[0], attr)  # AttributeError now, not after the warm-up
    for r in range(args.rounds):
        if toggle is not None:
            setattr(toggle[0], toggle[1], r % 2 == 1)
        for k in spent:
            spent[k] = 0.0
        s0 = eng.step_stats.num_steps
        c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        toks = run_once(eng, work, SamplingParams)
        cpu, thr = time.process_time() - c0, time.thread_time() - t0
        wall = time.perf_counter() - w0
        steps = eng.step_stats.num_steps - s0
        row = {
            "label": args.label, "backend": args.backend, "round": r, "tokens": toks,
            "cpu_s": round(cpu, 3), "tok_per_cpu_s": round(toks / cpu, 1),
            "tok_per_s": round(toks / wall, 1), "thread_cpu_s": round(thr, 3), "steps": steps,
            "load": round(os.getloadavg()[0], 1),
        }  # fmt: skip
        if toggle is not None:
            row[args.toggle] = r % 2 == 1
        if spent:
            row["attention_s"] = round(spent["attention"], 3)
            row["non_attention_s"] = round(thr - spent["attention"], 3)
            row["ms_per_step"] = split(spent, steps)
        print(json.dumps(row), flush=True)
    if args.profile:
        s0 = eng.step_stats.num_steps
        prof = cProfile.Profile(time.thread_time)
        t0 = time.thread_time()
        prof.enable()
        toks = run_once(eng, work, SamplingParams)
        prof.disable()
        thr = time.thread_time() - t0
        steps = eng.step_stats.num_steps - s0
        prof.dump_stats(args.profile)
        print(f"profiled round: {toks} tokens, {steps} steps, engine thread {thr:.2f} s CPU "
              f"(cProfile inflates it)")  # fmt: skip
        for row in _attribute(prof, steps, thr, eng.backend):
            print(f"{row['category']:46s} {row['cpu_s']:7.2f} s {row['share'] * 100:5.1f} % "
                  f"{row['ms_per_step']:7.3f} ms/step {row['calls_per_step']:8.1f} calls/step")  # fmt: skip


if __name__ == "__main__":
    main()
