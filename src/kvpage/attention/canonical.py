"""Host-side helpers that kernel launchers share, for the one cache layout
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (``kvpage.attention.metadata``):
selection reasons, per-row maps (``TokenMapPlan``, the plan of the cupy and numba
plugins), fp8 scale tables. Launcher-side input checks live in
``kvpage.attention.checks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.plan import StepPlan, step_fields
from kvpage.errors import BackendUnavailableError
from kvpage.specs import AttentionSpec, CacheSpec


@dataclass(frozen=True, kw_only=True)
class TokenMapPlan(StepPlan):
    """A plan for kernels that run one program per query row: which sequence and
    absolute position each row is (``token_map``), on the step's device.

    Attributes:
        token_seq / token_pos: ``[num_tokens]`` int32 (see ``token_map``).
        max_keys: memo of ``max_keys_per_query`` per sliding window (``keys_for``).
    """

    token_seq: torch.Tensor
    token_pos: torch.Tensor
    max_keys: dict[int | None, int] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_meta(cls, meta: AttentionMetadata) -> TokenMapPlan:
        """Validate the step (``check_step``) and build its token map.

        Raises:
            ShapeError, DTypeError: see ``kvpage.attention.plan.check_step``.
        """
        fields = step_fields(meta)
        seq, pos = token_map(meta)
        return cls(**fields, token_seq=seq, token_pos=pos)

    def keys_for(self, spec: AttentionSpec) -> int:
        """``max_keys_per_query`` for the layer's window, computed once per window."""
        w = spec.sliding_window
        if w not in self.max_keys:
            self.max_keys[w] = max_keys_per_query(self.meta, spec)
        return self.max_keys[w]


def head_dim_reasons(spec: CacheSpec, max_head_dim: int) -> list[str]:
    """``["layers[i].head_dim: expected <= max_head_dim, got d"]`` for the first layer
    of ``spec`` whose head_dim is too large; ``[]`` when all fit (or ``max_head_dim``
    is 0 = unbounded). For ``unsupported_reasons``."""
    if max_head_dim <= 0:
        return []
    for i, layer in enumerate(spec.layers):
        if layer.head_dim > max_head_dim:
            return [f"layers[{i}].head_dim: expected <= {max_head_dim}, got {layer.head_dim}"]
    return []


def sinks_reasons(spec: CacheSpec, backend: str) -> list[str]:
    """``["layers[i].sinks: expected no attention sinks (<backend> does not implement
    them), got sinks"]`` for the first layer of ``spec`` with attention sinks
    (``AttentionSpec.sinks``, gpt-oss); ``[]`` when none has them. For the
    ``unsupported_reasons`` of a backend without sink support (and
    ``kvpage.backends.backend_reasons`` for any backend that does not declare
    ``capabilities.sinks``)."""
    for i, layer in enumerate(spec.layers):
        if layer.sinks:
            return [
                f"layers[{i}].sinks: expected no attention sinks ({backend} does not "
                "implement them), got sinks"
            ]
    return []


def refuse_sinks(spec: AttentionSpec, backend: str) -> None:
    """The ``forward`` guard of a backend without sink support: raise
    ``BackendUnavailableError`` naming the feature for a layer with ``spec.sinks``."""
    if spec.sinks:
        why = f"sinks: expected no attention sinks ({backend} does not implement them), got sinks"
        raise BackendUnavailableError(
            f"{backend}: attention sinks not implemented", {backend: [why]}
        )


def mla_reasons(spec: CacheSpec, backend: str) -> list[str]:
    """``["layers[i].kv_lora_rank: expected no MLA layers (<backend> does not implement
    multi-head latent attention), got kv_lora_rank=r"]`` for the first MLA layer of
    ``spec`` (``AttentionSpec.kv_lora_rank``); ``[]`` when none is. For the
    ``unsupported_reasons`` of a backend without MLA (and
    ``kvpage.backends.backend_reasons`` for any backend that does not declare
    ``capabilities.mla``)."""
    for i, layer in enumerate(spec.layers):
        if layer.kv_lora_rank is not None:
            return [
                f"layers[{i}].kv_lora_rank: expected no MLA layers ({backend} does not "
                f"implement multi-head latent attention), got kv_lora_rank={layer.kv_lora_rank}"
            ]
    return []


