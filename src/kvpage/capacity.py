"""Capacity planning: where the memory of a paged KV cache goes, before anything runs.

The simple formula most people use::

    kv_bytes = layers x 2 x kv_heads x head_dim x tokens x bytes_per_element

It is exact for a dense model with a ``float16``/``bfloat16``/``float32`` cache and a
token count that is a multiple of the block size, and leaves out:

* **block padding** — memory is handed out in blocks; a sequence of ``L`` tokens holds
  ``ceil(L / block_size)`` blocks, so its last block wastes ``-L mod block_size`` slots;
* **the reserved null block** — block id 0 of each pool is never handed out
  (``KVCacheManager`` contract), so usable blocks = ``num_blocks - 1``;
* **quantization scales** — int8 KV stores one float32 scale per token per KV head for K
  and for V (``+ 2 x kv_heads x 4`` bytes per token per layer); fp8 stores one float32
  scale per tensor or per KV head per layer (a fixed ``2 x 4 x {1|kv_heads}`` bytes per
  layer, independent of tokens);
* **per-layer shapes** — layers may differ (sliding-window layers). With the unified
  pool (``CacheSpec.kv_pool``, the default) a block holds one KV group's layers
  (``bytes_per_block``) and a sequence holds ``ceil(L / block_size)`` blocks per full
  group plus only its window's blocks per sliding group
  (``CacheSpec.sequence_blocks``), so the tokens that fit are exact for any mix
  (``kvpage.workload.workload_stats.max_sequence_tokens``); with ``per_group`` pools
  every layer holds ``num_blocks`` blocks and the binding group decides;
* **tensor parallelism** — KV heads are sharded: each of ``tp`` ranks holds
  ``num_kv_heads / tp`` heads; when ``tp > num_kv_heads`` heads must be replicated
  (each rank holds one head; ``tp`` must then be a multiple of ``num_kv_heads``); an
  MLA layer's latent (``AttentionSpec.kv_lora_rank``) is shared by all heads and every
  rank holds all of it (query heads are split);
* **recurrent state** (hybrid models: Mamba-2 / Gated DeltaNet layers,
  ``CacheSpec.state_layers``) — a fixed ``state_bytes_per_sequence`` per sequence (conv +
  SSM states, ``StateSpec.bytes``) for its live state, plus prefix-cache snapshots of
  the same size; sized as the engine sizes them (``kvpage.cache.state_pool``:
  ``max_num_seqs`` live slots first, then ``state_snapshot_share`` of the rest for
  snapshots, the rest KV blocks);
* **everything that is not KV** — weights (``num_parameters x bytes`` / tp), activations,
  CUDA graphs, allocator fragmentation and the framework's own buffers, which the
  ``utilization`` fraction and ``overhead_bytes`` stand in for.

Bytes here are computed from the spec the same way the canonical layout
(``kvpage.attention.allocate_kv_cache``: ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` per layer, plus scales) allocates them; the tests check equality against
the summed ``tensor.nbytes`` of real allocations.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpage.cache.state_pool import snapshot_slots_for, split_state_memory
from kvpage.errors import SpecError
from kvpage.specs import (
    DTYPE_BYTES,
    CacheSpec,
    load_preset,
    make_cache_spec,
    read_hf_config_file,
)
from kvpage.specs.architectures import PLAN_MODEL_TYPES, check_architecture
from kvpage.specs.families import count_parameters
from kvpage.specs.hf import hf_attention_shape
from kvpage.specs.moe import moe_parameter_count, moe_params_from_hf
from kvpage.workload.workload_stats import (
    Workload,
    analyze_workload,
    blocks_per_sequence,
    max_len_for_num_seqs,
    max_sequence_tokens,
)

GIB = 1 << 30


#: largest size ``parse_bytes`` accepts: 1 PiB. The biggest single accelerators hold a few
#: hundred GB (H200: 141 GB, B200: 192 GB, MI325X: 256 GB) and large CPU hosts a few TB;
#: anything above is a typo, and would give a plan with absurd numbers.
MAX_BYTES = 1 << 50


def parse_bytes(text: str | int | float, name: str = "memory") -> int:
    """Parse a memory size: an int of bytes, or ``"80GiB"``, ``"80GB"``, ``"24 GiB"``,
    ``"512MiB"``, ``"1.5e9"``. GiB/MiB/KiB are powers of 1024; GB/MB/KB powers of 1000.

    Args:
        text: the size.
        name: the option, for messages.

    Raises:
        SpecError: unparsable, negative, or above :data:`MAX_BYTES` (1 PiB).
    """
    if isinstance(text, (int, float)):
        val = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGTP]i?B|B)?\s*", str(text))
        if not m:
            raise SpecError(f"{name}: expected e.g. 80GiB, 80GB or bytes, got {text!r}")
        unit = m.group(2) or "B"
        mult = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15}.get(unit)
        if mult is None:
            mult = 1024 ** ("KMGTP".index(unit[0]) + 1)
        try:
            val = float(m.group(1)) * mult
        except ValueError:
            raise SpecError(f"{name}: expected a number, got {text!r}") from None
    if math.isinf(val):
        raise SpecError(f"{name}: expected a finite size (at most 1 PiB), got {text!r}")
    if not (val >= 0):
        raise SpecError(f"{name}: expected >= 0 bytes, got {text!r}")
    if val > MAX_BYTES:
        raise SpecError(
            f"{name}: expected at most 1 PiB ({MAX_BYTES:,} bytes; one device), got {text!r}"
        )
    return int(val)


def estimate_num_parameters(cfg: dict[str, Any]) -> int:
    """Parameter count of a decoder from its HF config: the modules of its family's row
    (``kvpage.specs.families.count_parameters``: embeddings and learned positions,
    q/k/v/o and their biases, q/k norms, sinks, the block's norms, the MLP, the final
    norm, the LM head unless tied), every expert of a MoE family (all are resident:
    ``kvpage.specs.moe``). Equal to transformers' parameter count for the configs in
    tests/models (test_models_families.py, test_models_moe.py) and to the presets'
    published counts.

    Raises:
        SpecError: a required field is missing.
    """
    try:
        shape = hf_attention_shape(cfg)
        if cfg.get("model_type") == "gpt2":
            inter = int(cfg.get("n_inner") or 4 * shape.hidden_size)
        else:
            inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise SpecError(
            f"config: expected Llama-style fields to count parameters, got {e}"
        ) from None
    moe = moe_params_from_hf(cfg, shape.num_layers)  # Mixtral / Qwen3-MoE / gpt-oss
    return count_parameters(
        cfg,
        hidden=shape.hidden_size,
        num_layers=shape.num_layers,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate=inter,
        vocab=vocab,
        moe_layers=0 if moe is None else len(moe.sparse_layers),
        moe_layer_params=0 if moe is None else moe_parameter_count(moe, shape.hidden_size),
    )


@dataclass
class ModelSource:
    """A resolved model: its config, parameter count and context length.

    ``num_parameters`` is None when the config does not allow counting them (then
    ``param_error`` says why, and the weights' size must be given).
    """

    name: str
    hf_config: dict[str, Any]
    num_parameters: int | None
    max_model_len: int
    param_error: str | None = None


def resolve_model(model: str) -> ModelSource:
    """Resolve a preset name (``specs/*.yaml``, e.g. ``llama-3-8b``, ``stories260K``),
    a preset file, or an HF ``config.json`` path (or a directory holding one).

    Raises:
        SpecError: not found or not understood (e.g. a ``.csv`` file, invalid JSON).
    """
    p = Path(model)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file() and p.name.endswith("config.json"):
        cfg = read_hf_config_file(p, f"model {model}")
        check_architecture(cfg, PLAN_MODEL_TYPES)  # before counting: name what is missing
        n, why = cfg.get("num_parameters"), None
        if not n:
            try:
                n = estimate_num_parameters(cfg)
            except SpecError as e:  # only needed when --weight-bytes is not given
                n, why = None, str(e)
        mml = int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 0)
        return ModelSource(p.parent.name or p.stem, cfg, None if n is None else int(n), mml, why)
    if p.exists() and p.suffix not in (".yaml", ".yml", ".json"):
        raise SpecError(
            f"model: expected a preset name, a preset .yaml/.json file, an HF config.json or a "
            f"folder holding one, got {model!r}"
        )
    pr = load_preset(model)
    return ModelSource(pr.name, dict(pr.hf_config), pr.num_parameters, pr.max_model_len)


def shard_cache_spec(spec: CacheSpec, tp: int, *, replicate_kv_heads: bool = False) -> CacheSpec:
    """The per-rank CacheSpec under tensor parallelism of degree ``tp``.

    KV heads are split across ranks (Megatron-style head sharding, as in vLLM): each rank
    holds ``num_kv_heads / tp`` KV heads and ``num_q_heads / tp`` query heads. When
    ``tp > num_kv_heads`` a rank cannot hold a fraction of a head: with
    ``replicate_kv_heads`` each rank holds one replicated KV head (``tp`` must be a
    multiple of ``num_kv_heads``), otherwise this is refused.

    Raises:
        SpecError: ``tp < 1``; ``tp`` does not divide ``num_kv_heads`` (and heads may not
            be replicated, or ``tp`` is not a multiple of it); ``tp`` does not divide
            ``num_q_heads``.
    """
    if tp < 1:
        raise SpecError(f"tp: expected >= 1, got {tp}")
    layers = []
    for i, a in enumerate(spec.layers):
        if a.num_q_heads % tp:
            raise SpecError(f"tp: expected a divisor of num_q_heads={a.num_q_heads}, got {tp}")
        if a.is_mla:  # one latent per token shared by all heads: every rank holds it
            kv = 1
        elif a.num_kv_heads % tp == 0:
            kv = a.num_kv_heads // tp
        elif replicate_kv_heads and tp % a.num_kv_heads == 0:
            kv = 1
        else:
            hint = " (or pass replicate_kv_heads with tp a multiple of it)"
            raise SpecError(
                f"tp: expected a divisor of num_kv_heads={a.num_kv_heads} (layer {i}){hint}, "
                f"got {tp}"
            )
        d = a.model_dump()
        d.update(num_q_heads=a.num_q_heads // tp, num_kv_heads=kv)
        layers.append(d)
    data = spec.model_dump()
    data["layers"] = layers
    return make_cache_spec(**data)


def layer_bytes(spec: CacheSpec, layer_id: int, num_blocks: int) -> int:
    """Bytes of one layer's cache tensors for ``num_blocks`` blocks in the canonical layout:
    K/V data ``2*num_blocks*block_size*num_kv_heads*head_dim*elem`` plus int8 per-token
    scales ``2*num_blocks*block_size*num_kv_heads*4`` or fp8 scales ``2*4*{1|num_kv_heads}``."""
    return spec.layer_bytes(layer_id, num_blocks)


def kv_cache_bytes(spec: CacheSpec, num_blocks: int) -> int:
    """Bytes of the whole cache (all layers) for ``num_blocks`` blocks per layer."""
    return num_blocks * spec.bytes_per_block + spec.fixed_scale_bytes


def simple_formula_bytes(spec: CacheSpec, tokens: int) -> int:
    """``layers x 2 x kv_heads x head_dim x tokens x bytes_per_element`` (first layer's
    shape for all layers; no padding, scales, null block). For MLA layers the factor 2
    is 1: one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token and
    layer, no separate V (DeepSeek-V2, arXiv:2405.04434, Table 1)."""
    if not spec.layers:  # recurrent layers only: no KV
        return 0
    a = spec.layers[0]
    planes = 1 if a.kv_lora_rank is not None else 2
    return spec.num_layers * planes * a.num_kv_heads * a.head_dim * tokens * spec.kv_element_bytes


def host_snapshot_rows(
    host_tier_bytes: int,
    state_bytes: int,
    snapshot_share: float,
    *,
    num_snapshot_slots: int,
    prefix_caching: bool = True,
) -> int:
    """Host snapshot rows of a hybrid model's ``StatePool`` beside a host KV tier
    (``kvpage.cache.state_pool``, "Host snapshots"; the engine's ``build_components``,
    the simulator and :func:`plan_capacity` all size them here):
    ``floor(host_tier_bytes * snapshot_share) // state_bytes`` rows of ``state_bytes``
    each, host memory of their own beside the tier's ``host_tier_bytes``. 0 without a
    host tier, without prefix caching, or without snapshot slots (a host row is filled
    only by a device snapshot's eviction and read back through a snapshot slot).

    Args:
        host_tier_bytes: the host KV tier's capacity (``kv_host_tier_bytes``), bytes.
        state_bytes: ``CacheSpec.state_bytes_per_sequence`` (> 0 where used).
        snapshot_share: ``state_snapshot_share``, in [0, 1).
        num_snapshot_slots: the pool's device snapshot slots.
        prefix_caching: whether prefix caching is on.

    Returns:
        the row count (>= 0).
    """
    if not (host_tier_bytes and prefix_caching and num_snapshot_slots and state_bytes > 0):
        return 0
    return int(host_tier_bytes * snapshot_share) // state_bytes


@dataclass
class CapacityPlan:
    """The result of :func:`plan_capacity` (all bytes per rank; tokens per rank = per model
    replica, since every rank holds the same token positions)."""

    model: str
    tp: int
    block_size: int
    kv_dtype: str
    dtype: str
    device_bytes: int
    utilization: float
    weight_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int
    bytes_per_token: int
    bytes_per_block: int
    simple_bytes_per_token: int
    fixed_bytes: int
    num_blocks: int
    usable_blocks: int
    tokens: int
    model_max_len: int
    workload: dict[str, Any] = field(default_factory=dict)
    kv_pool: str = "unified"
    num_kv_groups: int = 1
    tokens_unbounded: bool = False
    num_state_layers: int = 0
    state_bytes_per_sequence: int = 0
    state_live_slots: int = 0
    state_snapshot_share: float = 0.0
    state_snapshot_slots: int = 0
    state_snapshot_bytes: int = 0
    state_seqs_that_fit: int = 0
    kv_host_tier_bytes: int = 0
    state_host_snapshot_rows: int = 0
    state_host_snapshot_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_capacity(
    model: str,
    *,
    device_bytes: int | str,
    utilization: float = 0.9,
    weight_bytes: int | str | None = None,
    weight_dtype: str | None = None,
    overhead_bytes: int | str = 0,
    tp: int = 1,
    replicate_kv_heads: bool = False,
    kv_dtype: str = "auto",
    dtype: str | None = None,
    block_size: int = 16,
    workload: Workload | None = None,
    num_seqs: int | None = None,
    max_model_len: int | None = None,
    kv_pool: str = "unified",
    max_num_seqs: int = 256,
    state_snapshot_share: float = 0.1,
    kv_host_tier_bytes: int | str = 0,
) -> CapacityPlan:
    """Size the KV cache of ``model`` on one device (one TP rank).

    Budget: ``kv_budget = device_bytes x utilization - weight_bytes / tp - overhead_bytes``;
    ``num_blocks = floor((kv_budget - fixed_scale_bytes) / bytes_per_block)`` (including the
    reserved null block, so ``usable_blocks = num_blocks - 1``). ``weight_bytes`` defaults
    to ``num_parameters x bytes(weight_dtype or dtype)``.

    Workload answers (``workload`` given): expected concurrent sequences (paged: usable
    slots / mean time-averaged blocks held per sequence, averaged over its decode; at final
    length; contiguous max_model_len reservation), fragmentation (mean padding of the last
    partial block per sequence, in bytes and % of held memory). ``num_seqs`` (with or
    without a workload): the largest max_model_len that admits ``num_seqs`` sequences all
    at full length (:func:`max_len_for_num_seqs`).
    ``max_model_len`` (default: the model's context) sizes the contiguous reservation.
    ``kv_pool``: ``unified`` (one pool for every KV group) or ``per_group``
    (``CacheSpec.kv_pool``). ``tokens``: the longest single sequence that fits
    (:func:`max_sequence_tokens`; dense: ``usable_blocks * block_size``); a model
    without full-attention layers whose windows always fit reports
    ``usable_blocks // num_kv_groups * block_size`` with ``tokens_unbounded`` set.

    Hybrid models (recurrent state layers): the budget is split as the engine splits
    ``kv_cache_memory_bytes`` (``kvpage.cache.state_pool.split_state_memory``):
    ``max_num_seqs x state_bytes_per_sequence`` for the live states, then
    ``state_snapshot_share`` of the rest for snapshots (``state_snapshot_slots`` of
    ``state_bytes_per_sequence`` each, at most one per usable block) and the rest for KV
    blocks (``num_blocks``); ``state_seqs_that_fit`` = sequences of ``model_max_len``
    tokens whose KV blocks and live state fit the whole budget without snapshots,
    ``floor((kv_budget - fixed) / (sequence_blocks(L) x bytes_per_block +
    state_bytes_per_sequence))``. A model of recurrent layers only (``mamba2``) has no
    KV blocks (``num_blocks`` 2, ``tokens_unbounded``) and no cap on its snapshots.
    With a host KV tier (``kv_host_tier_bytes`` > 0, the engine's field; prefix caching
    assumed on, as the engine requires for a tier) a hybrid model's evicted snapshots
    go to ``state_host_snapshot_rows`` host rows (:func:`host_snapshot_rows`; 0 without
    snapshot slots) of ``state_bytes_per_sequence`` each, ``state_host_snapshot_bytes``
    of host memory beside the tier's own bytes (not in the device budget).

    Raises:
        SpecError: bad or unsupported model (``kvpage.specs.architectures``), ``max_model_len``
            above the model's context, a size above 1 PiB, budget below zero, TP
            sharding refused, bad dtypes, ``kv_host_tier_bytes`` not a size >= 0;
            ``weight_bytes`` missing where the parameter
            count is unknown; ``tp > 1``, ``max_num_seqs < 1`` or a share outside
            [0, 1) with recurrent state layers.
    """
    src = resolve_model(model)
    if num_seqs is not None and (isinstance(num_seqs, bool) or num_seqs < 1):
        raise SpecError(f"num_seqs: expected None or an int >= 1, got {num_seqs!r}")
    if max_model_len is not None and (isinstance(max_model_len, bool) or max_model_len < 1):
        raise SpecError(f"max_model_len: expected None or an int >= 1, got {max_model_len!r}")
    if max_model_len is not None and src.max_model_len and max_model_len > src.max_model_len:
        raise SpecError(
            f"max_model_len: expected <= {src.max_model_len} (the model's context, "
            f"max_position_embeddings), got {max_model_len}"
        )
    if not (0 < utilization <= 1):
        raise SpecError(f"utilization: expected 0 < u <= 1, got {utilization}")
    if kv_pool not in ("unified", "per_group"):
        raise SpecError(f"kv_pool: expected 'unified' or 'per_group', got {kv_pool!r}")
    full = CacheSpec.from_hf_config(
        src.hf_config,
        block_size=block_size,
        kv_dtype=kv_dtype,  # type: ignore[arg-type]
        dtype=dtype,  # type: ignore[arg-type]
        kv_pool=kv_pool,  # type: ignore[arg-type]
    )
    spec = shard_cache_spec(full, tp, replicate_kv_heads=replicate_kv_heads)
    dev = parse_bytes(device_bytes, "device_bytes (--memory)")
    wdt = weight_dtype or spec.dtype
    if wdt not in DTYPE_BYTES and wdt not in ("int8", "fp8", "int4"):
        raise SpecError(
            f"weight_dtype: expected float32/float16/bfloat16/int8/fp8/int4, got {wdt!r}"
        )
    wbytes_per = {"int8": 1.0, "fp8": 1.0, "int4": 0.5}.get(wdt) or float(DTYPE_BYTES[wdt])
    if weight_bytes is not None:
        wb = parse_bytes(weight_bytes, "weight_bytes (--weight-bytes)")
    elif src.num_parameters is None:
        raise SpecError(
            f"weight_bytes: expected a value (--weight-bytes), since the parameter count "
            f"is unknown: {src.param_error}"
        )
    else:
        wb = int(src.num_parameters * wbytes_per)
    ov = parse_bytes(overhead_bytes, "overhead_bytes (--overhead)")
    host_tier = parse_bytes(kv_host_tier_bytes, "kv_host_tier_bytes (--kv-host-tier-bytes)")
    budget = int(dev * utilization) - -(-wb // tp) - ov
    bpb = kv_cache_bytes(spec, 1) - kv_cache_bytes(spec, 0)
    fixed = kv_cache_bytes(spec, 0)
    recurrent_only = bpb == 0  # no attention layer (mamba2): no KV blocks at all
    if budget < fixed + 2 * bpb or (recurrent_only and budget < spec.state_bytes_per_sequence):
        raise SpecError(
            f"device_bytes: expected room for weights ({wb / tp / GIB:.2f} GiB/rank) and at least "
            f"2 KV blocks, got {budget / GIB:.2f} GiB left for KV"
        )
    num_blocks = 2 if recurrent_only else (budget - fixed) // bpb
    state_bytes = spec.state_bytes_per_sequence
    snap_slots = snap_bytes = seqs_fit = host_rows = 0
    if state_bytes:
        if tp != 1:
            raise SpecError(
                f"tp: expected 1 for a model with recurrent state layers (sharding the "
                f"recurrent states is not modelled), got {tp}"
            )
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:  # fmt: skip
            raise SpecError(f"max_num_seqs: expected an int >= 1, got {max_num_seqs!r}")
        if not 0.0 <= state_snapshot_share < 1.0:
            raise SpecError(
                f"state_snapshot_share: expected a number in [0, 1), got {state_snapshot_share!r}"
            )
        kv_bytes, snap_budget = split_state_memory(
            budget, state_bytes, max_num_seqs, state_snapshot_share
        )
        num_blocks = 2 if recurrent_only else (kv_bytes - fixed) // bpb
        if num_blocks < 2 or kv_bytes < 0:
            raise SpecError(
                f"device_bytes: expected room for {max_num_seqs} live recurrent states "
                f"({state_bytes:,} bytes each) and 2 KV blocks, got "
                f"{budget / GIB:.2f} GiB left for KV and state"
            )
        cap = (1 << 40) if recurrent_only else int(num_blocks) - 1
        snap_slots = snapshot_slots_for(
            state_bytes, state_snapshot_share, cap, snapshot_bytes=snap_budget
        )
        snap_bytes = snap_slots * state_bytes
        host_rows = host_snapshot_rows(
            host_tier, state_bytes, state_snapshot_share, num_snapshot_slots=snap_slots
        )
        mml = max_model_len or src.max_model_len
        per_seq = (0 if recurrent_only else int(spec.sequence_blocks(mml)) * bpb) + state_bytes
        seqs_fit = max(0, (budget - fixed) // per_seq)
    if recurrent_only and workload is not None:
        raise SpecError(
            "workload: expected none for a model of recurrent layers only (it holds no KV "
            "blocks to count), got a workload"
        )
    ngroups = len(spec.kv_groups)
    fit = None if recurrent_only else max_sequence_tokens(spec, int(num_blocks) - 1)
    if recurrent_only:
        fit = 0
    elif fit is None:
        per = (int(num_blocks) - 1) // ngroups if spec.kv_pool == "unified" else num_blocks - 1
        fit = int(per) * block_size
    plan = CapacityPlan(
        model=src.name,
        tp=tp,
        block_size=block_size,
        kv_dtype=spec.kv_dtype,
        dtype=spec.dtype,
        device_bytes=dev,
        utilization=utilization,
        weight_bytes=wb,
        overhead_bytes=ov,
        kv_budget_bytes=budget,
        bytes_per_token=spec.bytes_per_token,  # every layer (a unified block: one group)
        bytes_per_block=bpb,
        simple_bytes_per_token=simple_formula_bytes(spec, 1),
        fixed_bytes=fixed,
        num_blocks=int(num_blocks),
        usable_blocks=int(num_blocks) - 1,
        tokens=int(fit),
        model_max_len=max_model_len or src.max_model_len,
        kv_pool=spec.kv_pool,
        num_kv_groups=ngroups,
        tokens_unbounded=recurrent_only or max_sequence_tokens(spec, int(num_blocks) - 1) is None,
        num_state_layers=len(spec.state_layers),
        state_bytes_per_sequence=state_bytes,
        state_live_slots=max_num_seqs if state_bytes else 0,
        state_snapshot_share=state_snapshot_share if state_bytes else 0.0,
        state_snapshot_slots=snap_slots,
        state_snapshot_bytes=snap_bytes,
        state_seqs_that_fit=int(seqs_fit),
        kv_host_tier_bytes=host_tier,
        state_host_snapshot_rows=host_rows,
        state_host_snapshot_bytes=host_rows * state_bytes,
    )
    if workload is not None:
        plan.workload = analyze_workload(
            spec, plan.usable_blocks, workload, plan.model_max_len, num_seqs
        )
    elif num_seqs is not None:  # needs no length samples: blocks per sequence suffice
        plan.workload = max_len_for_num_seqs(spec, plan.usable_blocks, num_seqs, plan.model_max_len)
    return plan


__all__ = [
    "CapacityPlan",
    "ModelSource",
    "Workload",
    "analyze_workload",
    "blocks_per_sequence",
    "estimate_num_parameters",
    "host_snapshot_rows",
    "kv_cache_bytes",
    "max_len_for_num_seqs",
    "max_sequence_tokens",
    "layer_bytes",
    "parse_bytes",
    "plan_capacity",
    "resolve_model",
    "shard_cache_spec",
    "simple_formula_bytes",
]
