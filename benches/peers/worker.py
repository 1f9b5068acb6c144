"""One engine of ``benches/bench_peers.py``, in its own process.

Runs under the interpreter of the engine's environment (the repo's ``.venv`` for
kvpage and transformers, the vLLM CPU build's own venv for vLLM), so it imports nothing
from kvpage at module level. Protocol: ``worker.py SPEC_JSON``; the worker loads the
engine, warms it up, prints ``@@READY``, then for every ``run`` line on stdin runs the
whole workload once and prints one ``@@RESULT {json}`` line; ``quit`` ends it. Other
stdout lines (engine logs) are ignored by the driver.

SPEC fields: ``engine`` (kvpage, vllm, hf_generate, hf_batch), ``model`` (a model
folder or ``stories260K``), ``dtype``, ``threads``, ``workload`` (a JSON file of
``[[prompt_ids, max_tokens], ...]``), ``max_model_len``, ``keep_ids`` (how many of the
first requests' output ids to return), ``vllm_multiprocess`` (bool),
``warmup_requests`` (warm-up on the first N requests; 0 = the whole workload).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")


def _tree_pids(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out.extend(_tree_pids(int(k)))
    return out


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its live descendants."""
    total = 0.0
    for pid in _tree_pids(os.getpid()):
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12])) / _TICK  # utime, stime
    return total


def tree_rss_mb() -> float:
    """Peak RSS of this process (ru_maxrss) plus the current RSS of its live children
    (vLLM's engine-core process in multiprocess mode), MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for pid in _tree_pids(os.getpid())[1:]:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak += int(line.split()[1]) / 1024
        except OSError:
            continue
    return peak


def _result(
    t0: float, c0: float, first: dict[str, float], ids: dict[str, list[int]], spec: dict[str, Any]
) -> dict[str, Any]:
    wall = time.perf_counter() - t0
    cpu = tree_cpu_s() - c0
    toks = sum(len(v) for v in ids.values())
    ttft = sorted(v - t0 for v in first.values())
    keep = int(spec.get("keep_ids", 8))
    return {
        "seconds": wall,
        "cpu_seconds": cpu,
        "output_tokens": toks,
        "tokens_per_s": toks / wall,
        "tokens_per_cpu_s": toks / cpu if cpu > 0 else None,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
        "peak_rss_mb": tree_rss_mb(),
        "first_ids": [ids[f"r{i}"] for i in range(min(keep, len(ids)))],
    }


# ---- kvpage ------------------------------------------------------------------------------
class KvpageRunner:
    def __init__(self, spec: dict[str, Any]) -> None:
        from kvpage.engine import LLMEngine, SamplingParams

        self.sp = SamplingParams
        self.engine = LLMEngine.from_config(
            model=spec["model"],
            dtype=spec["dtype"],
            num_threads=spec["threads"],
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=spec["max_model_len"],
            enable_prefix_caching=True,
            backend=spec.get("backend", "auto"),
            **({"block_size": spec["block_size"]} if spec.get("block_size") else {}),
        )

    def run(self, work: list[tuple[list[int], int]], spec: dict[str, Any]) -> dict[str, Any]:
        eng = self.engine
        first: dict[str, float] = {}
        ids: dict[str, list[int]] = {}
        t0, c0 = time.perf_counter(), tree_cpu_s()
        for i, (p, m) in enumerate(work):
            eng.add_request(f"r{i}", p, self.sp(max_tokens=m, ignore_eos=True, temperature=0.0))
        while eng.has_unfinished_requests():
            now = None
            for o in eng.step():
                if o.request_id not in first and o.outputs[0].token_ids:
                    now = now or time.perf_counter()
                    first[o.request_id] = now
                if o.finished:
                    ids[o.request_id] = list(o.outputs[0].token_ids)
        return _result(t0, c0, first, ids, spec)


# ---- vLLM --------------------------------------------------------------------------------
class VllmRunner:
    def __init__(self, spec: dict[str, Any]) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if not spec.get("vllm_multiprocess"):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams

        self.sp = SamplingParams
        self.llm = LLM(
            model=spec["model"],
            skip_tokenizer_init=True,
            dtype=spec["dtype"],
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=spec["max_model_len"],
            enable_prefix_caching=True,
            seed=0,
            **({"block_size": spec["block_size"]} if spec.get("block_size") else {}),
        )
        self.engine = self.llm.llm_engine

    def run(self, work: list[tuple[list[int], int]], spec: dict[str, Any]) -> dict[str, Any]:
        eng = self.engine
        first: dict[str, float] = {}
        ids: dict[str, list[int]] = {}
        t0, c0 = time.perf_counter(), tree_cpu_s()
        for i, (p, m) in enumerate(work):
            sp = self.sp(max_tokens=m, ignore_eos=True, temperature=0.0, detokenize=False)
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        while eng.has_unfinished_requests():
            now = None
            for o in eng.step():
                if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                    now = now or time.perf_counter()
                    first[o.request_id] = now
                if o.finished:
                    ids[o.request_id] = list(o.outputs[0].token_ids)
        return _result(t0, c0, first, ids, spec)


# ---- transformers ------------------------------------------------------------------------
def _hf_model(spec: dict[str, Any]) -> Any:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    dt = getattr(torch, spec["dtype"])
    if spec["model"] == "stories260K":
        from kvpage.models import load_model, to_transformers

        hf = to_transformers(load_model("stories260K"))
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], dtype=dt, attn_implementation="eager"
        )
    hf.generation_config.eos_token_id = None
    return hf.eval()


class HfGenerateRunner:
    """transformers ``generate``, one request at a time (TTFT via a streamer)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        self.hf = _hf_model(spec)
        self.torch = torch

    def run(self, work: list[tuple[list[int], int]], spec: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        first: dict[str, float] = {}
        ids: dict[str, list[int]] = {}

        class _Streamer:
            def __init__(self, rid: str) -> None:
                self.rid, self.calls = rid, 0

            def put(self, value: Any) -> None:
                self.calls += 1
                if self.calls == 2:  # the first put is the prompt
                    first[self.rid] = time.perf_counter()

            def end(self) -> None:
                return None

        t0, c0 = time.perf_counter(), tree_cpu_s()
        with torch.inference_mode():
            for i, (p, m) in enumerate(work):
                x = torch.tensor([p])
                y = self.hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=m,
                    min_new_tokens=m,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                    streamer=_Streamer(f"r{i}"),
                )
                ids[f"r{i}"] = y[0, len(p) :].tolist()
        return _result(t0, c0, first, ids, spec)


