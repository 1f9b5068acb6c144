"""Structured outputs (issue 27): the grammar library choice, the throughput cost of
constrained requests, and grammar compile time.

Three parts, one process:

* ``libs``: xgrammar vs llguidance (when installed) on the same realistic JSON schema
  (an order: nested object, array of objects, enum, bounded integers, string patterns):
  tokenizer setup, compile time (first and again) and the per-token mask time along
  random valid walks, for the bundled stories260K vocabulary (512 tokens) and a 32k
  byte-level BPE vocabulary trained here with ``tokenizers``.
* ``engine``: output tok/s of a batch of 64 requests on stories260K (CPU) where 0 %,
  50 % and 100 % of them are constrained by a realistic schema (a list of line items),
  the three modes in alternating rounds, ratio to the 0 % (all unconstrained) mode of the
  same round, per wall second and per CPU second of this process (the steadier one on a
  shared machine). Every request asks for ``--max-tokens`` tokens, unconstrained ones with
  ``ignore_eos``; constrained ones stop when the JSON ends, so tokens are counted, not
  assumed.
* ``compile``: ``GrammarCompilerPool.submit`` to done for a new schema (first) and the
  same schema again (cached), on the stories260K vocabulary and the 32k vocabulary.

Usage: ``.venv/bin/python benches/bench_structured.py [--rounds 5] [--max-tokens 64]
[--out out/bench_structured.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number", "minimum": 0, "maximum": 10000},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"], "maxLength": 80},
    },
    "required": ["id", "customer", "items", "status"],
}

#: the engine part's schema: a long list of line items, so constrained requests run on
LINES = {
    "type": "array",
    "maxItems": 200,
    "items": ORDER["properties"]["items"]["items"],  # type: ignore[index]
}


def hf_32k() -> Any:
    """A 32000-token byte-level BPE (``tokenizers``) trained on seeded pseudo-words,
    wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    syl = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list('0123456789{}[]":,.')
    corpus = [
        " ".join("".join(rng.choice(syl) for _ in range(rng.randint(1, 5))) for _ in range(200))
        for _ in range(4000)
    ]
    t = Tokenizer(models.BPE(unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=32000,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


def _allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    words = mask_row.numpy().view("uint32")
    return [i for i in range(vocab) if words[i // 32] >> (i % 32) & 1]


def _walk(fill: Any, accept: Any, done: Any, bm: torch.Tensor, vocab: int, eos: int) -> list[float]:
    """Mask times (s) along seeded random valid walks (5 walks, <= 300 tokens each)."""
    rng = random.Random(1)
    times: list[float] = []
    for _ in range(5):
        m = fill(None)
        for _ in range(300):
            t0 = time.perf_counter()
            fill(m)
            times.append(time.perf_counter() - t0)
            ok = _allowed(bm[0], vocab)
            if not ok:
                break
            tok = eos if eos in ok and rng.random() < 0.5 else rng.choice(ok)
            accept(m, tok)
            if done(m):
                break
    return times


def bench_xgrammar(tok: Any, vocab: int, eos: int) -> dict[str, float]:
    import xgrammar as xgr

    from kvpage.engine.structured import tokenizer_info

    t0 = time.perf_counter()
    info = tokenizer_info(tok, vocab, [eos])
    setup = time.perf_counter() - t0
    comp = xgr.GrammarCompiler(info, max_threads=1)
    s = json.dumps(ORDER)
    t0 = time.perf_counter()
    g = comp.compile_json_schema(s, any_whitespace=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = comp.compile_json_schema(s, any_whitespace=False)
    again = time.perf_counter() - t0
    bm = xgr.allocate_token_bitmask(1, vocab)

    def fill(m: Any) -> Any:
        if m is None:
            return xgr.GrammarMatcher(g)
        m.fill_next_token_bitmask(bm, 0)
        return m

    ts = _walk(fill, lambda m, t: m.accept_token(t), lambda m: m.is_terminated(), bm, vocab, eos)
    return _summary(setup, first, again, ts)


def bench_llguidance(tok: Any, vocab: int, eos: int) -> dict[str, float] | None:
    try:
        import llguidance as llg
        import llguidance.torch as llt
    except ImportError:
        return None
    t0 = time.perf_counter()
    hf = getattr(tok, "hf", None)
    if hf is not None:
        import llguidance.hf

        lt = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    else:
        pieces = tok.token_bytes()
        named = [p or f"<ctl{i}>".encode() for i, p in enumerate(pieces)]

        class _Wrap:  # llguidance needs a byte tokenizer to re-tokenize forced bytes
            eos_token_id = eos
            bos_token_id = tok.bos_id
            tokens = named
            special_token_ids = [i for i, p in enumerate(pieces) if not p]

            def __call__(self, s: bytes | str) -> list[int]:
                b = s if isinstance(s, bytes) else s.encode()
                return tok._merge([x + tok.byte_offset for x in b])

        lt = llg.LLTokenizer(llg.TokenizerWrapper(_Wrap()), n_vocab=vocab)
    setup = time.perf_counter() - t0
    gram = llg.LLMatcher.grammar_from_json_schema(ORDER, defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    llg.LLMatcher(lt, gram)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llg.LLMatcher(lt, gram)
    again = time.perf_counter() - t0
    bm = llt.allocate_token_bitmask(1, vocab)

    def fill(m: Any) -> Any:
        if m is None:
            return llg.LLMatcher(lt, gram)
        llt.fill_next_token_bitmask(m, bm, 0)
        return m

    ts = _walk(fill, lambda m, t: m.consume_token(t), lambda m: m.is_stopped(), bm, vocab, eos)
    return _summary(setup, first, again, ts)


def _summary(setup: float, first: float, again: float, ts: list[float]) -> dict[str, float]:
    ts = sorted(ts)
    return {
        "tokenizer_setup_ms": setup * 1e3,
        "compile_first_ms": first * 1e3,
        "compile_again_ms": again * 1e3,
        "mask_tokens": len(ts),
        "mask_median_us": statistics.median(ts) * 1e6,
        "mask_p99_us": ts[int(len(ts) * 0.99)] * 1e6,
    }


def run_engine(rounds: int, max_tokens: int, batch: int) -> dict[str, Any]:
    from kvpage.engine import LLM, SamplingParams

    llm = LLM("stories260K", max_num_seqs=batch, num_blocks=1024, block_size=16)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(f"Order {i}: the list of items is", bos=True) for i in range(batch)]
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    cons = SamplingParams(
        temperature=1.0, seed=0, max_tokens=max_tokens, structured_outputs={"json": LINES}
    )
    llm.generate(prompts[:2], [cons, plain], use_tqdm=False)  # compile + warm up
    modes = (0, 50, 100)
    res: dict[int, list[float]] = {m: [] for m in modes}
    toks: dict[int, list[int]] = {m: [] for m in modes}
    cpu: dict[int, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            k = batch * m // 100
            params = [cons] * k + [plain] * (batch - k)
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            res[m].append(n / dt)
            cpu[m].append(n / dc)
            toks[m].append(n)
    base, cbase = res[0], cpu[0]
    return {
        "batch": batch,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "tok_s_median": {m: statistics.median(v) for m, v in res.items()},
        "ratio_to_unconstrained_median": {
            m: statistics.median([a / b for a, b in zip(v, base)]) for m, v in res.items()
        },
        "tok_per_cpu_s_median": {m: statistics.median(v) for m, v in cpu.items()},
        "cpu_ratio_to_unconstrained_median": {
            m: statistics.median([a / b for a, b in zip(v, cbase)]) for m, v in cpu.items()
        },
        "output_tokens_median": {m: statistics.median(v) for m, v in toks.items()},
    }


def run_compile(tok: Any, vocab: int, eos: int) -> dict[str, float]:
    from kvpage.engine.structured import GrammarCompilerPool, StructuredOutputsParams

    pool = GrammarCompilerPool(tok, vocab, [eos])
    so = StructuredOutputsParams(json=ORDER)
    t0 = time.perf_counter()
    pool.submit(so).result()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool.submit(StructuredOutputsParams(json=dict(ORDER))).result()
    cached = time.perf_counter() - t0
    pool.shutdown()
    return {"first_ms": first * 1e3, "cached_ms": cached * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="out/bench_structured.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from importlib.metadata import version

    from kvpage.models.tokenizer import HFTokenizer
    from kvpage.models.tokenizer_llama2c import Llama2cTokenizer, bundled_tokenizer_path

    small = Llama2cTokenizer(bundled_tokenizer_path())
    big = HFTokenizer(hf_32k())
    big_eos = int(big.eos_id or 0)
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "xgrammar": version("xgrammar"),
    }
    try:
        out["llguidance"] = version("llguidance")
    except Exception:  # noqa: BLE001 - optional
        out["llguidance"] = None
    out["libs"] = {
        "xgrammar_512": bench_xgrammar(small, 512, 2),
        "llguidance_512": bench_llguidance(small, 512, 2),
        "xgrammar_32k": bench_xgrammar(big, big.vocab_size, big_eos),
        "llguidance_32k": bench_llguidance(big, big.vocab_size, big_eos),
    }
    out["compile"] = {
        "stories260K_512": run_compile(small, 512, 2),
        "bpe_32k": run_compile(big, big.vocab_size, big_eos),
    }
    out["engine"] = run_engine(a.rounds, a.max_tokens, a.batch)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
