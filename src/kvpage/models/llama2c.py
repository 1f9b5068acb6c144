"""Reader of llama2.c "legacy" (version 0) checkpoints, converted to HF Llama layout.

File format (Karpathy, llama2.c ``export.py`` ``legacy_export`` / ``run.c``
``memory_map_weights``): 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads,
n_kv_heads, vocab_size, seq_len; a negative vocab_size means an untied classifier
follows at the end), then float32 arrays in this order, each weight kind for all
layers together: token embedding, attention RMSNorm, W_q, W_k, W_v, W_o, MLP RMSNorm,
W1 (gate), W2 (down), W3 (up), final RMSNorm, the legacy RoPE cos/sin tables
(2 x seq_len x head_dim/2, skipped), then the classifier if untied.

RoPE layout: llama2.c rotates adjacent pairs ``(2j, 2j+1)`` of each head, HF Llama
rotates halves ``(j, j + head_dim/2)``. Reordering each head's rows of W_q and W_k
as ``[0, 2, 4, ..., 1, 3, 5, ...]`` turns one into the other (the inverse of the
permutation in HF's ``convert_llama_weights_to_hf.py``); ``q . k`` is unchanged because
both sides get the same permutation.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpage.errors import SpecError
from kvpage.specs import llama2c_header_to_hf

#: name of the bundled model accepted by ``load_model``
BUNDLED_MODEL = "stories260K"


def bundled_model_path(name: str = BUNDLED_MODEL) -> Path:
    """Path of a model bundled in ``kvpage/models/data`` (works from a wheel)."""
    return Path(str(resources.files("kvpage.models") / "data" / f"{name}.bin"))


def halves_permutation(head_dim: int) -> torch.Tensor:
    """Row order taking a head from adjacent-pair RoPE layout to rotate-half layout:
    ``[0, 2, ..., head_dim-2, 1, 3, ..., head_dim-1]`` (int64 ``[head_dim]``)."""
    if head_dim % 2:
        raise SpecError(f"head_dim: expected an even number for RoPE, got {head_dim}")
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection ``[num_heads*head_dim, in]`` from
    llama2.c's adjacent-pair layout to HF's rotate-half layout (see module doc)."""
    head_dim = w.shape[0] // num_heads
    perm = halves_permutation(head_dim)
    return w.view(num_heads, head_dim, -1)[:, perm].reshape(w.shape)


def read_llama2c(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a llama2.c checkpoint as an HF Llama config and state dict.

    Args:
        path: the ``.bin`` file.

    Returns:
        ``(config, state_dict)``: config as from ``kvpage.specs.llama2c_header_to_hf``
        plus ``bos_token_id=1``, ``eos_token_id=2``, ``head_dim``; float32 tensors
        under HF ``LlamaForCausalLM`` names (q/k rows permuted to the rotate-half RoPE
        layout; ``lm_head.weight`` only when untied).

    Raises:
        SpecError: bad header or a file size that does not match the header.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"llama2.c checkpoint: expected a file, got {str(path)!r}")
    raw = path.read_bytes()
    cfg = llama2c_header_to_hf(raw)
    dim, hidden = cfg["hidden_size"], cfg["intermediate_size"]
    n_layers, n_heads, n_kv = (
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    vocab, seq_len = cfg["vocab_size"], cfg["max_position_embeddings"]
    if dim % n_heads:
        raise SpecError(f"llama2.c dim: expected a multiple of n_heads={n_heads}, got {dim}")
    head_dim = dim // n_heads
    kv_dim = n_kv * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("embed", (vocab, dim)),
        ("attn_norm", (n_layers, dim)),
        ("wq", (n_layers, dim, dim)),
        ("wk", (n_layers, kv_dim, dim)),
        ("wv", (n_layers, kv_dim, dim)),
        ("wo", (n_layers, dim, dim)),
        ("ffn_norm", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("final_norm", (dim,)),
        ("rope_tables", (2, seq_len, head_dim // 2)),
    ]
    if not cfg["tie_word_embeddings"]:
        shapes.append(("classifier", (vocab, dim)))
    total = sum(int(np.prod(s)) for _, s in shapes)
    expected = 28 + 4 * total
    if len(raw) != expected:
        raise SpecError(
            f"llama2.c checkpoint {path.name}: expected {expected} bytes for its header, "
            f"got {len(raw)}"
        )
    flat = torch.from_numpy(np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float32))
    arrays: dict[str, torch.Tensor] = {}
    off = 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        arrays[name] = flat[off : off + n].view(shape)
        off += n
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": arrays["embed"].clone()}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = arrays["attn_norm"][i].clone()
        sd[p + "self_attn.q_proj.weight"] = permute_rope_rows(arrays["wq"][i], n_heads).clone()
        sd[p + "self_attn.k_proj.weight"] = permute_rope_rows(arrays["wk"][i], n_kv).clone()
        sd[p + "self_attn.v_proj.weight"] = arrays["wv"][i].clone()
        sd[p + "self_attn.o_proj.weight"] = arrays["wo"][i].clone()
        sd[p + "post_attention_layernorm.weight"] = arrays["ffn_norm"][i].clone()
        sd[p + "mlp.gate_proj.weight"] = arrays["w1"][i].clone()
        sd[p + "mlp.down_proj.weight"] = arrays["w2"][i].clone()
        sd[p + "mlp.up_proj.weight"] = arrays["w3"][i].clone()
    sd["model.norm.weight"] = arrays["final_norm"].clone()
    if "classifier" in arrays:
        sd["lm_head.weight"] = arrays["classifier"].clone()
    cfg.update(head_dim=head_dim, bos_token_id=1, eos_token_id=2, hidden_act="silu")
    return cfg, sd


__all__ = [
    "BUNDLED_MODEL",
    "bundled_model_path",
    "halves_permutation",
    "permute_rope_rows",
    "read_llama2c",
]
