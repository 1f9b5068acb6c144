"""One engine of ``benches/bench_peers.py``, in its own process.

Runs under the interpreter of the engine's environment (the repo's ``.venv`` for
kvpage and transformers, the vLLM CPU build's own venv for vLLM), so it imports nothing
from kvpage at module level. Protocol: ``worker.py SPEC_JSON``; the worker loads the
engine, warms it up, prints ``@@READY``, then for every ``run`` line on stdin runs the
whole workload once and prints one ``@@RESULT {json}`` line; ``quit`` ends it. Other
stdout lines (engine logs) are ignored by the driver.

SPEC fields: ``engine`` (kvpage, vllm, hf_generate, hf_batch, llamacpp), ``model`` (a
model folder, ``stories260K``, or for llamacpp a GGUF file), ``dtype``, ``threads``,
``workload`` (a JSON file of ``[[prompt_ids, max_tokens], ...]``), ``max_model_len``,
``keep_ids`` (how many of the first requests' output ids to return),
``vllm_multiprocess`` (bool), ``warmup_requests`` (warm-up on the first N requests; 0 =
the whole workload), ``prefix_caching`` (kvpage / vLLM, default true), ``concurrency``
(kvpage / llamacpp: requests in flight at most, 0 = all), and for llamacpp ``server``
(the ``llama-server`` binary), ``server_log``, ``parallel`` (slots).
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


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds (user + system) of process ``root`` (default: this one) and its
    live descendants."""
    total = 0.0
    for pid in _tree_pids(root or os.getpid()):
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12])) / _TICK  # utime, stime
    return total


