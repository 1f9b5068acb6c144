"""Where a decode step goes, by part of the model and of the engine (issue 28): the
exclusive thread CPU time (and wall time) of each part per ``LLMEngine.step``.

The engine (``LLM``, prefix caching off, ``--threads``) on ``benches/bench_peers.py``'s
``llama125m`` random-weight Llama (or ``--model``, e.g. ``stories260K``) decodes
``--batch`` sequences (5-token prompts, greedy, ``ignore_eos``); after 3 warm steps,
``--steps`` decode steps are timed with the parts' functions wrapped by timers (a stack:
a part's time excludes the parts called inside it, so the parts sum to the step):

* ``linears``: ``FusedLinear`` / ``PackedWeight`` calls (the lm_head apart: ``lm_head``);
* ``attention``: the backend's ``forward`` and ``write_kv``;
* ``norms``: ``RMSNorm.forward`` / ``add_forward`` (the fused residual add included);
* ``rope``: ``apply_rope_qkv`` or the backend's ``rope_qk``, and the cos/sin tables;
* ``act``: ``MLP.forward`` outside its linears (SiLU·mul); ``attn glue``:
  ``PagedAttention.forward`` outside its parts (views, reshapes);
* ``adds``: ``DecoderLayer.forward`` (or ``forward_deferred``) outside its parts (the
  residual adds left there);
* ``model other``: ``ModelRunnerModel.forward`` outside its layers (embedding lookup,
  the logits row gather and float32 cast);
* ``sampler``: ``Sampler.sample``; ``runner prep``: ``ModelRunner.execute`` outside the
  forward (input tensors, attention plans); ``schedule``, ``update``, ``outputs``: the
  scheduler's ``schedule`` / ``update`` and ``OutputProcessor.emit``; ``engine other``:
  the rest of ``LLMEngine.step``.

``bookkeeping share`` = (step - model forward) / step: everything outside
``ModelRunnerModel.forward`` except the sampler's argmax is bookkeeping (issue 28's
"batch-256 bookkeeping share", target < 10 %); reported with and without the sampler.
Each wrapper costs ~1 us per call (counted in the part that called it).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benches/profile_step_parts.py --dtype
bfloat16 --batch 64 [--steps 8] [--threads 1] [--model llama125m]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Parts:
    """Exclusive time per part: a stack of open parts; each timer stop charges the
    time since the last event to the part on top."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.stack: list[str] = []
        self.t = (0.0, 0.0)
        self.on = False

    def _charge(self) -> None:
        c, w = time.thread_time(), time.perf_counter()
        if self.stack:
            top = self.stack[-1]
            self.cpu[top] = self.cpu.get(top, 0.0) + c - self.t[0]
            self.wall[top] = self.wall.get(top, 0.0) + w - self.t[1]
        self.t = (c, w)

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kw: Any) -> Any:
            if not self.on:
                return fn(*args, **kw)
            self._charge()
            self.stack.append(name(*args) if callable(name) else name)
            try:
                return fn(*args, **kw)
            finally:
                self._charge()
                self.stack.pop()

        return inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="llama125m")
    a = ap.parse_args()
    import torch

    sys.path.insert(0, str(HERE))
    from roofline import _model_folder

    from kvpage.engine import LLM, SamplingParams
    from kvpage.engine.engine import LLMEngine
    from kvpage.engine.sampler import Sampler
    from kvpage.models import layers as LY
    from kvpage.models import linears as LN
    from kvpage.models import model as MD
    from kvpage.models import rope as RP

    llm = LLM(
        model=_model_folder(a.model),
        dtype=a.dtype,
        enable_prefix_caching=False,
        num_threads=a.threads,
        max_num_seqs=max(256, a.batch),
        max_num_batched_tokens=max(8192, 8 * a.batch),
    )
    torch.set_num_threads(a.threads)
    eng = llm.llm_engine
    vocab = int(eng.model.arch.vocab_size)
    P = Parts()

    def packed_name(_self: Any, _x: Any, w: torch.Tensor, *_a: Any) -> str:
        return "lm_head" if w.shape[0] == vocab else "linears"

    LN.PackedWeight.__call__ = P.wrap(packed_name, LN.PackedWeight.__call__)  # type: ignore[method-assign]
    LN.FusedLinear.__call__ = P.wrap("linears", LN.FusedLinear.__call__)  # type: ignore[method-assign]
    LY.RMSNorm.forward = P.wrap("norms", LY.RMSNorm.forward)  # type: ignore[method-assign]
    LY.RMSNorm.add_forward = P.wrap("norms", LY.RMSNorm.add_forward)  # type: ignore[method-assign]
    LY.apply_rope_qkv = P.wrap("rope", LY.apply_rope_qkv)
    RP.RotaryEmbedding.forward = P.wrap("rope", RP.RotaryEmbedding.forward)  # type: ignore[method-assign]
    LY.MLP.forward = P.wrap("act", LY.MLP.forward)  # type: ignore[method-assign]
    LY.PagedAttention.forward = P.wrap("attn glue", LY.PagedAttention.forward)  # type: ignore[method-assign]
    LY.DecoderLayer.forward = P.wrap("adds", LY.DecoderLayer.forward)  # type: ignore[method-assign]
    if hasattr(LY.DecoderLayer, "forward_deferred"):  # the adds left to the next norm
        LY.DecoderLayer.forward_deferred = P.wrap("adds", LY.DecoderLayer.forward_deferred)
    MD.ModelRunnerModel.forward = P.wrap("model other", MD.ModelRunnerModel.forward)  # type: ignore[method-assign]
    Sampler.sample = P.wrap("sampler", Sampler.sample)  # type: ignore[method-assign]
    be = eng.runner.backend if hasattr(eng.runner, "backend") else None
    if be is not None:
        be.forward = P.wrap("attention", be.forward)
        be.write_kv = P.wrap("attention", be.write_kv)
        get_ops = getattr(be, "layer_ops", None)
        ops = get_ops(eng.model.dtype, torch.device("cpu")) if get_ops is not None else None
        if ops is not None:
            ops.rope_qk = P.wrap("rope", ops.rope_qk)
            ops.silu_mul = P.wrap("act", ops.silu_mul)
    eng.runner.execute = P.wrap("runner prep", eng.runner.execute)
    eng.scheduler.schedule = P.wrap("schedule", eng.scheduler.schedule)
    eng.scheduler.update = P.wrap("update", eng.scheduler.update)
    eng.outputs.emit = P.wrap("outputs", eng.outputs.emit)
    LLMEngine.step = P.wrap("engine other", LLMEngine.step)  # type: ignore[method-assign]

    p = SamplingParams(temperature=0.0, max_tokens=a.steps + 8, ignore_eos=True)
    for i in range(a.batch):
        eng.add_request(f"s{i}", [1, 5 + i % 50, 6, 7, 8], p)
    for _ in range(3):
        eng.step()
    P.on = True
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    P.on = False
    n = a.steps
    model_parts = ("linears", "lm_head", "attention", "norms", "rope", "act", "attn glue", "adds", "model other")  # fmt: skip
    fwd = sum(P.cpu.get(k, 0.0) for k in model_parts)
    step = sum(P.cpu.values())
    row: dict[str, Any] = {
        "model": a.model,
        "dtype": a.dtype,
        "batch": a.batch,
        "threads": a.threads,
        "step_cpu_ms": round(1e3 * cpu / n, 2),
        "step_wall_ms": round(1e3 * wall / n, 2),
        "parts_cpu_ms": {
            k: round(1e3 * v / n, 3) for k, v in sorted(P.cpu.items(), key=lambda kv: -kv[1])
        },  # fmt: skip
        "parts_wall_ms": {
            k: round(1e3 * v / n, 3) for k, v in sorted(P.wall.items(), key=lambda kv: -kv[1])
        },  # fmt: skip
        "bookkeeping_share": round(1 - fwd / step, 4),
        "bookkeeping_share_no_sampler": round(1 - (fwd + P.cpu.get("sampler", 0.0)) / step, 4),
        "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
