"""The contract every attention backend meets (built-in or plugin).

A backend is stateless apart from caches of compiled kernels: every per-step input is
an argument. Per step the engine calls ``plan(meta)`` once per KV group — the backend
validates the step (``kvpage.attention.plan.check_step``) and returns its own frozen,
typed plan — then, per layer, ``write_kv`` and ``forward`` with that plan. The float64
reference (``kvpage.attention.reference``) defines what each method must compute; the
conformance suite (``conformance/``) proves it. How to write one:
docs/backend-authoring.md.

The KV cache layout is not a backend choice: every backend reads and writes
``KVCache`` in the one layout of ``kvpage.attention.metadata.kv_cache_shape``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

import torch

from kvpage.attention.metadata import AttentionMetadata, KVCache
from kvpage.attention.plan import StepPlan
from kvpage.specs import AttentionSpec, CacheSpec

PlanT = TypeVar("PlanT", bound=StepPlan)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do, declared up front; ``unsupported_reasons`` checks a spec
    and device against it.

    Attributes:
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        priority: ``select_backend(prefer="auto")`` rank per device type: among the
            backends that can run a spec, the highest priority wins (ties: name
            order). A device type missing here is never picked by ``"auto"`` (the
            backend stays selectable by name). The built-in torch backend has
            ``{"cuda": 0, "cpu": 0}``; the CUDA plugins rank by the backend comparison
            in docs/benchmarks.md.
        head_dims: supported head sizes; empty = any.
        max_head_dim: largest supported head size (0 = unbounded).
        query_dtypes: supported model dtypes (names as in ``CacheSpec.dtype``).
        kv_dtypes: supported ``CacheSpec.kv_dtype`` values.
        sliding_window / logits_soft_cap / gqa: feature flags.
        sinks: the backend computes attention sinks (``AttentionSpec.sinks``, the
            ``sinks=`` argument of ``forward``). Off by default: a backend that does
            not declare it is refused sink layers by ``select_backend`` and never drawn
            sink cases by the conformance strategies.
        mla: the backend computes MLA layers (``AttentionSpec.kv_lora_rank``: a latent
            cache ``[1, num_blocks, block_size, 1, head_dim]``, ``write_kv(latent,
            None, ...)``, ``forward`` -> ``[num_tokens, num_q_heads, kv_lora_rank]``).
            Off by default: ``select_backend`` refuses MLA layers to a backend that
            does not declare it.
        min_compute_capability: CUDA (major, minor) needed, or None.
        block_sizes: supported block sizes; empty = any.
        own_cpu_threads: on the CPU the backend splits its work over threads of its
            own (as many as ``torch.get_num_threads()`` when ``plan`` runs, kept in
            its plan), not inside torch's intra-op pool; the engine may then lower
            torch's thread count for a step's dense ops while the model runs
            (``kvpage.engine.runner.dense_threads``).
    """

    devices: frozenset[str]
    priority: Mapping[str, int] = field(default_factory=dict)
    query_dtypes: frozenset[str] = frozenset({"float32", "float16", "bfloat16"})
    kv_dtypes: frozenset[str] = frozenset({"auto", "int8", "fp8_e4m3", "fp8_e5m2"})
    head_dims: frozenset[int] = frozenset()
    max_head_dim: int = 0
    block_sizes: frozenset[int] = frozenset()
    sliding_window: bool = True
    logits_soft_cap: bool = True
    gqa: bool = True
    sinks: bool = False
    mla: bool = False
    min_compute_capability: tuple[int, int] | None = None
    own_cpu_threads: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