def refuse_mla(spec: AttentionSpec, backend: str) -> None:
    """The ``forward`` guard of a backend without MLA: raise ``BackendUnavailableError``
    naming the feature for an MLA layer (``spec.kv_lora_rank`` set)."""
    if spec.kv_lora_rank is not None:
        why = (
            f"kv_lora_rank: expected no MLA layer ({backend} does not implement multi-head "
            f"latent attention), got kv_lora_rank={spec.kv_lora_rank}"
        )
        raise BackendUnavailableError(f"{backend}: MLA not implemented", {backend: [why]})


def refuse_latent_write(value: torch.Tensor | None, backend: str) -> torch.Tensor:
    """The ``write_kv`` guard of a backend without MLA: ``value`` itself, or
    ``BackendUnavailableError`` naming the feature when it is None (an MLA latent cache,
    whose latent comes as the key alone)."""
    if value is None:
        why = (
            f"value: expected a V tensor ({backend} does not implement multi-head latent "
            "attention caches), got None"
        )
        raise BackendUnavailableError(f"{backend}: MLA not implemented", {backend: [why]})
    return value


def mla_as_mqa(cache: KVCache, spec: AttentionSpec) -> tuple[KVCache, AttentionSpec]:
    """An MLA layer as the multi-query attention it is in the absorbed form (DeepSeek-V2,
    arXiv:2405.04434, appendix C): one KV head whose key is the latent
    ``[head_dim]`` and whose value is the same latent (the output's first
    ``kv_lora_rank`` elements are the MLA output). Returns a KVCache whose V plane is
    the K plane (``kv.expand(2, ...)``: a stride-0 view, no copy; int8 token scales
    likewise; fp8 ``v_scale`` = ``k_scale``) and the MQA spec (same heads, head_dim,
    scale). Kernels that read ``kv[0]`` and ``kv[1]`` then compute ``softmax(scale *
    q . latent) @ latent``; the caller keeps ``[..., :kv_lora_rank]``. Mutates nothing.
    """
    kv = cache.kv.expand(2, *cache.kv.shape[1:])
    ts = cache.token_scales
    alias = KVCache(kv=kv, token_scales=None if ts is None else ts.expand(2, *ts.shape[1:]))
    alias.k_scale = cache.k_scale
    alias.v_scale = cache.k_scale
    mqa = AttentionSpec(
        num_q_heads=spec.num_q_heads,
        num_kv_heads=1,
        head_dim=spec.head_dim,
        scale=spec.scale,
        sliding_window=spec.sliding_window,
        logits_soft_cap=spec.logits_soft_cap,
    )
    return alias, mqa


def token_map(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence index and absolute position of every query row, as two ``[num_tokens]``
    int32 tensors on ``meta.seq_lens``'s device, built from the host lists
    (``query_lens_cpu``, ``seq_lens_cpu``): no device sync. Row ``j`` of sequence ``i``
    sits at position ``seq_len_i - query_len_i + j``."""
    seq: list[int] = []
    pos: list[int] = []
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        seq.extend([i] * q)
        pos.extend(range(s - q, s))
    dev = meta.seq_lens.device
    return (
        torch.tensor(seq, dtype=torch.int32, device=dev),
        torch.tensor(pos, dtype=torch.int32, device=dev),
    )


def max_keys_per_query(meta: AttentionMetadata, spec: AttentionSpec) -> int:
    """The most keys any query row of the step attends to (``spec.sliding_window``
    included); 0 for a step without query rows. From host lists: no device sync."""
    best = 0
    for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        if q > 0:
            best = max(best, s if spec.sliding_window is None else min(s, spec.sliding_window))
    return best


def fp8_scale_table(cache: KVCache) -> torch.Tensor:
    """``[2, num_kv_heads]`` float32 on the cache's device: the K and V fp8 scales per
    KV head (a per-tensor scale broadcast; an MLA latent cache: ``k_scale`` twice), or
    ones for a cache without fp8 scales."""
    h = cache.num_kv_heads
    v_scale = cache.k_scale if cache.is_latent else cache.v_scale  # one latent, one scale
    if cache.k_scale is None or v_scale is None:
        return torch.ones((2, h), dtype=torch.float32, device=cache.kv.device)
    return torch.stack([cache.k_scale.expand(h), v_scale.expand(h)]).contiguous()
