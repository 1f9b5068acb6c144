"""Hypothesis strategies for paged-attention cases, sized by a per-backend budget.

``attention_cases(budget, capabilities)`` draws everything the conformance suite
varies: head_dim (8 … 256), GQA ratios 1/2/4/8 and MQA, block_size 1..256, windows
smaller and larger than the context, soft cap on/off, explicit scales, every query
dtype and kv dtype, per-tensor/per-head fp8 scales, physical block ids as a random
permutation (or the top of the pool), pools above 65,535 blocks (only for tiny rows,
so tensors stay small), and sequence lengths ending exactly on, just before and just
after a block boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from hypothesis import strategies as st

from kvpage.attention.protocol import BackendCapabilities
from kvpage.specs import make_attention_spec
from kvpage.testing.cases import AttentionCase, split_block_ids

HEAD_DIMS = (8, 16, 64, 80, 96, 112, 128, 256)
GQA_RATIOS = (1, 2, 4, 8)
BOUNDARY_BLOCK_SIZES = (1, 2, 3, 4, 7, 8, 16, 32, 64, 128, 256)
#: pools larger than 2**16 blocks catch 16-bit block-id truncation
HUGE_POOL_MIN = 65_536 + 1


@dataclass(frozen=True)
class TestBudget:
    """How big and how many cases a backend can afford (simulators are slow).

    Attributes:
        example_fraction: multiplies the Hypothesis profile's ``max_examples``.
        max_head_dim / max_q_heads / max_kv_heads: shape limits.
        max_seq_len: longest sequence (tokens).
        max_seqs: most sequences per step.
        max_block_size: largest block size drawn.
        huge_pools: draw pools above 65,535 blocks (tiny rows only).
        max_pool_bytes: cap on the cache size of a drawn case.
    """

    __test__ = False  # not a pytest class

    example_fraction: float = 1.0
    max_head_dim: int = 256
    max_q_heads: int = 16
    max_kv_heads: int = 4
    max_seq_len: int = 80
    max_seqs: int = 4
    max_block_size: int = 256
    huge_pools: bool = True
    max_pool_bytes: int = 16 * 2**20
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    kv_dtypes: tuple[str, ...] = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
    extra: dict[str, object] = field(default_factory=dict)

    def examples(self, base: int) -> int:
        """Examples to run given the profile's ``max_examples`` ``base`` (at least 1)."""
        return max(1, math.ceil(base * self.example_fraction))


#: what simulated backends get when they declare no ``test_budget`` themselves
SIMULATOR_BUDGET = TestBudget(
    example_fraction=0.25,
    max_head_dim=64,
    max_q_heads=8,
    max_kv_heads=2,
    max_seq_len=24,
    max_seqs=2,
    max_block_size=16,
    huge_pools=False,
    max_pool_bytes=2**20,
)


def budget_for(backend: object, device: torch.device | str) -> TestBudget:
    """The budget of ``backend`` on ``device``.

    A backend may define ``test_budget`` as a ``TestBudget``, a mapping of its fields,
    or a callable ``(device) -> TestBudget | mapping``. Otherwise: the default budget,
    except that plugin backends running on the CPU (interpreters / simulators) get
    ``SIMULATOR_BUDGET``.
    """
    dev = torch.device(device)
    hook = getattr(backend, "test_budget", None)
    if callable(hook):
        hook = hook(dev)
    if isinstance(hook, TestBudget):
        return hook
    if isinstance(hook, dict):
        return replace(TestBudget(), **hook)
    if dev.type == "cpu" and getattr(backend, "name", "") != "torch":
        return SIMULATOR_BUDGET
    return TestBudget()


def _allowed(values: tuple, caps_values: frozenset) -> list:  # type: ignore[type-arg]
    return [v for v in values if not caps_values or v in caps_values]


def _head_dims(b: TestBudget, caps: BackendCapabilities | None) -> list[int]:
    dims = [d for d in HEAD_DIMS if d <= b.max_head_dim]
    if caps is not None:
        dims = _allowed(tuple(dims), caps.head_dims)
        if caps.max_head_dim:
            dims = [d for d in dims if d <= caps.max_head_dim]
    return dims or [8]