@runtime_checkable
class AttentionBackend(Protocol[PlanT]):
    """Paged attention kernels behind one interface (six methods and two attributes).

    Tensor conventions (glossary names): ``num_tokens`` new tokens in the step,
    ``num_seqs`` sequences, ``num_q_heads``/``num_kv_heads``/``head_dim`` from the
    layer's AttentionSpec. Query/key/value are in the model dtype
    (float32|float16|bfloat16) on the cache's device; they may be strided views (e.g.
    slices of a fused QKV projection): a kernel that needs contiguous memory calls
    ``.contiguous()`` itself.
    """

    name: str
    capabilities: BackendCapabilities

    def unsupported_reasons(self, spec: CacheSpec, device: torch.device) -> list[str]:
        """Why this backend cannot run ``spec`` on ``device`` (empty = it can).

        Must not raise for a missing optional library: report it as a reason.
        """
        ...

    def test_budget(self, device: torch.device) -> Mapping[str, object] | None:
        """How much of the conformance suite to run on ``device``: ``None`` for the
        default budget, else fields of ``kvpage.testing.TestBudget`` (e.g.
        ``{"example_fraction": 0.5, "max_seq_len": 48}`` for a slow simulator). Read
        by ``kvpage.testing.budget_for``."""
        ...

    def plan(self, meta: AttentionMetadata) -> PlanT:
        """Validate the step (``kvpage.attention.plan.check_step``, once) and
        precompute what every layer of it shares; called once per step and KV group,
        before any layer.

        Returns:
            The backend's own frozen ``StepPlan`` subclass (``plan_step(meta)`` when
            there is nothing to precompute).

        Raises:
            ShapeError, DTypeError: the step is inconsistent (nothing is computed).
        """
        ...

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: StepPlan | None = None,
    ) -> None:
        """Store new K/V into their slots, quantizing for int8/fp8 caches.

        Args:
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, model dtype. An MLA
                latent cache (``cache.is_latent``, backends declaring
                ``capabilities.mla``): the latent ``[num_tokens, 1, head_dim]`` as
                ``key`` and ``value=None`` (fp8: quantized with ``k_scale``).
            cache: mutated in place: ``kv`` (and ``token_scales`` for int8) at the
                slots in ``slot_mapping``; every other slot stays bit-identical.
            slot_mapping: ``[num_tokens]`` int64; -1 = skip this token.
            plan: the step's plan when ``slot_mapping`` is its ``meta.slot_mapping``
                (the model's layers pass it). A backend may skip ``check_write_kv``
                when ``plan.checked_slot_mapping is slot_mapping`` (the engine checked
                the slots against every pool at plan time,
                ``kvpage.attention.checks.check_step_layers``); it must check otherwise
                (None: a direct call). A backend whose checks must run anyway ignores it.

        int8: scale = absmax over head_dim / 127 per token and head (0 -> codes 0,
        scale 0); codes = clamp(round_half_even(x / scale), -127, 127).
        fp8: stored = fp8(clamp(x / scale, -fp8_max, fp8_max)) with the cache's
        k_scale / v_scale (per tensor or per KV head).

        Raises:
            ShapeError, DTypeError: ``kvpage.attention.checks.check_write_kv`` (unless
                skipped for a checked ``plan``, above); nothing is written.
        """
        ...

    def forward(
        self,
        query: torch.Tensor,
        cache: KVCache,
        plan: PlanT,
        spec: AttentionSpec,
        out: torch.Tensor | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer for every query row of the step: varlen causal
        attention of each sequence's new tokens over its cached context and
        themselves, within ``spec.sliding_window``; decode (``plan.is_decode``: one
        token per sequence), prefill, chunked prefill and prefix-cache hits alike.
        With ``spec.sinks`` the softmax denominator of query head ``h`` gains
        ``exp(sinks[h])`` (gpt-oss attention sinks).

        Args:
            query: ``[plan.num_tokens, num_q_heads, head_dim]``, packed by
                ``meta.query_start_loc``; token ``j`` of sequence ``i`` is at absolute
                position ``context_len_i + j``.
            cache: the layer's cache, already holding this step's K/V.
            plan: what ``plan(meta)`` returned for this step and KV group.
            spec: the layer's attention spec (scale, window, soft cap, GQA).
            out: optional ``[plan.num_tokens, num_q_heads, head_dim]`` buffer in the
                query dtype (may be a strided view).
            sinks: ``[num_q_heads]`` float32 sink logits on the cache's device,
                exactly when ``spec.sinks`` (None otherwise). A backend that does not
                declare ``capabilities.sinks`` may leave the argument out of its
                signature: the model passes it only for sink layers.

        Returns:
            ``[plan.num_tokens, num_q_heads, head_dim]`` in the query dtype (``out``
            when given). An MLA layer (``spec.kv_lora_rank``): ``query`` is the
            absorbed query ``[num_tokens, num_q_heads, head_dim]``, the result (and
            ``out``) ``[num_tokens, num_q_heads, kv_lora_rank]`` (attention over the
            latent; values = its first ``kv_lora_rank`` elements; the float64
            reference defines it).

        Raises:
            ShapeError, DTypeError: ``kvpage.attention.checks.check_forward``;
                nothing is written. BackendUnavailableError: the device cannot run it.
        """
        ...

    def copy_blocks(self, caches: list[KVCache], pairs: torch.Tensor) -> None:
        """Copy whole blocks (copy-on-write): for each row ``(src, dst)`` of ``pairs``
        (``[n, 2]`` int64), ``cache[:, dst] = cache[:, src]`` in every given layer,
        scales included. Mutates ``caches``; bit-exact.

        Raises:
            ShapeError, DTypeError: bad pairs or ids out of range; nothing is copied.
        """
        ...


@runtime_checkable
class LayerOps(Protocol):
    """Optional kernels for the small per-layer ops around attention (RMSNorm with the
    residual add before it, RoPE of the fused q/k/v projection, SiLU·mul), which a
    backend may offer through a method ``layer_ops(dtype, device) -> LayerOps | None``
    (not part of ``AttentionBackend``: a backend without it, or answering ``None`` for
    a dtype/device, leaves the model on its torch ops). On a small model these ops are
    a large share of a decode step, paid per op call rather than per element. The
    torch formulas in ``kvpage.models.layers`` / ``kvpage.models.rope`` are the
    reference; a backend's ops must equal them up to float summation order (RoPE:
    bit-identical). Every op returns new tensors and mutates nothing.
    """

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama RMSNorm of ``x`` (``[rows, n]``) with ``weight`` ``[n]``; with
        ``residual`` (same shape as ``x``), the norm of ``s = residual + x``.

        Returns:
            ``(s, y)``: ``s`` the sum (``x`` itself without ``residual``) and ``y =
            s / sqrt(mean(s**2, -1) + eps) * weight``, ``[rows, n]``.

        Raises:
            ShapeError, DTypeError: shapes or dtypes disagree.
        """
        ...

    def rope_qk(
        self,
        qkv: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kvpage.models.rope.apply_rope_qkv`` (same arguments, same results, new
        contiguous q ``[rows, num_q_heads, head_dim]`` and k ``[rows, num_kv_heads,
        head_dim]``).

        Raises:
            ShapeError, DTypeError: shapes or dtypes disagree.
        """
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate_up[:, :i]) * gate_up[:, i:]`` for ``gate_up`` ``[rows, 2 * i]``
        (SwiGLU; Shazeer, 2020), ``[rows, i]``.

        Raises:
            ShapeError, DTypeError: shapes or dtypes disagree.
        """
        ...


@runtime_checkable
class GreedyOps(Protocol):
    """An optional kernel for greedy sampling that a backend's ``LayerOps`` object may
    also implement: the first maximum of each logits row, computed on the logits'
    own dtype (bfloat16 logits are not copied to float32: the cast is exact, so it
    cannot change the answer). The engine's sampler uses it for all-greedy batches
    (``kvpage.engine.sampler``); without it ``torch`` ops are used.
    """

    dtype: torch.dtype

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``torch.argmax(logits, dim=-1)`` for ``logits`` ``[rows, n > 0]`` of
        :attr:`dtype` (unit column stride): ``[rows]`` int64, the first maximum of
        each row (the first NaN of a row that has one; 0 for an all ``-inf`` row).

        Raises:
            ShapeError, DTypeError: shapes or dtypes disagree.
        """
        ...
