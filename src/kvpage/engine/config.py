"""Engine configuration and construction: model -> CacheSpec -> backend -> caches.

Sizing rules (documented defaults):

* ``max_model_len`` = the model's ``max_position_embeddings`` (512 for stories260K)
  unless given.
* ``num_blocks`` (of the unified pool, or per KV group with per-group pools; including
  the reserved null block): given -> used as is; else ``kv_cache_memory_bytes`` given
  -> ``(kv_cache_memory_bytes - fixed scale bytes) // bytes_per_block``; else enough
  for every sequence at full length, ``ceil(max_num_seqs * max_model_len /
  block_size) x G + 1`` (``G`` = KV groups sharing a unified pool, else 1), capped at
  :data:`DEFAULT_KV_CACHE_BYTES_CAP` bytes of cache (and at least enough for one
  full-length sequence).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpage.engine.queue_policy import SCHEDULING_POLICIES, SchedulingPolicy
from kvpage.errors import SpecError
from kvpage.specs import CacheSpec, KVCacheDType, ModelDType

if TYPE_CHECKING:
    from kvpage.attention.metadata import KVCache
    from kvpage.attention.protocol import AttentionBackend
    from kvpage.cache import KVCacheManager
    from kvpage.cache.tiered import TieredCache
    from kvpage.engine.runner import ModelRunner
    from kvpage.engine.scheduler import Scheduler
    from kvpage.models.model import ModelRunnerModel

#: most bytes the default (unsized) KV cache takes: 1 GiB
DEFAULT_KV_CACHE_BYTES_CAP = 1 << 30
#: share of the usable KV blocks retention policies may hold by default
DEFAULT_RETENTION_MAX_SHARE = 0.5
#: CPU threads when ``num_threads`` is None: 1, the configuration that is never the
#: pathological one on a small or shared machine (see ``EngineConfig.num_threads``)
DEFAULT_NUM_THREADS = 1


@dataclass
class EngineConfig:
    """All knobs of ``LLM`` / ``LLMEngine.from_config`` (vLLM's names).

    Attributes:
        model: ``"stories260K"``, a Hugging Face model folder, or an in-memory
            ``transformers`` model (anything ``kvpage.models.load_model`` takes).
        block_size: tokens per block.
        num_blocks: blocks per KV group (None = derived, see the module docstring).
        kv_cache_memory_bytes: cache budget in bytes (used when num_blocks is None).
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget per step (chunked prefill beyond it).
        max_model_len: longest sequence in tokens (None = the model's).
        enable_prefix_caching: reuse committed blocks across requests.
        kv_cache_dtype: ``auto``, ``int8``, ``fp8_e4m3`` or ``fp8_e5m2``.
        backend: ``"auto"`` or a backend name (``kvpage.backends``).
        dtype: model dtype (float32, float16, bfloat16).
        seed: engine seed (sampling of requests without their own seed).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (checked: must exist here).
        scheduling_policy: ``"fcfs"`` (arrival order) or ``"priority"`` (each request's
            ``priority``, lower first, FCFS within a priority; vLLM's
            ``--scheduling-policy``): :mod:`kvpage.engine.queue_policy`.
        num_threads: CPU compute threads, set process-wide with
            ``torch.set_num_threads`` before the model loads: None =
            :data:`DEFAULT_NUM_THREADS` (1), 0 = torch's default (one per core), N = N.
            Measured on a shared 2-core machine (docs/benchmarks.md, "Threads"): torch's
            default made the README example 19x slower than 1 thread (12.4 s vs 0.65 s)
            and up to 200x under heavier load, because every op waits at a barrier for
            a thread the OS has descheduled while its partner spins (``import kvpage``
            sets ``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=5000``, a short spin
            then sleep, against that when it loads before torch). Raise it on cores
            you own.
        kv_retention_max_share: most of the usable blocks (a share in [0, 1]) that
            requests' ``kv_retention`` policies may hold free at a raised priority
            (default 0.5; 0 = retention off). The cap is also bounded so that one
            ``max_model_len`` request always fits without evicting a retained block.
        kv_host_tier_bytes: capacity of the host-memory KV tier in payload bytes (0 =
            no host tier): cached blocks evicted from the pool are kept there and
            promoted back by a prefix lookup (``kvpage.cache.tiered``; docs/architecture.md,
            "KV tiers").
        kv_disk_tier_bytes: capacity of the local-disk KV tier in payload bytes (0 = no
            disk tier); needs ``kv_disk_tier_path``. Survives a restart.
        kv_disk_tier_path: directory of the disk tier (created if missing); files of
            another model or cache layout live in another subdirectory.
        preemption_mode: ``recompute`` (free the blocks; recompute later) or ``swap``
            (copy the preempted sequence's blocks to host memory and back when the cost
            model says that is cheaper; ``kvpage.engine.swap``).
        swap_space_bytes: host bytes for the K/V of swapped-out sequences (used with
            ``preemption_mode="swap"``; a sequence that does not fit is recomputed).
            Default 1 GiB (vLLM's ``swap_space`` default is 4 GiB per GPU; ours is
            sized for a CPU machine).
        generation_config: where request defaults come from (vLLM's
            ``generation_config``): ``"auto"`` (default) reads the model folder's
            ``generation_config.json``; ``"vllm"`` or ``"none"`` uses none (kvpage's /
            vLLM's own defaults); a folder path reads that folder's file. Only the
            sampling defaults depend on it: the EOS ids of the model folder's file always
            stop generation (vLLM likewise). See :func:`resolve_generation_config`.
    """

    model: Any = "stories260K"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: KVCacheDType = "auto"
    backend: str = "auto"
    dtype: ModelDType = "float32"
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"
    kv_retention_max_share: float = DEFAULT_RETENTION_MAX_SHARE
    kv_host_tier_bytes: int = 0
    kv_disk_tier_bytes: int = 0
    kv_disk_tier_path: str | None = None
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 1 << 30
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        check_tier_config(self)
        gc = self.generation_config
        if not isinstance(gc, str) or not gc:
            raise SpecError(
                f"generation_config: expected 'auto', 'vllm', 'none' or a folder path, got {gc!r}"
            )
        if gc not in GENERATION_CONFIG_MODES and not Path(gc).expanduser().is_dir():
            raise SpecError(
                f"generation_config: expected 'auto', 'vllm', 'none' or an existing folder, "
                f"got {gc!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{name}: expected an int >= 1, got {v!r}")
        for name, lo in (("num_blocks", 2), ("kv_cache_memory_bytes", 1), ("max_model_len", 1)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                why = " (block 0 is the reserved null block)" if name == "num_blocks" else ""
                raise SpecError(f"{name}: expected None or an int >= {lo}{why}, got {v!r}")
        nt = self.num_threads
        if nt is not None and (isinstance(nt, bool) or not isinstance(nt, int) or nt < 0):
            raise SpecError(
                f"num_threads: expected None (default 1), 0 (torch's default) or an int >= 1, "
                f"got {nt!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise SpecError(
                f"enable_prefix_caching: expected a bool, got {self.enable_prefix_caching!r}"
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise SpecError(f"backend: expected 'auto' or a backend name, got {self.backend!r}")
        check_device(self.device)
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise SpecError(f"dtype: expected float32, float16 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3", "fp8_e5m2"):
            raise SpecError(
                f"kv_cache_dtype: expected auto, int8, fp8_e4m3 or fp8_e5m2, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise SpecError(
                f"scheduling_policy: expected 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        rs = self.kv_retention_max_share
        if isinstance(rs, bool) or not isinstance(rs, (int, float)) or not 0 <= rs <= 1:
            raise SpecError(f"kv_retention_max_share: expected a number in [0, 1], got {rs!r}")
        sd = self.seed
        if isinstance(sd, bool) or not isinstance(sd, int) or not 0 <= sd < 2**63:
            raise SpecError(f"seed: expected an int in [0, 2**63 - 1], got {sd!r}")


#: the ``generation_config`` values that are not folder paths
GENERATION_CONFIG_MODES = ("auto", "vllm", "none")


def resolve_generation_config(config: EngineConfig) -> tuple[str | None, dict[str, Any]]:
    """The generation config an engine uses for request defaults.

    Returns:
        ``(folder read or None, the fields its generation_config.json sets)``:
        ``"auto"`` reads ``config.model`` when that is a folder (the bundled model and
        in-memory models have none); ``"vllm"`` / ``"none"`` read nothing; a folder path
        reads it. ``kvpage.models.generation_config.sampling_defaults`` turns the
        fields into SamplingParams defaults.

    Raises:
        SpecError: the file is malformed (naming it).
    """
    from kvpage.models.generation_config import read_generation_config

    gc = config.generation_config
    if gc in ("vllm", "none"):
        return None, {}
    if gc == "auto":
        m = config.model
        if not isinstance(m, (str, Path)) or not Path(m).expanduser().is_dir():
            return None, {}
        folder = Path(m).expanduser()
    else:
        folder = Path(gc).expanduser()
    return str(folder), read_generation_config(folder)


def check_tier_config(config: EngineConfig) -> None:
    """Validate the KV tier and preemption fields of ``config``.

    Raises:
        SpecError: a capacity that is not an int >= 0, a disk tier without a path (or a
            path without a disk capacity), tiers with prefix caching off, or an unknown
            ``preemption_mode``.
    """
    for name in ("kv_host_tier_bytes", "kv_disk_tier_bytes", "swap_space_bytes"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise SpecError(f"{name}: expected an int >= 0 (bytes), got {v!r}")
    path = config.kv_disk_tier_path
    if path is not None and (not isinstance(path, str) or not path):
        raise SpecError(f"kv_disk_tier_path: expected None or a directory path, got {path!r}")
    if config.kv_disk_tier_bytes and path is None:
        raise SpecError(
            f"kv_disk_tier_path: expected a directory when kv_disk_tier_bytes="
            f"{config.kv_disk_tier_bytes}, got None"
        )
    if path is not None and not config.kv_disk_tier_bytes:
        raise SpecError(f"kv_disk_tier_bytes: expected > 0 with kv_disk_tier_path={path!r}, got 0")
    if (config.kv_host_tier_bytes or config.kv_disk_tier_bytes) and (
        config.enable_prefix_caching is False
    ):
        raise SpecError(
            "enable_prefix_caching: expected True with a KV tier (tiers hold prefix-cache "
            "blocks), got False"
        )
    if config.preemption_mode not in ("recompute", "swap"):
        raise SpecError(
            f"preemption_mode: expected 'recompute' or 'swap', got {config.preemption_mode!r}"
        )


def check_device(device: Any) -> torch.device:
    """Parse and check a torch device string: ``cpu``, or ``cuda``/``cuda:N`` with a
    CUDA build of torch and GPU N present.

    Raises:
        SpecError: ``"device: expected ..., got ..."`` for an unknown, unsupported or
            unavailable device.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SpecError(
            f"device: expected a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise SpecError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if not torch.cuda.is_available():
        why = "no CUDA device visible" if torch.version.cuda else "torch built without CUDA"
        raise SpecError(f"device: expected an available device, got {device!r} ({why})")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise SpecError(f"device: expected cuda:N with N < {count} (visible GPUs), got {device!r}")
    return dev


_fork_hook = False


def _one_thread_after_fork() -> None:
    """In a forked child: torch on one thread. GNU OpenMP's thread pool does not
    survive ``fork()``: after the parent ran parallel ops, a child's first parallel op
    can wait forever at a barrier for threads it does not have (seen with
    ``multiprocessing``'s fork start method after a 2-thread engine, and with plain
    torch matmuls); one thread never enters the pool."""
    torch.set_num_threads(1)


def apply_num_threads(num_threads: int | None) -> int:
    """Set torch's CPU thread count by the rule of ``EngineConfig.num_threads`` (None =
    :data:`DEFAULT_NUM_THREADS`, 0 = leave torch's current setting); process-wide.
    With more than one thread, a process forked from this one afterwards starts with
    torch on one thread (:func:`_one_thread_after_fork`: GNU OpenMP hangs a forked
    child's first parallel op otherwise). Returns the thread count now in effect."""
    global _fork_hook
    if num_threads is None:
        num_threads = DEFAULT_NUM_THREADS
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    n = torch.get_num_threads()
    if n > 1 and not _fork_hook:  # a forked child then starts on one thread
        os.register_at_fork(after_in_child=_one_thread_after_fork)
        _fork_hook = True
    return n


def resolve_num_blocks(
    config: EngineConfig,
    bytes_per_block: int,
    fixed_bytes: int,
    max_model_len: int,
    pool_groups: int = 1,
) -> int:
    """Blocks of the pool by the rules of the module docstring (``pool_groups``: the KV
    groups sharing one unified pool, 1 for per-group pools).

    Raises:
        SpecError: ``kv_cache_memory_bytes`` is too small for 2 blocks.
    """
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory_bytes is not None:
        n = (config.kv_cache_memory_bytes - fixed_bytes) // bytes_per_block
        if n < 2:
            raise SpecError(
                f"kv_cache_memory_bytes: expected >= {2 * bytes_per_block + fixed_bytes} "
                f"(2 blocks of {bytes_per_block} bytes), got {config.kv_cache_memory_bytes}"
            )
        return int(n)
    bs = config.block_size
    g = pool_groups
    want = -(-config.max_num_seqs * max_model_len // bs) * g + 1
    cap = max(DEFAULT_KV_CACHE_BYTES_CAP // bytes_per_block, -(-max_model_len // bs) * g + 1)
    return int(max(2, min(want, cap)))


@dataclass(frozen=True, slots=True)
class EngineComponents:
    """The parts ``build_components`` builds and ``LLMEngine`` runs.

    Attributes:
        model: the loaded model (weights on ``config.device``).
        cache_spec: the KV cache layout (block size, blocks per group, KV groups).
        backend: the attention backend running ``cache_spec``.
        kv_caches: one KV cache per layer (the backend's tensors).
        kv_cache_manager: the block allocator (prefix caching, CoW, windows).
        scheduler: the continuous-batching scheduler over ``kv_cache_manager``.
        runner: turns a SchedulerOutput into one forward pass over ``kv_caches``.
        max_model_len: longest sequence in tokens.
        tiers: the KV tiers below the pool (None = none configured).
    """

    model: ModelRunnerModel
    cache_spec: CacheSpec
    backend: AttentionBackend[Any]
    kv_caches: list[KVCache]
    kv_cache_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    tiers: TieredCache | None = None


def build_components(config: EngineConfig) -> EngineComponents:
    """Load the model, size and allocate the cache, pick the backend.

    Returns:
        The components, ready to run.

    Raises:
        SpecError: bad sizes, a KV cache too big to allocate, or ``max_model_len`` above the model's
            ``max_position_embeddings``; BackendUnavailableError: no backend can run
            the spec.
    """
    from kvpage.attention.metadata import allocate_model_kv_caches
    from kvpage.backends import select_backend
    from kvpage.cache import KVCacheManager, max_retained_blocks
    from kvpage.engine.kv_transfer import build_swapper, build_tiers
    from kvpage.engine.runner import ModelRunner
    from kvpage.engine.scheduler import Scheduler
    from kvpage.models import load_model

    device = check_device(config.device)
    apply_num_threads(config.num_threads)
    model = load_model(config.model, dtype=config.dtype, device=config.device)
    cfg = model.config
    # max_position_embeddings (GPT-2: n_positions; dynamic RoPE: times its factor)
    mpe = (
        model.arch.max_context_len
        if cfg.get("max_position_embeddings") or cfg.get("n_positions")
        else None
    )
    if config.max_model_len is not None and mpe and config.max_model_len > int(mpe):
        raise SpecError(
            f"max_model_len: expected <= {int(mpe)} (the model's max_position_embeddings), "
            f"got {config.max_model_len}"
        )
    mml = config.max_model_len or int(mpe or 2048)
    probe = model.cache_spec(config.block_size, 0, config.kv_cache_dtype)
    groups = len(probe.kv_groups) if probe.kv_pool == "unified" else 1
    num_blocks = resolve_num_blocks(
        config, probe.bytes_per_block, probe.fixed_scale_bytes, mml, groups
    )
    spec = model.cache_spec(config.block_size, num_blocks, config.kv_cache_dtype)
    backend = select_backend(spec, device, prefer=config.backend)
    try:
        kv_caches = allocate_model_kv_caches(spec, device)
    except (RuntimeError, MemoryError) as e:  # torch's CPU/CUDA out-of-memory errors
        total = spec.total_bytes
        raise SpecError(
            f"num_blocks: expected a KV cache that fits in {config.device} memory, got "
            f"{num_blocks} blocks of {config.block_size} tokens (~{total:,} bytes): "
            f"{str(e).splitlines()[0][:200]}"
        ) from None
    cap = max_retained_blocks(
        num_blocks - 1, config.kv_retention_max_share, -(-mml // config.block_size)
    )
    kvm = KVCacheManager(
        spec,
        enable_prefix_caching=config.enable_prefix_caching,
        max_retained_blocks=cap,
        max_alloc_tokens=config.max_num_batched_tokens,  # the scheduler's step budget
    )
    tiers = build_tiers(config, spec, kv_caches, kvm)
    scheduler = Scheduler(
        kvm,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=mml,
        policy=config.scheduling_policy,
    )
    scheduler.swapper = build_swapper(config, kv_caches, kvm)
    runner = ModelRunner(model, backend, kv_caches, spec, device)
    return EngineComponents(model, spec, backend, kv_caches, kvm, scheduler, runner, mml, tiers)


__all__ = [
    "DEFAULT_KV_CACHE_BYTES_CAP",
    "DEFAULT_NUM_THREADS",
    "DEFAULT_RETENTION_MAX_SHARE",
    "EngineComponents",
    "apply_num_threads",
    "EngineConfig",
    "check_device",
    "check_tier_config",
    "build_components",
    "resolve_num_blocks",
]
