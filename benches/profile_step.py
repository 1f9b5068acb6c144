"""Python calls per engine decode step (cProfile), stories260K on CPU.

Runs ``--num-seqs`` requests (prompt of 5 tokens, ``ignore_eos``) until every one is
decoding, then profiles ``--steps`` decode steps with ``cProfile`` and reports the mean
number of calls per step (cProfile's call counts, recursive included): of functions
defined in Python source files (``python_calls_per_step``, the headline number), of
kvpage's own functions, and of everything including C builtins, the number of source files they come from, and the functions with the most
calls. Deterministic: the count does not depend on the machine's speed.

Usage: ``.venv/bin/python benches/profile_step.py [--num-seqs 4] [--steps 5] [--top 15]
[--backend torch]``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--backend", default="torch", help="attention backend (torch, native-cpu, ...)")
    args = ap.parse_args()

    from kvpage import engine as E

    llm = E.LLM("stories260K", max_num_seqs=64, backend=args.backend)
    eng = llm.llm_engine
    params = E.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(args.num_seqs):
        eng.add_request(f"r{i}", [1, 5 + i, 6, 7, 8], params)
    for _ in range(3):  # prefill, then a couple of warm decode steps
        eng.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    st = pstats.Stats(prof)
    calls = sum(v[1] for v in st.stats.values())  # type: ignore[attr-defined]
    files = {k[0] for k in st.stats}  # type: ignore[attr-defined]
    py_files = {f for f in files if f.endswith(".py")}
    kvpage_files = {f for f in py_files if "/kvpage" in f}
    top = sorted(
        ((k, v) for k, v in st.stats.items() if k[0].endswith(".py")),  # type: ignore[attr-defined]
        key=lambda kv: -kv[1][1],
    )[: args.top]  # type: ignore[attr-defined]
    py_calls = sum(v[1] for k, v in st.stats.items() if k[0].endswith(".py"))  # type: ignore[attr-defined]
    kv_calls = sum(v[1] for k, v in st.stats.items() if "/kvpage" in k[0])  # type: ignore[attr-defined]
    report = {
        "num_seqs": args.num_seqs,
        "backend": eng.backend_name,
        "python_calls_per_step": py_calls / args.steps,
        "kvpage_calls_per_step": kv_calls / args.steps,
        "all_calls_per_step": calls / args.steps,
        "python_files": len(py_files),
        "kvpage_files": len(kvpage_files),
        "top": [
            {
                "calls_per_step": v[1] / args.steps,
                "function": f"{k[0].split('/src/')[-1]}:{k[1]}:{k[2]}",
            }
            for k, v in top
        ],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