class HfBatchRunner:
    """transformers continuous batching (the manager behind ``generate_batch``); it
    returns whole results only, so no TTFT."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.hf = _hf_model(spec)
        # a cache sized for the workload (two 256-token pages per request), the same
        # 2048-token step budget as the others; by default it takes 90 % of free memory
        self.cb = ContinuousBatchingConfig(
            num_blocks=2 * spec["num_requests"] + 8, max_batch_tokens=2048
        )
        self.cfg = GenerationConfig(
            max_new_tokens=spec["max_new_tokens"],
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )

    def run(self, work: list[tuple[list[int], int]], spec: dict[str, Any]) -> dict[str, Any]:
        mgr = self.hf.init_continuous_batching(
            generation_config=self.cfg, continuous_batching_config=self.cb
        )
        mgr.start()
        ids: dict[str, list[int]] = {}
        try:
            mgr.add_request([1, 5, 6], request_id="warmup", max_new_tokens=2)
            assert mgr.get_result(request_id="warmup", timeout=600) is not None
            t0, c0 = time.perf_counter(), tree_cpu_s()
            for i, (p, m) in enumerate(work):
                mgr.add_request(p, request_id=f"r{i}", max_new_tokens=m)
            for _ in work:
                res = mgr.get_result(timeout=600)
                assert res is not None
                ids[res.request_id] = list(res.generated_tokens)
            out = _result(t0, c0, {}, ids, spec)
        finally:
            mgr.stop(block=True, timeout=30)
        return out


RUNNERS = {
    "kvpage": KvpageRunner,
    "kvpage-torch": KvpageRunner,  # the same with backend="torch" (bench_peers sets it)
    "vllm": VllmRunner,
    "hf_generate": HfGenerateRunner,
    "hf_batch": HfBatchRunner,
}


def main() -> None:
    spec = json.loads(sys.argv[1])
    work = [(list(p), int(m)) for p, m in json.loads(Path(spec["workload"]).read_text())]
    runner = RUNNERS[spec["engine"]](spec)
    # warm-up, off the clock: the whole workload by default, so every engine has met
    # every batch shape once (vLLM compiles them, oneDNN builds its kernels per shape)
    runner.run(work[: spec.get("warmup_requests") or len(work)], spec)
    print("@@READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        res = runner.run(work, spec)
        print("@@RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