@st.composite
def seq_lens_near_boundaries(draw: st.DrawFn, block_size: int, max_len: int) -> int:
    """A sequence length in ``[1, max_len]``, biased to ``k*block_size + {-1, 0, +1}``."""
    kmax = max_len // block_size
    if kmax >= 1 and draw(st.booleans()):
        k = draw(st.integers(1, kmax))
        n = k * block_size + draw(st.sampled_from((-1, 0, 1)))
        return max(1, min(max_len, n))
    return draw(st.integers(1, max_len))


@st.composite
def attention_cases(
    draw: st.DrawFn,
    budget: TestBudget = TestBudget(),
    capabilities: BackendCapabilities | None = None,
    *,
    mode: str = "any",
    kv_dtypes: tuple[str, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
    sliding_window: bool | None = None,
    soft_cap: bool | None = None,
    sinks: bool | None = None,
) -> AttentionCase:
    """Draw an ``AttentionCase`` within ``budget`` and the backend's ``capabilities``.

    Args:
        mode: ``"decode"`` (every query length 1), ``"prefill"`` (full or chunked
            prefill with cached context) or ``"any"``.
        kv_dtypes / dtypes: restrict the drawn kv dtypes / query dtypes.
        sliding_window / soft_cap / sinks: force the feature on (True) or off
            (False). Attention sinks are drawn only for backends that declare
            ``capabilities.sinks`` (or without capabilities): per query head a logit
            from well below to well above the logits (-30 .. 30: a sink that takes
            almost all the weight is the case where an unscaled ``exp`` overflows).
    """
    caps = capabilities
    b = budget
    qd = [d for d in (dtypes or b.dtypes) if caps is None or d in caps.query_dtypes]
    kd = [d for d in (kv_dtypes or b.kv_dtypes) if caps is None or d in caps.kv_dtypes]
    dtype = draw(st.sampled_from(qd or ["float32"]))
    kv_dtype = draw(st.sampled_from(kd or ["auto"]))
    head_dim = draw(st.sampled_from(_head_dims(b, caps)))
    ratios = list(GQA_RATIOS) if caps is None or caps.gqa else [1]
    kv_heads = draw(st.integers(1, b.max_kv_heads))
    ratio = draw(st.sampled_from([r for r in ratios if kv_heads * r <= b.max_q_heads] or [1]))
    if draw(st.integers(0, 5)) == 0 and (caps is None or caps.gqa):  # MQA
        kv_heads, ratio = 1, draw(st.sampled_from([r for r in (2, 4, 8) if r <= b.max_q_heads]))
    sizes = [s for s in BOUNDARY_BLOCK_SIZES if s <= b.max_block_size]
    if caps is not None and caps.block_sizes:
        sizes = [s for s in sizes if s in caps.block_sizes] or sorted(caps.block_sizes)[:1]
    if caps is None or not caps.block_sizes:
        block_size = draw(st.one_of(st.sampled_from(sizes), st.integers(1, b.max_block_size)))
    else:
        block_size = draw(st.sampled_from(sizes))
    num_seqs = draw(st.integers(1, b.max_seqs))
    seq_lens = [draw(seq_lens_near_boundaries(block_size, b.max_seq_len)) for _ in range(num_seqs)]
    if mode == "decode" or (mode == "any" and draw(st.booleans())):
        query_lens = [1] * num_seqs
    else:
        query_lens = [draw(st.one_of(st.just(n), st.integers(1, n), st.just(1))) for n in seq_lens]
    use_window = sliding_window
    if use_window is None:
        use_window = (caps is None or caps.sliding_window) and draw(st.booleans())
    window = draw(st.integers(1, b.max_seq_len + 8)) if use_window else None
    use_cap = soft_cap
    if use_cap is None:
        use_cap = (caps is None or caps.logits_soft_cap) and draw(st.booleans())
    cap = draw(st.sampled_from((1.0, 5.0, 30.0, 50.0))) if use_cap else None
    scale = draw(st.one_of(st.none(), st.sampled_from((0.02, 0.1, 0.3, 1.0))))
    use_sinks = sinks
    if use_sinks is None:
        use_sinks = (caps is None or caps.sinks) and draw(st.integers(0, 3)) == 0
    sink_values = None
    if use_sinks:
        pool = st.sampled_from((-30.0, -2.0, -0.5, 0.0, 0.7, 1.5, 3.0, 30.0))
        sink_values = tuple(
            draw(st.one_of(pool, st.floats(-4.0, 4.0, width=32))) for _ in range(kv_heads * ratio)
        )
    spec = make_attention_spec(
        num_q_heads=kv_heads * ratio,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        scale=scale,
        sliding_window=window,
        logits_soft_cap=cap,
        sinks=use_sinks,
    )
    needed = [-(-n // block_size) for n in seq_lens]
    total = sum(needed)
    row_bytes = 2 * block_size * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    huge_ok = b.huge_pools and row_bytes * HUGE_POOL_MIN <= b.max_pool_bytes
    if huge_ok and draw(st.integers(0, 4)) == 0:
        num_blocks = draw(
            st.integers(HUGE_POOL_MIN, max(HUGE_POOL_MIN, b.max_pool_bytes // row_bytes))
        )
    else:
        num_blocks = total + 1 + draw(st.integers(0, 8))
    placement = draw(st.sampled_from(("permutation", "permutation", "top", "sequential")))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if placement == "top":
        ids = list(range(num_blocks - 1, num_blocks - 1 - total, -1))
    elif placement == "sequential":
        ids = list(range(1, total + 1))
    elif num_blocks > 4 * total + 64:  # sparse pool: sample without a full permutation
        chosen: set[int] = set()
        ids = []
        while len(ids) < total:
            x = int(torch.randint(1, num_blocks, (1,), generator=gen))
            if x not in chosen:
                chosen.add(x)
                ids.append(x)
    else:
        ids = (torch.randperm(num_blocks - 1, generator=gen)[:total] + 1).tolist()
    tables = [tuple(t) for t in split_block_ids(ids, needed)]
    granularity = draw(st.sampled_from(("per_tensor", "per_head")))
    nsc = kv_heads if granularity == "per_head" else 1
    ks = tuple(draw(st.sampled_from((0.05, 0.25, 0.5, 1.0, 2.0))) for _ in range(nsc))
    vs = tuple(draw(st.sampled_from((0.05, 0.25, 0.5, 1.0, 2.0))) for _ in range(nsc))
    magnitude = draw(st.sampled_from((1.0, 1.0, 0.1, 4.0)))
    return AttentionCase(
        spec=spec,
        dtype=dtype,
        kv_dtype=kv_dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        seq_lens=tuple(seq_lens),
        query_lens=tuple(query_lens),
        block_tables=tuple(tables),
        seed=seed,
        magnitude=magnitude,
        scale_granularity=granularity,
        k_scale=ks,
        v_scale=vs,
        sinks=sink_values,
    )


@st.composite
def chunkings(draw: st.DrawFn, n: int) -> list[int]:
    """A split of ``n`` tokens into positive chunk lengths (one-shot, token-by-token or
    anything between)."""
    kind = draw(st.sampled_from(("one", "tokens", "random")))
    if kind == "one" or n <= 1:
        return [n]
    if kind == "tokens":
        return [1] * n
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=min(6, n - 1)))))
    bounds = [0, *cuts, n]
    return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]


@st.composite
def layouts(
    draw: st.DrawFn, seq_lens: tuple[int, ...], budget: TestBudget = TestBudget()
) -> tuple[int, list[list[int]], int]:
    """Another (block_size, block_tables, num_blocks) for the same sequences: a new
    block size and a random physical permutation."""
    bs = draw(st.sampled_from([s for s in BOUNDARY_BLOCK_SIZES if s <= budget.max_block_size]))
    needed = [-(-n // bs) for n in seq_lens]
    total = sum(needed)
    num_blocks = total + 1 + draw(st.integers(0, 4))
    perm = draw(st.permutations(list(range(1, num_blocks))))
    tables = split_block_ids(perm, needed)
    return bs, tables, num_blocks
