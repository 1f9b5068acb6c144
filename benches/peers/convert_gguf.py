"""Write one of ``benches/bench_peers.py``'s Hugging Face Llama folders as a GGUF file
for llama.cpp's ``llama-server`` (the ``llamacpp`` engine).

Uses the ``gguf`` Python package that the llama-cpp-python sdist vendors at
``vendor/llama.cpp/gguf-py`` (``benches/peers/build_llama_cpp.sh`` extracts it): an
installed ``gguf`` is used if importable, else ``$KVPAGE_GGUF_PY``, else
``~/.cache/kvpage-peers/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py``.

What is written (architecture ``llama``):

* every tensor of the safetensors file under its GGUF name (``gguf.TensorNameMap``), in
  the folder's dtype: float32 as F32; bfloat16 as BF16 for 2-D weights and F32 for the
  1-D RMSNorm weights (exact: every bfloat16 value is a float32 value);
* ``q_proj`` / ``k_proj`` rows reordered per head from Hugging Face's rotate-half layout
  (dimension ``j`` pairs with ``j + d/2``) to GGML's adjacent-pair layout (``2j`` with
  ``2j + 1``) that llama.cpp's ``llama`` rope expects — the same function, so greedy
  decoding gives the same ids up to float rounding;
* hyper-parameters from ``config.json`` (hidden, layers, heads, KV heads, head_dim,
  intermediate, RMSNorm eps, rope theta, max positions);
* a placeholder SentencePiece-type vocabulary of ``vocab_size`` tokens: ids 0/1/2 are
  ``<unk>``/``<s>``/``</s>`` (the models' BOS = 1, EOS = 2), every other id the ASCII
  piece ``t<id>`` (no byte tokens: the server holds back text that is not yet valid
  UTF-8); BOS is not added (the benchmark's prompts are token ids that start with it).
  The benchmark sends and reads token ids only, so the pieces never matter.

Usage: ``.venv/bin/python benches/peers/convert_gguf.py MODEL_FOLDER OUT.gguf``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_GGUF_PY = (
    Path.home() / ".cache/kvpage-peers/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"
)


def import_gguf() -> Any:
    """The ``gguf`` module (see the module docstring for where it is looked for);
    ``ImportError`` naming the paths tried when it is nowhere."""
    try:
        import gguf

        return gguf
    except ImportError:
        pass
    path = Path(os.environ.get("KVPAGE_GGUF_PY") or DEFAULT_GGUF_PY)
    if (path / "gguf" / "__init__.py").exists():
        sys.path.insert(0, str(path))
        import gguf

        return gguf
    raise ImportError(
        f"gguf-py not found: not installed, not at $KVPAGE_GGUF_PY, not at {DEFAULT_GGUF_PY} "
        "(run benches/peers/build_llama_cpp.sh first)"
    )


def rope_pairs_order(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns a ``[n_heads * head_dim, in]`` projection from rotate-half
    to adjacent-pair rope layout: within each head, output row ``2 j`` is input row
    ``j`` and ``2 j + 1`` is ``j + head_dim / 2``."""
    half = head_dim // 2
    within = np.empty(head_dim, dtype=np.int64)
    within[0::2] = np.arange(half)
    within[1::2] = np.arange(half) + half
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def _tensors(folder: Path) -> dict[str, Any]:
    """Every tensor of the folder's safetensors file(s), as torch tensors."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return out


def convert(folder: str | Path, out: str | Path) -> Path:
    """Write ``folder`` (a Hugging Face ``LlamaForCausalLM`` folder, float32 or
    bfloat16) as GGUF at ``out`` and return ``out``."""
    import torch

    gguf = import_gguf()
    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{folder}: model_type {cfg.get('model_type')!r}, only 'llama' is handled")
    hid, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads") or hq
    hd = cfg.get("head_dim") or hid // hq
    vocab = cfg["vocab_size"]
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    sd = _tensors(folder)
    bf16 = any(t.dtype == torch.bfloat16 for t in sd.values())
    q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(folder.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(hid)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(hq)
    w.add_head_count_kv(hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    tt = gguf.TokenType
    w.add_token_types([tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.NORMAL] * (vocab - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, layers)
    order = {"q_proj": rope_pairs_order(hq, hd), "k_proj": rope_pairs_order(hkv, hd)}
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in sd:
        del sd["lm_head.weight"]  # llama.cpp reuses token_embd when output is absent
    for key, t in sd.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"{folder}: no GGUF name for tensor {key!r}")
        proj = key.split(".")[-2]
        if proj in order:
            t = t[torch.from_numpy(order[proj])]
        if t.dtype == torch.bfloat16 and t.dim() >= 2:
            w.add_tensor(name, t.contiguous().view(torch.int16).numpy().view(np.uint16),
                         raw_dtype=q.BF16)  # fmt: skip
        else:
            w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.rsplit("Usage: ", 1)[1].strip())
    print(convert(sys.argv[1], sys.argv[2]))