def _vm_hwm_mb(pid: int) -> float:
    """Peak RSS (``VmHWM`` of ``/proc/PID/status``) of a live process, MiB (0 if gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def tree_rss_mb(root: int | None = None) -> float:
    """Peak RSS, MiB: of this process (ru_maxrss) plus the peak of its live children
    (vLLM's engine-core process in multiprocess mode); with ``root``, the peaks of
    that process and its live descendants (llama-server)."""
    if root is not None:
        return sum(_vm_hwm_mb(p) for p in _tree_pids(root))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak + sum(_vm_hwm_mb(p) for p in _tree_pids(os.getpid())[1:])


def _result(
    t0: float,
    c0: float,
    first: dict[str, float],
    ids: dict[str, list[int]],
    spec: dict[str, Any],
    root: int | None = None,
    submitted: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One run's measurements. ``root``: the process whose tree is measured (default
    this one; ``c0`` is its ``tree_cpu_s`` at ``t0``); ``submitted``: each request's
    submission time when not all were submitted at ``t0`` (``--concurrency``), TTFT
    being first token minus submission."""
    wall = time.perf_counter() - t0
    cpu = tree_cpu_s(root) - c0
    toks = sum(len(v) for v in ids.values())
    sub = submitted or {}
    ttft = sorted(v - sub.get(k, t0) for k, v in first.items())
    keep = int(spec.get("keep_ids", 8))
    return {
        "seconds": wall,
        "cpu_seconds": cpu,
        "output_tokens": toks,
        "tokens_per_s": toks / wall,
        "tokens_per_cpu_s": toks / cpu if cpu > 0 else None,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
        "peak_rss_mb": tree_rss_mb(root),
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
            enable_prefix_caching=spec.get("prefix_caching", True),
            backend=spec.get("backend", "auto"),
            **({"block_size": spec["block_size"]} if spec.get("block_size") else {}),
        )

    def run(self, work: list[tuple[list[int], int]], spec: dict[str, Any]) -> dict[str, Any]:
        eng = self.engine
        first: dict[str, float] = {}
        ids: dict[str, list[int]] = {}
        submitted: dict[str, float] = {}
        limit = int(spec.get("concurrency") or len(work))  # requests in flight at most
        todo = list(enumerate(work))[::-1]
        t0, c0 = time.perf_counter(), tree_cpu_s()

        def submit() -> None:
            while todo and len(submitted) - len(ids) < limit:
                i, (p, m) = todo.pop()
                submitted[f"r{i}"] = time.perf_counter()
                sp = self.sp(max_tokens=m, ignore_eos=True, temperature=0.0)
                eng.add_request(f"r{i}", p, sp)

        submit()
        while eng.has_unfinished_requests():
            now = None
            for o in eng.step():
                if o.request_id not in first and o.outputs[0].token_ids:
                    now = now or time.perf_counter()
                    first[o.request_id] = now
                if o.finished:
                    ids[o.request_id] = list(o.outputs[0].token_ids)
            submit()
        return _result(t0, c0, first, ids, spec, submitted=submitted)


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
            enable_prefix_caching=spec.get("prefix_caching", True),
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


# ---- llama.cpp ---------------------------------------------------------------------------
def completion_payload(prompt: list[int], n_predict: int) -> dict[str, Any]:
    """Body of one ``POST /completion`` to llama-server (its native endpoint): the
    prompt as token ids, exactly ``n_predict`` greedy tokens (temperature 0, top-k 1;
    EOS ignored: the server then bans the end-of-generation ids, where kvpage would
    sample one and go on), no reuse of a slot's previous prompt (``cache_prompt``
    false), output ids returned (``return_tokens``), one JSON response (no stream)."""
    return {
        "prompt": list(prompt),
        "n_predict": int(n_predict),
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
        "seed": 0,
    }


def llama_server_argv(spec: dict[str, Any], port: int) -> list[str]:
    """``llama-server`` command line for ``spec``: ``parallel`` slots (default: every
    request at once) of 512 tokens each (``--ctx-size parallel x max_model_len``),
    ``threads`` for decode and batch, continuous batching, KV cache in the model's
    dtype (f32 / bf16: llama.cpp's default is f16), warm-up left on."""
    par = int(spec.get("parallel") or spec["num_requests"])
    kv = "bf16" if spec["dtype"] == "bfloat16" else "f32"
    th = str(spec["threads"])
    return [
        spec["server"],
        "--model", spec["model"],
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(par),
        "--ctx-size", str(par * int(spec["max_model_len"])),
        "--threads", th,
        "--threads-batch", th,
        "--cont-batching",
        "--batch-size", "2048",
        "--cache-type-k", kv,
        "--cache-type-v", kv,
    ]  # fmt: skip


def _die_with_parent() -> None:
    """In the forked child before exec: ask Linux to SIGTERM it when this worker dies
    (``prctl(PR_SET_PDEATHSIG)``), so a killed worker leaves no llama-server behind."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


class LlamaCppRunner:
    """llama.cpp's ``llama-server`` as a child process, fed over HTTP (``/completion``).

    Measured as the other engines, but on the server's process tree: CPU seconds and
    peak RSS (``VmHWM``) of ``llama-server`` (the HTTP client's own CPU in this worker
    is reported apart as ``client_cpu_seconds``). TTFT = response time minus the
    server's ``timings.predicted_ms`` (time from the first sampled token to the last),
    measured from the request's submission; requests in flight at most:
    ``concurrency`` (default all)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import socket
        import subprocess

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(spec.get("server_log") or os.devnull, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            llama_server_argv(spec, port),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        n = int(spec.get("concurrency") or spec["num_requests"])
        self.client = httpx.Client(
            base_url=self.url, timeout=None, limits=httpx.Limits(max_connections=n + 4)
        )
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}), see its log")
            try:
                if self.client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server not healthy after 600 s")
            time.sleep(0.2)

    def _one(self, rid: str, p: list[int], m: int, out: dict[str, Any]) -> None:
        sub = time.perf_counter()
        r = self.client.post("/completion", json=completion_payload(p, m))
        done = time.perf_counter()
        r.raise_for_status()
        body = r.json()
        out[rid] = (sub, done - body["timings"]["predicted_ms"] / 1e3, list(body["tokens"]))

    def run(self, work: list[tuple[list[int], int]], spec: dict[str, Any]) -> dict[str, Any]:
        from concurrent.futures import ThreadPoolExecutor

        res: dict[str, Any] = {}
        n = int(spec.get("concurrency") or len(work))
        t0, c0, cc0 = time.perf_counter(), tree_cpu_s(self.proc.pid), tree_cpu_s()
        with ThreadPoolExecutor(max_workers=n) as ex:
            futs = [ex.submit(self._one, f"r{i}", p, m, res) for i, (p, m) in enumerate(work)]
            for f in futs:
                f.result()
        sub = {k: v[0] for k, v in res.items()}
        first = {k: v[1] for k, v in res.items()}
        ids = {k: v[2] for k, v in res.items()}
        out = _result(t0, c0, first, ids, spec, root=self.proc.pid, submitted=sub)
        # this worker's tree holds the server: the client is the rest
        out["client_cpu_seconds"] = tree_cpu_s() - cc0 - out["cpu_seconds"]
        return out

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:  # noqa: BLE001  (subprocess.TimeoutExpired: it would not stop)
            self.proc.kill()
        self.log.close()


RUNNERS = {
    "kvpage": KvpageRunner,
    "kvpage-torch": KvpageRunner,  # the same with backend="torch" (bench_peers sets it)
    "vllm": VllmRunner,
    "hf_generate": HfGenerateRunner,
    "hf_batch": HfBatchRunner,
    "llamacpp": LlamaCppRunner,
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
    close = getattr(runner, "close", None)
    if close is not None:
        close()


if __name__ == "__main__":
    main()
