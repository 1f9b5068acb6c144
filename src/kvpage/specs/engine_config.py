"""The one engine configuration: :class:`EngineConfig`, a pydantic model.

``LLM(...)`` / ``LLMEngine.from_config(...)`` validate their keyword arguments with it,
``kvpage serve`` holds it as the ``engine`` section of its ``ServerConfig``, the
``generate``/``replay``/``serve`` command-line flags are generated from its fields
(``kvpage.engine.cli_flags``) and the simulator checks the engine fields it shares
with it. Each field's rule is written once, in :data:`FIELD_RULES`; an error names
the field: ``"num_blocks: expected None or an int >= 2 (...), got 1"``.

Sizing rules of the unsized fields (``num_blocks``, ``max_model_len``) are applied when
the engine is built (``kvpage.engine.config``). The module imports no torch (the
server's config and the CLI parser import it): whether a ``device`` exists on this
machine is checked when the engine is built, not here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvpage.errors import SpecError, format_validation_error, got_repr
from kvpage.specs.core import KVCacheDType, KVPoolKind, ModelDType
from kvpage.specs.speculative import parse_speculative_config

__all__ = [
    "DEFAULT_RETENTION_MAX_SHARE",
    "FIELD_RULES",
    "GENERATION_CONFIG_MODES",
    "EngineConfig",
    "PreemptionMode",
    "SCHEDULING_POLICIES",
    "SchedulingPolicy",
    "StrictModel",
    "UnknownFieldError",
    "check_engine_field",
]

#: request ordering of the waiting queue (``kvpage.engine.queue_policy``)
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")
PreemptionMode = Literal["recompute", "swap"]
#: share of the usable KV blocks retention policies may hold by default
DEFAULT_RETENTION_MAX_SHARE = 0.5
#: the ``generation_config`` values that are not folder paths (vLLM's, with ``none``)
GENERATION_CONFIG_MODES: tuple[str, ...] = ("auto", "vllm", "none")

_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


class StrictModel(BaseModel):
    """A config model that refuses unknown fields, NaN/inf and, on assignment, any value
    that breaks a rule (the whole model is validated with the new value first, so a
    refused assignment leaves it unchanged)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).model_fields:
            type(self).model_validate({**self.model_dump(), name: value})
        super().__setattr__(name, value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_in(lo: int, hi: int | None = None, *, optional: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if v is None:
            return optional
        return _is_int(v) and v >= lo and (hi is None or v <= hi)

    return ok


def _one_of(*names: str) -> tuple[Callable[[Any], bool], str]:
    quoted = [repr(n) for n in names]
    return (lambda v: isinstance(v, str) and v in names), (
        ", ".join(quoted[:-1]) + " or " + quoted[-1]
    )


def _share(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1


def _model(v: Any) -> bool:
    # a name/path, or an in-memory transformers model (anything load_model takes)
    return (isinstance(v, str) and bool(v)) or not isinstance(
        v, (type(None), bool, int, float, bytes, list, tuple, dict)
    )


def _generation_config(v: Any) -> bool:
    return isinstance(v, str) and (
        v in GENERATION_CONFIG_MODES or (bool(v) and Path(v).expanduser().is_dir())
    )


def _device(v: Any) -> bool:
    return isinstance(v, str) and _DEVICE.fullmatch(v) is not None


_BYTES = (_int_in(0), "an int >= 0 (bytes)")
_POSITIVE = (_int_in(1), "an int >= 1")
_BOOL: tuple[Callable[[Any], bool], str] = (lambda v: isinstance(v, bool), "a bool")

#: field -> (accepts(value), the "expected ..." phrase of its error): the one place each
#: engine field's rule is written (the pydantic model, the CLI flags and the simulator
#: use it). ``device`` is checked for its form here and for its existence at build time.
FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (_model, "a model name, a model folder or an in-memory transformers model"),
    "block_size": _POSITIVE,
    "num_blocks": (
        _int_in(2, optional=True),
        "None or an int >= 2 (block 0 is the reserved null block)",
    ),
    "kv_cache_memory_bytes": (_int_in(1, optional=True), "None or an int >= 1"),
    "max_num_seqs": _POSITIVE,
    "max_num_batched_tokens": _POSITIVE,
    "max_model_len": (_int_in(1, optional=True), "None or an int >= 1"),
    "enable_prefix_caching": _BOOL,
    "kv_cache_dtype": _one_of("auto", "int8", "fp8_e4m3", "fp8_e5m2"),
    "backend": (lambda v: isinstance(v, str) and bool(v), "'auto' or a backend name"),
    "dtype": _one_of("float32", "float16", "bfloat16"),
    "seed": (_int_in(0, 2**63 - 1), "an int in [0, 2**63 - 1]"),
    "device": (_device, "'cpu' or 'cuda[:N]'"),
    "num_threads": (
        _int_in(0, optional=True),
        "None (default 1), 0 (torch's default) or an int >= 1",
    ),
    "scheduling_policy": _one_of(*SCHEDULING_POLICIES),
    "kv_retention_max_share": (_share, "a number in [0, 1]"),
    "kv_host_tier_bytes": _BYTES,
    "kv_disk_tier_bytes": _BYTES,
    "kv_disk_tier_path": (
        lambda v: v is None or (isinstance(v, str) and bool(v)),
        "None or a directory path",
    ),
    "preemption_mode": _one_of("recompute", "swap"),
    "swap_space_bytes": _BYTES,
    "generation_config": (
        _generation_config,
        "'auto', 'vllm', 'none' or an existing folder",
    ),
    "kv_pool": _one_of("unified", "per_group"),
    "state_snapshot_share": (
        lambda v: _share(v) and v < 1,
        "a number in [0, 1) (share of the cache memory for recurrent-state snapshots)",
    ),
    "state_snapshot_slots": (_int_in(0, optional=True), "None or an int >= 0"),
    "state_share_threshold": (_int_in(2), "an int >= 2 (requests passing a boundary)"),
    "state_predicted_share": (_share, "a number in [0, 1]"),
    "state_decode_snapshots": _BOOL,
    "speculative_config": (
        lambda v: v is None or isinstance(v, dict),
        "None or a dict (vLLM's speculative_config: method, num_speculative_tokens, "
        "prompt_lookup_max, prompt_lookup_min, disable_by_batch_size; kvpage's "
        "draft_policy) or its JSON text",
    ),
}


def _device_phrase(v: Any) -> str:
    """The expected-phrase for a bad device: torch's parser tells a malformed string
    from a device type kvpage does not run on (torch imported only on this error path)."""
    if isinstance(v, str):
        import torch

        try:
            torch.device(v)
        except (RuntimeError, TypeError, ValueError):
            pass
        else:
            return "'cpu' or 'cuda[:N]'"
    return "a torch device such as 'cpu', 'cuda' or 'cuda:0'"


def check_engine_field(name: str, value: Any) -> Any:
    """``value`` if it satisfies the rule of engine field ``name`` (:data:`FIELD_RULES`).

    Raises:
        SpecError: ``"<name>: expected <rule>, got <value>"``.
    """
    accepts, phrase = FIELD_RULES[name]
    if name == "speculative_config" and value is not None:
        # a dict or its JSON text (the CLI flag); the keys' own rules name the key
        spec = parse_speculative_config(value)
        assert spec is not None
        return {f: getattr(spec, f) for f in spec.__slots__}
    if not accepts(value):
        if name == "device":
            phrase = _device_phrase(value)
        raise SpecError(f"{name}: expected {phrase}, got {got_repr(value)}")
    return value


class UnknownFieldError(SpecError, TypeError):
    """A keyword of ``EngineConfig(...)`` that is no field: a ``TypeError`` as for any
    Python call with a wrong keyword, and a ``SpecError`` naming it (inside a larger
    model, pydantic reports it at ``engine.<name>``)."""


class EngineConfig(StrictModel):
    """Every knob of ``LLM`` / ``LLMEngine.from_config`` (vLLM's names), and the
    ``engine`` section of ``kvpage serve``'s config. ``EngineConfig(**kwargs)`` raises
    :class:`~kvpage.errors.SpecError` naming the first bad field (``TypeError`` for an
    unknown keyword, as a Python call does); inside a larger
    pydantic model (``ServerConfig``) a bad field is a ``ValidationError`` at
    ``engine.<field>``. Each field's ``description`` is its ``--help`` text.
    """

    model: Any = Field(
        "stories260K",
        description="stories260K (bundled), a Hugging Face model folder or a llama2.c .bin "
        "(Python: also an in-memory transformers model)",
    )
    block_size: int = Field(16, description="tokens per block")
    num_blocks: int | None = Field(
        None,
        description="blocks per KV group, the reserved null block included, >= 2 (default: "
        "sized from kv_cache_memory_bytes, else every sequence at full length, capped at "
        "1 GiB of cache)",
    )
    kv_cache_memory_bytes: int | None = Field(
        None, description="KV cache budget in bytes (used when num_blocks is unset)"
    )
    max_num_seqs: int = Field(256, description="most sequences running at once")
    max_num_batched_tokens: int = Field(
        2048, description="token budget per step (chunked prefill beyond it)"
    )
    max_model_len: int | None = Field(
        None, description="longest sequence in tokens (default, and most: the model's)"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse cached blocks of a shared prompt prefix"
    )
    kv_cache_dtype: KVCacheDType = Field("auto", description="KV cache storage dtype")
    backend: str = Field("auto", description="attention backend: auto or a registered name")
    dtype: ModelDType = Field("float32", description="model dtype")
    seed: int = Field(0, description="engine seed (sampling of requests without a seed)")
    device: str = Field(
        "cpu", description="torch device: cpu, cuda or cuda:N (must exist when built)"
    )
    num_threads: int | None = Field(
        None,
        description="CPU compute threads, process-wide (default 1: the fast setting on a "
        "small or shared machine, docs/benchmarks.md 'Threads'; 0 = torch's default, one "
        "per core)",
    )
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="fcfs (arrival order) or priority (each request's priority, lower "
        "first, FCFS within one)",
    )
    kv_retention_max_share: float = Field(
        DEFAULT_RETENTION_MAX_SHARE,
        description="most of the usable KV blocks kv_retention policies may hold at a "
        "raised priority, in [0, 1] (0 = retention off)",
    )
    kv_host_tier_bytes: int = Field(
        0,
        description="host-memory KV tier capacity in bytes: evicted prefix blocks are kept "
        "there and promoted back on a hit (0 = none)",
    )
    kv_disk_tier_bytes: int = Field(
        0, description="local-disk KV tier capacity in bytes (needs kv_disk_tier_path; 0 = none)"
    )
    kv_disk_tier_path: str | None = Field(
        None,
        description="directory of the disk KV tier (created if missing; survives restarts; "
        "one subdirectory per model/cache-layout fingerprint)",
    )
    preemption_mode: PreemptionMode = Field(
        "recompute",
        description="recompute (free the blocks) or swap (copy a preempted sequence's KV to "
        "host memory and back when the cost model says it is cheaper)",
    )
    swap_space_bytes: int = Field(
        1 << 30,
        description="host bytes for swapped-out sequences (preemption_mode swap; default "
        "1 GiB, sized for a CPU machine; vLLM's swap_space default is 4 GiB per GPU)",
    )
    generation_config: str = Field(
        "auto",
        description="where request defaults come from (vLLM's generation_config): auto "
        "reads the model folder's generation_config.json, vllm or none uses none, a folder "
        "reads that folder's file; the model folder's EOS ids stop generation in every mode",
    )
    kv_pool: KVPoolKind = Field(
        "unified",
        description="unified: one block pool for every KV group (a sliding-window group "
        "holds only its window's blocks); per_group: one pool per KV group, each sized "
        "for full-length sequences (docs/architecture.md, 'One pool for every kind of layer')",
    )
    state_snapshot_share: float = Field(
        0.1,
        description="hybrid models (recurrent layers): share of the cache memory, after "
        "one live state slot per max_num_seqs, given to recurrent-state snapshots for "
        "prefix caching (the rest holds KV blocks); with num_blocks given, snapshots get "
        "share / (1 - share) of the KV bytes; at most one snapshot per usable KV block "
        "(0 = no snapshots: no prefix hits on a hybrid)",
    )
    state_snapshot_slots: int | None = Field(
        None,
        description="hybrid models: recurrent-state snapshot slots, overriding "
        "state_snapshot_share (None = from the share)",
    )
    state_share_threshold: int = Field(
        2,
        description="hybrid models: requests that must have passed a block boundary "
        "before it is predicted shared and snapshotted (docs/architecture.md, 'Recurrent "
        "state')",
    )
    state_predicted_share: float = Field(
        0.25,
        description="hybrid models: most share of the snapshot slots that predicted-shared "
        "boundaries may hold, in [0, 1] (0 = only prompt and end-of-sequence snapshots)",
    )
    state_decode_snapshots: bool = Field(
        True,
        description="hybrid models: take rolling decode snapshots, so a finished sequence "
        "keeps its state at its last full block (the next turn of a conversation starts "
        "there); False for traffic whose outputs never come back in a later prompt",
    )
    speculative_config: dict[str, Any] | None = Field(
        None,
        description="speculative decoding (vLLM's speculative_config, a JSON object on the "
        'command line): {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_max": M, "prompt_lookup_min": m, "disable_by_batch_size": B, '
        '"draft_policy": "adaptive" | "fixed"} (docs/user-guide.md, '
        "'Speculative decoding'); None = off",
    )

    def __init__(self, /, **data: Any) -> None:
        unknown = sorted(set(data) - set(type(self).model_fields))
        if unknown:
            raise UnknownFieldError(
                f"{unknown[0]}: expected an EngineConfig field ("
                f"{', '.join(type(self).model_fields)}), got an unknown keyword"
            )
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc)) from None

    @field_validator("*", mode="before")
    @classmethod
    def _rule(cls, v: Any, info: Any) -> Any:
        return check_engine_field(info.field_name, v)

    @model_validator(mode="after")
    def _tiers(self) -> EngineConfig:
        # cross-field rules of the KV tiers
        path, disk = self.kv_disk_tier_path, self.kv_disk_tier_bytes
        if disk and path is None:
            raise SpecError(
                f"kv_disk_tier_path: expected a directory when kv_disk_tier_bytes={disk}, got None"
            )
        if path is not None and not disk:
            raise SpecError(
                f"kv_disk_tier_bytes: expected > 0 with kv_disk_tier_path={path!r}, got 0"
            )
        if (self.kv_host_tier_bytes or disk) and not self.enable_prefix_caching:
            raise SpecError(
                "enable_prefix_caching: expected True with a KV tier (tiers hold prefix-cache "
                "blocks), got False"
            )
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments of ``LLMEngine.from_config`` (None values are
        dropped: the engine's defaults decide)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}
