"""``ModelRunnerModel``: a decoder-only transformer that runs on the paged KV cache.

The model is kvpage's own PyTorch code (no HF modeling code at run time), built from
the family's row (``kvpage.specs.families``); its parameter names are Hugging Face
Llama-style ``*ForCausalLM`` state-dict keys (a family's other checkpoint names are
mapped by the loader: ``kvpage.models.loader``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from kvpage.attention.metadata import MODEL_DTYPES, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import AttentionBackend
from kvpage.attention.state import StateBatch, StateCache
from kvpage.errors import ShapeError, SpecError
from kvpage.models.config import ArchConfig, arch_from_hf
from kvpage.models.hybrid import HybridDecoderLayer
from kvpage.models.layers import DecoderLayer, PackedWeight, RMSNorm, make_norm
from kvpage.models.rope import RotaryEmbedding
from kvpage.models.tokenizer import ByteTokenizer, Tokenizer
from kvpage.specs import CacheSpec, KVCacheDType, ModelDType, ScaleGranularity
from kvpage.specs.core import KVPoolKind
from kvpage.specs.state import LayerMixer, layer_mixers


class _Backbone(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        spec: CacheSpec,
        cfg: dict[str, Any],
        mixers: tuple[tuple[LayerMixer, ...], ...] | None,
        attn_index: list[int],
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        if arch.family.learned_positions:  # GPT-2 wpe
            self.embed_positions = nn.Embedding(arch.max_position_embeddings, arch.hidden_size)
        layers: list[nn.Module]
        if mixers is None:
            layers = [DecoderLayer(arch, spec.layers[i], i) for i in range(arch.num_layers)]
        else:  # recurrent / hybrid: each layer's mixers (kvpage.models.hybrid)
            layers = [
                HybridDecoderLayer(
                    arch, cfg, i, m, spec.layers[attn_index[i]] if attn_index[i] >= 0 else None
                )
                for i, m in enumerate(mixers)
            ]
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm(arch, arch.hidden_size)


def rotary_embeddings(arch: ArchConfig) -> tuple[RotaryEmbedding | None, RotaryEmbedding | None]:
    """The RoPE tables of the full-attention layers and, when they differ (Gemma-3's
    ``rope_local_base_freq``), of the sliding layers; ``(None, None)`` with learned
    positions."""
    if arch.family.learned_positions or not arch.use_rope:  # GPT-2; mamba2, Nemotron-H
        return None, None
    n = min(arch.max_position_embeddings, 8192)
    full = RotaryEmbedding(arch.head_dim, arch.rope_theta, n, arch.rope_scaling, arch.rotary_dim)
    local = None
    if arch.rope_local is not None:
        theta, scaling = arch.rope_local
        local = RotaryEmbedding(arch.head_dim, theta, n, scaling, arch.rotary_dim)
    return full, local


class ModelRunnerModel(nn.Module):
    """A causal LM of one of the families of ``kvpage.specs.families`` (dense, MoE, and
    the recurrent / hybrid ones of ``kvpage.models.hybrid``) on the paged KV cache and,
    for recurrent layers, state slots (``kvpage.attention.state``).

    Args:
        config: HF ``config.json`` fields (``model_type`` in ``SUPPORTED_MODEL_TYPES``).
        tokenizer: the model's tokenizer; default a ``ByteTokenizer`` over the vocabulary.
        dtype: parameter/activation dtype name (float32, float16, bfloat16).

    Attributes:
        config: the HF-style config dict.
        arch: the normalised ``ArchConfig``.
        tokenizer: ``encode``/``decode``/``bos_id``/``eos_id``/``vocab_size``.
        layer_groups: index of each attention layer's KV group in
            ``cache_spec(...).kv_groups`` (the metadata ``forward`` uses for that
            layer), one per ``cache_spec().layers`` entry.
        mixers: ``layer_mixers(config)``: per decoder layer its mixers, None for an
            attention-only family.
        attn_index / state_index: per decoder layer its index in ``kv_caches`` /
            ``state_caches`` (``cache_spec().layers`` / ``.state_layers``), -1 if none.
        dtype_name: the model dtype's name.

    Parameters start uninitialised-to-defaults; loaders fill them with ``load_state_dict``.
    """

    def __init__(
        self,
        config: dict[str, Any],
        tokenizer: Tokenizer | None = None,
        dtype: ModelDType = "float32",
    ) -> None:
        super().__init__()
        if dtype not in MODEL_DTYPES:
            raise SpecError(f"dtype: expected one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
        self.config = dict(config)
        self.arch = arch_from_hf(self.config)
        self.dtype_name: ModelDType = dtype
        spec = self.cache_spec(block_size=16, num_blocks=0)
        self.layer_groups = [0] * spec.num_layers
        for g in spec.kv_groups:
            for lid in g.layer_ids:
                self.layer_groups[lid] = g.group_id
        self.num_kv_groups = len(spec.kv_groups)
        self.num_state_layers = len(spec.state_layers)
        self.state_specs = spec.state_layers
        self.mixers = layer_mixers(self.config)
        n = self.arch.num_layers
        self.attn_index = list(range(n))
        self.state_index = [-1] * n
        if self.mixers is not None:
            self.attn_index, self.state_index = [-1] * n, [-1] * n
            attn = rec = 0
            for lid, ms in enumerate(self.mixers):
                if "attention" in ms:
                    self.attn_index[lid], attn = attn, attn + 1
                if any(m != "attention" for m in ms):
                    self.state_index[lid], rec = rec, rec + 1
        self.model = _Backbone(self.arch, spec, self.config, self.mixers, self.attn_index)
        #: per attention layer: use ``rotary_local`` (a sliding layer with its own base)
        self.layer_local_rope = [
            self.arch.rope_local is not None and a.sliding_window is not None for a in spec.layers
        ]
        self.rotary: RotaryEmbedding | None
        self.rotary_local: RotaryEmbedding | None
        self.rotary, self.rotary_local = rotary_embeddings(self.arch)
        self.lm_head: nn.Linear | None = None
        if not self.arch.tie_word_embeddings:
            self.lm_head = nn.Linear(self.arch.hidden_size, self.arch.vocab_size, bias=False)
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer(
            self.arch.vocab_size,
            self.config.get("bos_token_id"),
            self.config.get("eos_token_id"),
        )
        self._lm = PackedWeight()
        #: every layer can leave its last residual add to the next norm
        #: (``DecoderLayer.forward_deferred``), the final norm included
        self._defer_residual = (
            self.mixers is None
            and all(isinstance(m, DecoderLayer) and m.defers_residual for m in self.model.layers)
            and isinstance(self.model.norm, RMSNorm)
            and not self.model.norm.gemma
        )
        self.requires_grad_(False)

    # ---- specs --------------------------------------------------------------------------
    def cache_spec(
        self,
        block_size: int = 16,
        num_blocks: int = 0,
        kv_dtype: KVCacheDType = "auto",
        kv_scale_granularity: ScaleGranularity = "per_tensor",
        kv_pool: KVPoolKind = "unified",
    ) -> CacheSpec:
        """``CacheSpec.from_hf_config(self.config, ...)`` with this model's dtype.

        Raises:
            SpecError: invalid sizes.
        """
        return CacheSpec.from_hf_config(
            self.config,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_dtype=kv_dtype,
            dtype=self.dtype_name,
            kv_scale_granularity=kv_scale_granularity,
            kv_pool=kv_pool,
        )

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def dense_macs_per_token(self) -> tuple[int, int]:
        """Multiply-adds per token of the largest linear of a decoder layer as it runs
        (q/k/v fused, gate/up fused, o, down; MLA: q_proj or q_b_proj,
        kv_a_proj_with_mqa, o_proj) and of the lm_head."""
        a = self.arch
        h, d = a.hidden_size, a.head_dim
        qkv = h * (a.num_q_heads + 2 * a.num_kv_heads) * d
        o = a.num_q_heads * d * h
        if a.mla is not None:  # kvpage.models.mla: the query projection(s), o_proj
            m, hq = a.mla, a.num_q_heads
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            qkv = max(h * hq * qk if m.q_lora_rank is None else m.q_lora_rank * hq * qk,
                      h * (m.kv_lora_rank + m.qk_rope_head_dim))  # fmt: skip
            o = hq * m.v_head_dim * h
        inter = a.intermediate_size if a.moe is None else a.moe.intermediate_size
        up = 1 if a.family.mlp == "plain" else 2  # plain MLP: no gate
        layer = max(qkv, o, up * h * inter)
        return layer, h * a.vocab_size

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under HF ``*ForCausalLM`` names (``lm_head.weight`` included even when
        tied), for building the equivalent ``transformers`` model."""
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary")}
        if self.lm_head is None:
            sd["lm_head.weight"] = self.model.embed_tokens.weight
        return sd

    # ---- forward ------------------------------------------------------------------------
    def _check_state(self, caches: list[StateCache], batch: StateBatch, n: int) -> None:
        """Refuse state caches or a StateBatch that do not fit this model and step
        (before anything is written: bad input leaves every slot unchanged)."""
        for i, (c, s) in enumerate(zip(caches, self.state_specs)):
            if tuple(c.conv.shape[1:]) != s.conv_state_shape or tuple(c.ssm.shape[1:]) != tuple(
                s.ssm_shape
            ):
                raise ShapeError(
                    f"state_caches[{i}]: expected conv [slots, {s.conv_state_shape}] and ssm "
                    f"[slots, {s.ssm_shape}] (layer {s.layer_id}), got {tuple(c.conv.shape)} "
                    f"and {tuple(c.ssm.shape)}"
                )
        slots = min(c.num_slots for c in caches)
        m = batch.num_seqs
        qsl = batch.query_start_loc.tolist()
        idx = batch.state_indices.tolist()
        if len(qsl) != m + 1 or qsl[0] != 0 or qsl[-1] != n or qsl != sorted(qsl):
            raise ShapeError(
                f"state_batch.query_start_loc: expected {m + 1} ascending offsets from 0 to "
                f"{n} tokens, got {qsl}"
            )
        if batch.has_initial_state.shape[0] != m or any(not 0 <= j < slots for j in idx):
            raise ShapeError(
                f"state_batch: expected {m} has_initial_state flags and slots in [0, {slots}), "
                f"got {batch.has_initial_state.shape[0]} flags and slots {idx}"
            )
        if len(set(idx)) != m:
            raise ShapeError(f"state_batch.state_indices: expected distinct slots, got {idx}")
        if batch.is_decode and n != m:
            raise ShapeError(f"state_batch.is_decode: expected one token per sequence, got {n}")

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        plans: list[StepPlan],
        backend: AttentionBackend[Any],
        logits_indices: torch.Tensor,
        *,
        state_caches: list[StateCache] | None = None,
        state_batch: StateBatch | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """One step over a packed batch of new tokens.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids, sequences packed as in the metadata.
            positions: ``[num_tokens]`` int64 absolute position of each token.
            kv_caches: one KVCache per attention layer (``cache_spec().layers``; every
                layer for an attention-only family); mutated: this step's K/V are
                written at the slot mapping of the layer's group.
            plans: one plan per KV group (``layer_groups``): ``backend.plan`` of the
                group's AttentionMetadata.
            backend: the attention backend (``write_kv`` then ``forward``).
            logits_indices: ``[num_seqs]`` int64 rows (of the ``num_tokens``) to compute
                logits for (usually each sequence's last new token).
            state_caches: one StateCache per recurrent mixer
                (``cache_spec().state_layers``, in layer order); required by a model
                with recurrent layers. Mutated: each sequence's slot
                (``state_batch.state_indices``) ends holding the state after its last
                new token (read as zeros where ``has_initial_state`` is False).
            state_batch: the step's state slots (the sequences in the packed order of
                the attention metadata).
            float_logits: return float32 logits; False = the lm_head's output in the
                model's dtype when nothing follows it (no logit multiplier, no final
                soft cap): a bfloat16 model's ``[num_seqs, vocab_size]`` logits are then
                not copied to float32, a cast that is exact and so adds no information
                (the engine's sampler casts the rows that need float32 math).

        Returns:
            ``[num_seqs, vocab_size]`` logits in float32 (the Gemma-2 final soft cap
            applied), or in the model's dtype (``float_logits=False``, see there).

        Raises:
            ShapeError: list lengths or token counts disagree; state_caches/state_batch
                missing for a model with recurrent layers.
        """
        n = input_ids.shape[0]
        if positions.shape[0] != n:
            raise ShapeError(f"positions: expected {n} entries, got {positions.shape[0]}")
        if len(kv_caches) != len(self.layer_groups):
            raise ShapeError(
                f"kv_caches: expected {len(self.layer_groups)} (one per attention layer), "
                f"got {len(kv_caches)}"
            )
        if self.num_state_layers:
            if state_caches is None or state_batch is None:
                raise ShapeError(
                    f"state_caches, state_batch: expected {self.num_state_layers} state "
                    "caches and a StateBatch (the model has recurrent layers), got None"
                )
            if len(state_caches) != self.num_state_layers:
                raise ShapeError(
                    f"state_caches: expected {self.num_state_layers}, got {len(state_caches)}"
                )
            self._check_state(state_caches, state_batch, n)
        if len(plans) != self.num_kv_groups:
            raise ShapeError(
                f"plans: expected {self.num_kv_groups} (one per KV group), got {len(plans)}"
            )
        x = self.model.embed_tokens(input_ids)
        if self.arch.embed_scale is not None:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        # positions < seq_len of their sequence: a host-side bound, no device sync
        top = 0
        for p in plans:
            top = max(top, p.meta.max_seq_len - 1)
        cos = sin = cos_l = sin_l = None
        if self.rotary is not None:
            cos, sin = self.rotary(positions, x.dtype, top, signed=True)
        if self.rotary_local is not None:
            cos_l, sin_l = self.rotary_local(positions, x.dtype, top, signed=True)
        if self.arch.family.learned_positions:
            if top >= self.arch.max_position_embeddings:
                raise ShapeError(
                    f"positions: expected < n_positions={self.arch.max_position_embeddings} "
                    f"(learned position table), got {top}"
                )
            x = x + self.model.embed_positions(positions)
        # optional on a backend: kvpage.attention.protocol.LayerOps
        get_ops = getattr(backend, "layer_ops", None)
        ops = get_ops(x.dtype, x.device) if get_ops is not None else None
        local = self.layer_local_rope
        defer = ops is not None and self._defer_residual
        if defer:
            # with the backend's fused add + norm: each layer's last residual add is
            # done by the next norm (the same sums, one op fewer per layer)
            pending: torch.Tensor | None = None
            for lid, layer in enumerate(self.model.layers):
                c, s_ = (cos_l, sin_l) if local[lid] else (cos, sin)
                g = plans[self.layer_groups[lid]]
                dl = cast(DecoderLayer, layer)  # _defer_residual: every layer is one
                x, pending = dl.forward_deferred(x, pending, c, s_, kv_caches[lid], g, backend, ops)
            if pending is None:
                x = self.model.norm(x[logits_indices], ops)
            else:
                x = self.model.norm.add_forward(pending[logits_indices], x[logits_indices], ops)[1]
        elif self.mixers is None:
            for lid, layer in enumerate(self.model.layers):
                c, s_ = (cos_l, sin_l) if local[lid] else (cos, sin)
                x = layer(x, c, s_, kv_caches[lid], plans[self.layer_groups[lid]], backend, ops)
        else:
            for lid, layer in enumerate(self.model.layers):
                ai, si = self.attn_index[lid], self.state_index[lid]
                kv = kv_caches[ai] if ai >= 0 else None
                plan = plans[self.layer_groups[ai]] if ai >= 0 else None
                c, s_ = (cos_l, sin_l) if ai >= 0 and local[ai] else (cos, sin)
                st = state_caches[si] if si >= 0 and state_caches is not None else None
                x = layer(x, c, s_, kv, plan, backend, ops, st, state_batch)
            x = x.to(self.dtype)  # Mamba-2's float32 residual stream
        if not defer:
            x = self.model.norm(x[logits_indices], ops)
        w = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        logits = self._lm(x, w, None)
        cap = self.arch.final_logit_softcap
        if not float_logits and self.arch.logit_multiplier is None and cap is None:
            return logits
        logits = logits.float()
        if self.arch.logit_multiplier is not None:  # Cohere logit_scale, Granite 1/scaling
            logits = logits * self.arch.logit_multiplier
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


__all__ = ["ModelRunnerModel"]
