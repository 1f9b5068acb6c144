"""The spec types: attention shape per layer and the paged KV-cache layout.

Specs are frozen pydantic v2 models, JSON-serialisable, and hold no tensors. They are
the input of backend selection, of the cache manager and of capacity planning.

Sources of the conventions used here:

* default softmax scale ``head_dim ** -0.5``: "Attention Is All You Need" (Vaswani
  et al., 2017), eq. 1; Gemma-2 replaces it with ``query_pre_attn_scalar ** -0.5``
  (HF ``Gemma2Attention``).
* sliding window ``W``: a query at position ``i`` sees keys ``max(0, i-W+1) .. i`` — W
  keys including itself — the convention of current HF transformers.
* attention sinks (gpt-oss): a per-query-head logit added to the softmax denominator
  only (HF ``GptOssAttention``, transformers/models/gpt_oss/modeling_gpt_oss.py).
* GQA head mapping: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``
  (consecutive groups, HF ``repeat_kv``).
* int8 KV: one float32 scale per token per KV head, for K and for V separately.
  fp8 KV: one float32 scale per tensor or per KV head per layer (not per token).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpage.errors import SpecError, got_repr
from kvpage.specs.hf import (
    attention_layers_from_hf,
    dtype_from_config,
    hf_config_dict,
    llama2c_header_to_hf,
)
from kvpage.specs.state import StateSpec, state_layers_from_hf

KVCacheDType = Literal["auto", "int8", "fp8_e4m3", "fp8_e5m2"]
ModelDType = Literal["float32", "float16", "bfloat16"]
ScaleGranularity = Literal["per_tensor", "per_head"]
KVPoolKind = Literal["unified", "per_group"]

#: bytes per element of each model dtype
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
#: bytes per element of each quantized KV dtype
KV_DTYPE_BYTES: dict[str, int] = {"int8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
#: bytes of one stored scale (float32)
SCALE_BYTES = 4


class AttentionSpec(BaseModel):
    """Attention shape and semantics of one layer.

    Attributes:
        num_q_heads: query heads (>= 1).
        num_kv_heads: key/value heads (>= 1, divides ``num_q_heads``; 1 = MQA).
        head_dim: elements per head (>= 1).
        scale: softmax scale applied to ``q . k``; default ``head_dim ** -0.5``.
        sliding_window: W in tokens (a query sees W keys including itself), None = full.
        logits_soft_cap: c in ``c * tanh(logits / c)`` before softmax (Gemma-2), None = off.
        sinks: the layer has attention sinks: one learned logit ``s_h`` per query head
            that joins the softmax denominator and attends to nothing (gpt-oss; HF
            ``GptOssAttention.sinks``, ``eager_attention_forward`` in
            transformers/models/gpt_oss/modeling_gpt_oss.py):
            ``p_j = exp(l_j) / (exp(s_h) + sum_i exp(l_i))``. The values are weights,
            not part of the spec: ``forward(..., sinks=)`` takes them
            (``[num_q_heads]`` float32). The cache layout is unchanged.
        kv_lora_rank: set = an MLA layer (multi-head latent attention, DeepSeek-V2/V3,
            Kimi-K2; DeepSeek-V2 paper arXiv:2405.04434 section 2.1, HF
            ``DeepseekV3Attention`` in transformers/models/deepseek_v3/
            modeling_deepseek_v3.py): per token one latent vector of ``head_dim =
            kv_lora_rank + qk_rope_head_dim`` elements, shared by every query head
            (``num_kv_heads`` is 1), is cached instead of K and V. Attention runs in
            the absorbed form: logits ``scale * q_absorbed . latent`` over all
            ``head_dim`` elements, output ``softmax . latent[:, :kv_lora_rank]``
            (``[num_q_heads, kv_lora_rank]`` per token). None = ordinary K/V attention.
        qk_rope_head_dim: MLA only: the decoupled RoPE key's elements at the end of the
            latent (0 otherwise).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_q_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    scale: float = Field(default=0.0)
    sliding_window: int | None = Field(default=None, ge=1)
    logits_soft_cap: float | None = Field(default=None, gt=0.0)
    sinks: bool = False
    kv_lora_rank: int | None = Field(default=None, ge=1)
    qk_rope_head_dim: int = Field(default=0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_scale(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("scale") in (None, 0, 0.0):
            d = dict(data)
            hd = d.get("head_dim")
            if isinstance(hd, int) and hd >= 1:
                d["scale"] = float(hd) ** -0.5
            return d
        return data

    @model_validator(mode="after")
    def _check(self) -> AttentionSpec:
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_q_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, "
                f"got {self.num_q_heads}"
            )
        if not (self.scale > 0.0):
            raise ValueError(f"scale: expected > 0, got {self.scale}")
        if self.kv_lora_rank is None:
            if self.qk_rope_head_dim:
                raise ValueError(
                    "qk_rope_head_dim: expected 0 without kv_lora_rank (MLA only), got "
                    f"{self.qk_rope_head_dim}"
                )
            return self
        if self.num_kv_heads != 1:
            raise ValueError(
                f"num_kv_heads: expected 1 for an MLA layer (one latent per token), got "
                f"{self.num_kv_heads}"
            )
        want = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_dim != want:
            raise ValueError(
                f"head_dim: expected kv_lora_rank + qk_rope_head_dim = {want} for an MLA "
                f"layer, got {self.head_dim}"
            )
        if self.sinks:
            raise ValueError("sinks: expected no attention sinks on an MLA layer, got sinks")
        if self.sliding_window is not None:  # no MLA model slides; not implemented
            raise ValueError(
                f"sliding_window: expected None on an MLA layer (not implemented), got "
                f"{self.sliding_window}"
            )
        return self

    @property
    def is_mla(self) -> bool:
        """An MLA layer (``kv_lora_rank`` set): the cache holds one latent per token."""
        return self.kv_lora_rank is not None

    @property
    def value_dim(self) -> int:
        """Elements per head of ``forward``'s output: ``kv_lora_rank`` for MLA (the
        values are the latent's first ``kv_lora_rank`` elements), else ``head_dim``."""
        return self.kv_lora_rank if self.kv_lora_rank is not None else self.head_dim

    @property
    def kv_planes(self) -> int:
        """Cached vectors per token and KV head: 1 for MLA (the latent), else 2 (K, V)."""
        return 1 if self.kv_lora_rank is not None else 2

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads per KV head (1 = MHA, num_q_heads = MQA; vLLM's name)."""
        return self.num_q_heads // self.num_kv_heads


class KVGroup(BaseModel):
    """Layers that share one block table (same sliding window).

    Attributes:
        group_id: index into ``CacheSpec.kv_groups``.
        layer_ids: the model layers in this group, ascending. In a unified pool the
            ``k``-th layer of every group shares the pool's page tensor ``k``
            (``CacheSpec.layer_slot``).
        sliding_window: the group's window in tokens, None = full attention.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_id: int
    layer_ids: tuple[int, ...]
    sliding_window: int | None


class CacheSpec(BaseModel):
    """Layout of a paged KV cache for one model.

    Attributes:
        num_layers: attention layers.
        block_size: tokens per block (>= 1).
        num_blocks: blocks including the reserved null block; 0 = not yet sized
            (capacity planning decides). ``kv_pool="unified"``: blocks of the one pool
            that every KV group allocates from; ``"per_group"``: blocks of each group's
            own pool.
        kv_pool: ``unified`` (default): one block pool for all KV groups, each group
            of ``pool_group_layers`` layers (window groups split into equal chunks,
            docs/architecture.md "One pool for every kind of layer"), so a block costs
            the same bytes in every group and memory flows to the group that needs it;
            ``per_group``: one pool of ``num_blocks`` per window group, every layer
            sized for ``num_blocks`` (the earlier design, kept for comparison).
        dtype: model (activation) dtype.
        kv_dtype: storage dtype of K/V; ``auto`` = the model dtype.
        kv_scale_granularity: for fp8, one scale per tensor or per KV head.
        layers: one AttentionSpec per attention layer (decoder order; a hybrid model's
            recurrent-only layers have none).
        state_layers: one StateSpec per recurrent mixer (Mamba-2, Gated DeltaNet;
            ``kvpage.specs.state``), decoder order; empty for a pure-attention model.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(ge=0)
    block_size: int = Field(default=16, ge=1)
    num_blocks: int = Field(default=0, ge=0)
    dtype: ModelDType = "float32"
    kv_dtype: KVCacheDType = "auto"
    kv_scale_granularity: ScaleGranularity = "per_tensor"
    kv_pool: KVPoolKind = "unified"
    layers: tuple[AttentionSpec, ...]
    state_layers: tuple[StateSpec, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> CacheSpec:
        if len(self.layers) != self.num_layers:
            raise ValueError(
                f"layers: expected num_layers={self.num_layers} specs, got {len(self.layers)}"
            )
        if self.num_layers == 0 and not self.state_layers:
            raise ValueError("num_layers: expected >= 1 attention or state layer, got 0")
        if self.kv_pool == "unified" and len(self.window_groups) > 1:
            per_token = {self.layer_bytes_per_token(i) for i in range(self.num_layers)}
            if len(per_token) > 1:
                raise ValueError(
                    "kv_pool: expected 'per_group' for a hybrid model whose layers differ "
                    "in KV bytes per token (a unified pool shares one page tensor between "
                    f"layers of different groups), got 'unified' with {sorted(per_token)}"
                )
        return self

    # ---- derived -------------------------------------------------------------------
    @property
    def window_groups(self) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
        """``(sliding_window, layer_ids)`` per distinct window: full attention first,
        then windows ascending (the ``per_group`` KV groups)."""
        by_window: dict[int | None, list[int]] = {}
        for i, layer in enumerate(self.layers):
            by_window.setdefault(layer.sliding_window, []).append(i)
        keys = sorted(by_window, key=lambda w: (w is not None, w or 0))
        return tuple((w, tuple(by_window[w])) for w in keys)

    @property
    def pool_group_layers(self) -> int:
        """Layers per KV group: ``unified``: the gcd of the window groups' layer counts
        (every group then has that many layers, so a block's page is the same size in
        every group and no layer slot is padding); ``per_group``: the largest window
        group's layer count (its layers' tensors are the ones sized per block)."""
        counts = [len(ids) for _, ids in self.window_groups]
        if not counts:  # a recurrent-only model (mamba2): no KV groups
            return 0
        if self.kv_pool == "unified":
            return math.gcd(*counts)
        return max(counts)

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV groups (one block table each): layers grouped by sliding window, full
        attention first, then sliding windows ascending. ``unified``: each window's
        layers split, in layer order, into groups of :attr:`pool_group_layers`
        (Gemma-3-27B: 10 full + 52 sliding layers -> 5 + 26 groups of 2). A model
        without sliding layers has one group."""
        out: list[KVGroup] = []
        u = self.pool_group_layers if self.kv_pool == "unified" else 0
        for w, ids in self.window_groups:
            chunks = [ids[i : i + u] for i in range(0, len(ids), u)] if u else [ids]
            for c in chunks:
                out.append(KVGroup(group_id=len(out), layer_ids=c, sliding_window=w))
        return tuple(out)

    def layer_slot(self, layer_id: int) -> int:
        """Unified pool: the page tensor layer ``layer_id`` stores into, its index in its
        KV group (layers of different groups at the same index share one tensor, each
        block id belonging to one group at a time). ``per_group``: the layer id (every
        layer has its own tensor)."""
        if self.kv_pool != "unified":
            return layer_id
        for g in self.kv_groups:
            if layer_id in g.layer_ids:
                return g.layer_ids.index(layer_id)
        raise IndexError(f"layer_id: expected < {self.num_layers}, got {layer_id}")

    @property
    def kv_element_bytes(self) -> int:
        """Bytes of one stored K or V element."""
        if self.kv_dtype == "auto":
            return DTYPE_BYTES[self.dtype]
        return KV_DTYPE_BYTES[self.kv_dtype]

    def layer_bytes_per_token(self, layer_id: int) -> int:
        """Bytes one token occupies in one layer: K and V, plus int8 per-token scales;
        an MLA layer (``AttentionSpec.kv_lora_rank``) one latent of ``head_dim``
        elements (+ one int8 scale). DeepSeek-V3 in bf16: 576 x 2 = 1,152."""
        a = self.layers[layer_id]
        planes = a.kv_planes
        b = planes * a.num_kv_heads * a.head_dim * self.kv_element_bytes
        if self.kv_dtype == "int8":
            b += planes * a.num_kv_heads * SCALE_BYTES
        return b

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (K, V and per-token scales)."""
        return sum(self.layer_bytes_per_token(i) for i in range(self.num_layers))

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block of the pool costs. ``per_group`` (and any one-group model):
        ``block_size * bytes_per_token`` (all layers: each layer's tensor holds every
        block id). ``unified`` with several groups: ``block_size`` x the bytes per token
        of one group's :attr:`pool_group_layers` layers (a block holds one group's
        layers only; layers of equal bytes per token, checked)."""
        if self.kv_pool != "unified" or not self.kv_groups:
            return self.block_size * self.bytes_per_token
        ids = self.kv_groups[0].layer_ids
        return self.block_size * sum(self.layer_bytes_per_token(i) for i in ids)

    @property
    def pool_tensor_layers(self) -> tuple[int, ...]:
        """Layers whose cache tensors are allocated: ``per_group`` every layer;
        ``unified`` the layers of group 0 (their tensors, one per layer slot, are the
        storage every group's layers share)."""
        if self.kv_pool != "unified" or not self.kv_groups:
            return tuple(range(self.num_layers))
        return self.kv_groups[0].layer_ids

    def sequence_blocks(self, num_tokens: Any) -> Any:
        """Blocks one sequence of ``num_tokens`` tokens holds in the pool while the
        step computing its last token runs (an int, or an int64 numpy array of lengths):
        per full group ``ceil(L / block_size)``; per sliding group of window ``W`` the
        blocks from ``max(0, L - W) // block_size`` on (what ``SlidingWindowManager``
        keeps after releasing for a query at position ``L - 1``). Unified pool: the sum
        over groups (they share it); ``per_group``: the max (the binding group's pool).
        Exact for decode; a prefill chunk allocated at once holds ``ceil(L /
        block_size)`` in every group until the next allocation releases."""
        bs = self.block_size
        n = -(-num_tokens // bs)
        per = []
        for g in self.kv_groups:
            w = g.sliding_window
            if w is None:
                per.append(n)
            else:
                d = num_tokens - w
                per.append(n - (d + abs(d)) // 2 // bs)  # (d + |d|) / 2 = max(0, d)
        if self.kv_pool == "unified" or not per:
            return sum(per)
        out = per[0]
        for x in per[1:]:
            out = out * (out >= x) + x * (x > out)  # max for ints and arrays alike
        return out

    def layer_fixed_scale_bytes(self, layer_id: int) -> int:
        """Bytes of one layer's fp8 scales, K and V (per tensor: 1 float32 each; per
        head: ``num_kv_heads``; an MLA layer's latent: one scale set, ``k_scale``);
        0 for other KV dtypes. Independent of num_blocks."""
        if not self.kv_dtype.startswith("fp8"):
            return 0
        a = self.layers[layer_id]
        per = 1 if self.kv_scale_granularity == "per_tensor" else a.num_kv_heads
        return a.kv_planes * per * SCALE_BYTES

    def layer_bytes(self, layer_id: int, num_blocks: int) -> int:
        """Bytes of one layer's cache tensors holding ``num_blocks`` blocks in the canonical
        layout: ``num_blocks * block_size * layer_bytes_per_token`` plus fp8 scales. The
        one cache-size formula (capacity planning and ``total_bytes`` use it)."""
        slots = num_blocks * self.block_size
        return slots * self.layer_bytes_per_token(layer_id) + self.layer_fixed_scale_bytes(layer_id)

    @property
    def fixed_scale_bytes(self) -> int:
        """Bytes of fp8 per-tensor / per-head scales (independent of num_blocks)."""
        return sum(self.layer_fixed_scale_bytes(i) for i in range(self.num_layers))

    @property
    def total_bytes(self) -> int:
        """Bytes the cache tensors occupy: ``num_blocks * bytes_per_block`` plus fp8
        scales (per layer: every layer has its own scales, also when it shares a
        unified pool's page tensor)."""
        return self.num_blocks * self.bytes_per_block + self.fixed_scale_bytes

    @property
    def state_bytes_per_sequence(self) -> int:
        """Bytes one sequence's recurrent state occupies over all state layers (conv and
        SSM states; ``StateSpec.bytes``); 0 without recurrent layers."""
        return sum(s.bytes for s in self.state_layers)

    @property
    def max_sliding_window(self) -> int | None:
        """The largest window over all layers; None if any layer is full attention."""
        ws = [a.sliding_window for a in self.layers]
        if any(w is None for w in ws):
            return None
        return max(w for w in ws if w is not None)

    def with_blocks(self, num_blocks: int, block_size: int | None = None) -> CacheSpec:
        """Return a copy sized to ``num_blocks`` (and optionally another block size)."""
        data = self.model_dump()
        data["num_blocks"] = num_blocks
        if block_size is not None:
            data["block_size"] = block_size
        return validated(CacheSpec, data)

    def to_json(self) -> str:
        """JSON text of this spec (round-trips through ``CacheSpec.model_validate_json``)."""
        return self.model_dump_json()

    # ---- constructors ----------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        block_size: int = 16,
        num_blocks: int = 0,
        kv_dtype: KVCacheDType = "auto",
        dtype: ModelDType | None = None,
        kv_scale_granularity: ScaleGranularity = "per_tensor",
        kv_pool: KVPoolKind = "unified",
    ) -> CacheSpec:
        """Lower a Hugging Face model config to a CacheSpec.

        Args:
            config: a ``transformers.PretrainedConfig``, or a mapping as in ``config.json``.
                Supported ``model_type``: ``kvpage.specs.architectures.PLAN_MODEL_TYPES``.
            block_size: tokens per block.
            num_blocks: blocks per KV group (0 = not sized yet).
            kv_dtype: KV storage dtype.
            dtype: model dtype; default the config's ``torch_dtype``/``dtype`` or float32.
            kv_scale_granularity: fp8 scale granularity.
            kv_pool: ``unified`` or ``per_group`` (``CacheSpec.kv_pool``).

        Raises:
            SpecError: unknown model_type or inconsistent sizes.

        Layer rules (from HF modeling code): ``layer_types`` when the config has it;
        otherwise Mistral's, Mixtral's, Phi-3's and StarCoder2's ``sliding_window``
        applies to every layer; Qwen2/Qwen3 slide only when ``use_sliding_window`` and
        ``layer >= max_window_layers``; Gemma-2 (and gpt-oss) slide on even layers,
        Gemma-3 on all but every ``sliding_window_pattern``-th; Gemma-2/3 scale by
        ``query_pre_attn_scalar ** -0.5`` and soft-cap at ``attn_logit_softcapping``;
        Granite scales by ``attention_multiplier``; GPT-2 may scale by ``1/(layer+1)``.
        """
        cfg = hf_config_dict(config)
        layers = attention_layers_from_hf(cfg)
        if dtype is None:
            dtype = dtype_from_config(cfg)
        states = state_layers_from_hf(cfg, dtype)
        return validated(
            cls,
            dict(
                num_layers=len(layers),
                block_size=block_size,
                num_blocks=num_blocks,
                dtype=dtype,
                kv_dtype=kv_dtype,
                kv_scale_granularity=kv_scale_granularity,
                kv_pool=kv_pool,
                layers=layers,
                state_layers=states,
            ),
        )

    @classmethod
    def from_llama2c_header(
        cls,
        source: str | Path | bytes,
        *,
        block_size: int = 16,
        num_blocks: int = 0,
        kv_dtype: KVCacheDType = "auto",
        dtype: ModelDType = "float32",
    ) -> CacheSpec:
        """Lower a llama2.c checkpoint header (7 little-endian int32: dim, hidden_dim,
        n_layers, n_heads, n_kv_heads, vocab_size, seq_len) to a CacheSpec.

        Args:
            source: path of a ``.bin`` checkpoint, or at least its first 28 bytes.

        Raises:
            SpecError: short header or inconsistent sizes.
        """
        cfg = llama2c_header_to_hf(source)
        return cls.from_hf_config(
            cfg, block_size=block_size, num_blocks=num_blocks, kv_dtype=kv_dtype, dtype=dtype
        )


_M = TypeVar("_M", bound=BaseModel)


def validated(model: type[_M], data: Mapping[str, Any], source: str | None = None) -> _M:
    """``model.model_validate(data)`` with pydantic's errors as one :class:`SpecError`.

    ``source`` (a file name) is for data read from a file: the message then names the
    file and its first failing field and quotes no value (a wrong file, e.g. an API
    keys file, must not be printed back).
    """
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SpecError(_format_validation(e, model.__name__, source)) from None


def _format_validation(e: ValidationError, what: str, source: str | None = None) -> str:
    parts: list[str] = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if source is not None:
            return f"{source}: invalid {what}: {loc or what}: {msg.split(', got ')[0]}"
        if "got" in msg:  # our own "name: expected X, got Y" (a model validator)
            part = f"{loc}: {msg}" if loc else msg
        else:
            part = f"{loc or what}: {msg} (got {got_repr(err.get('input'))})"
        if part not in parts:  # the same fault in many layers is reported once per layer
            parts.append(part)
    return f"invalid {what}: " + "; ".join(parts)


def make_attention_spec(**kwargs: Any) -> AttentionSpec:
    """Build an AttentionSpec, raising SpecError (not pydantic's error) on bad input."""
    return validated(AttentionSpec, kwargs)


def make_cache_spec(**kwargs: Any) -> CacheSpec:
    """Build a CacheSpec, raising SpecError on bad input."""
    return validated(CacheSpec, kwargs)


__all__ = [
    "DTYPE_BYTES",
    "KV_DTYPE_BYTES",
    "SCALE_BYTES",
    "AttentionSpec",
    "CacheSpec",
    "KVCacheDType",
    "KVGroup",
    "KVPoolKind",
    "ModelDType",
    "ScaleGranularity",
    "make_attention_spec",
    "make_cache_spec",
    "validated",
]
