"""The head_dim-32 variant of stories260K that ``benches/bench_peers.py`` gives to
vLLM (zero-padded heads, rotary frequencies kept, q scaled) is the same function:
equal logits (to float rounding) and the same greedy tokens in kvpage."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kvpage.models import load_model, to_transformers

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_peers.py"


def _pad_head_dim():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_peers", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.pad_head_dim


def test_padded_head_dim_model_is_the_same_function(tmp_path: Path) -> None:
    import transformers

    hf = to_transformers(load_model("stories260K"))
    cfg = hf.config.to_dict()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    _pad_head_dim()(sd, cfg, 32)
    assert cfg["head_dim"] == 32
    cfg2 = transformers.LlamaConfig(
        **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    )
    cfg2._attn_implementation = "eager"
    hf32 = transformers.LlamaForCausalLM(cfg2).eval()
    hf32.load_state_dict(sd, strict=False)
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf32(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)
    hf32.save_pretrained(tmp_path)
    assert load_model(str(tmp_path)).arch.head_dim == 32
    from kvpage.engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[1, 403, 407, 261], [1, 9, 10]]
    out_a = LLM("stories260K", num_blocks=64).generate(prompts, sp)
    out_b = LLM(str(tmp_path), num_blocks=64).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out_a] == [o.outputs[0].token_ids for o in out_b]
