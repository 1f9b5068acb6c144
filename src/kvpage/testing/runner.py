"""Run an attention case through a backend and check it against the reference.

These are the checks of the conformance suite as plain functions, so out-of-tree
backend authors can call them from their own tests (or a notebook)::

    from kvpage.testing import attention_cases, check_attention_case
    @given(attention_cases())
    def test_mine(case):
        check_attention_case(MyBackend(), case, "cuda")
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from kvpage.attention.metadata import KVCache
from kvpage.attention.plan import StepPlan
from kvpage.attention.protocol import AttentionBackend
from kvpage.attention.reference import reference_attention, reference_contiguous
from kvpage.specs import AttentionSpec
from kvpage.testing.cases import (
    AttentionCase,
    clone_cache,
    materialize,
    poisoned_cache,
)
from kvpage.testing.tolerances import (
    QUANT_ERROR_BOUNDS,
    assert_bits_equal,
    assert_close,
    tolerance_for,
)

__all__ = [
    "assert_cache_bits_equal",
    "check_attention_case",
    "check_quantization_error",
    "check_write_kv_case",
    "error_scale",
    "run_attention",
    "run_plugin_case",
]


def assert_cache_bits_equal(actual: KVCache, expected: KVCache, *, what: str) -> None:
    """Bit-exact comparison of two caches (kv and int8 token scales)."""
    assert_bits_equal(actual.kv, expected.kv, what=f"{what}.kv")
    if expected.token_scales is not None:
        assert actual.token_scales is not None, f"{what}.token_scales: expected a tensor"
        assert_bits_equal(actual.token_scales, expected.token_scales, what=f"{what}.token_scales")


def run_attention(
    backend: AttentionBackend[Any],
    query: torch.Tensor,
    cache: KVCache,
    plan: StepPlan,
    spec: AttentionSpec,
    *,
    pad: int = 3,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Call ``backend.forward`` with a NaN-poisoned output buffer that is a view into a
    wider buffer (``pad`` extra NaN columns past head_dim), and check that only the
    view was written and the method returned it (or a tensor equal to it).

    ``sinks`` (attention-sink logits) is passed on only when given, so backends
    without sink support need no ``sinks`` parameter.

    Returns:
        the output ``[rows, num_q_heads, head_dim]``.
    """
    rows, hq, d = query.shape
    wide = torch.full((rows, hq, d + pad), float("nan"), dtype=query.dtype, device=query.device)
    out = wide[..., :d]
    if sinks is None:
        res = backend.forward(query, cache, plan, spec, out=out)
    else:
        res = backend.forward(query, cache, plan, spec, out=out, sinks=sinks)
    if pad and not bool(torch.isnan(wide[..., d:]).all()):
        raise AssertionError("out: expected nothing written past head_dim, got writes")
    if res.data_ptr() != out.data_ptr():
        assert_bits_equal(res, out, what="returned tensor vs out buffer")
    return out


def check_attention_case(
    backend: AttentionBackend[Any],
    case: AttentionCase,
    device: torch.device | str = "cpu",
    *,
    check_quant_error: bool = True,
) -> torch.Tensor:
    """Run ``case`` through ``backend.plan`` and ``backend.forward`` and compare with
    the float64 reference on the same cache.

    Checks: output within ``tolerance_for(query dtype)`` of the reference on the
    (dequantized) cache; finite; nothing written past head_dim; the cache unchanged;
    and, for int8/fp8 caches without saturation, the reference on the dequantized
    cache within ``QUANT_ERROR_BOUNDS`` of the reference on the exact K/V.

    Returns:
        the backend output (on ``device``).

    Raises:
        AssertionError: any check fails (messages name the case and the element).
    """
    m = materialize(case, device)
    before = clone_cache(m.cache)
    plan = backend.plan(m.meta)
    out = run_attention(backend, m.query, m.cache, plan, case.spec, sinks=m.sinks)
    assert_cache_bits_equal(m.cache, before, what="cache after attention")
    ref = reference_attention(m.query, m.cache, m.meta, case.spec, m.sinks)
    tol = tolerance_for(case.torch_dtype)
    scale = error_scale(case, m.keys, m.values, m.query)
    kind = "decode" if plan.is_decode else "prefill"
    assert_close(out, ref, tol, scale=scale, what=f"{kind} vs reference [{case.describe()}]")
    if check_quant_error and case.kv_dtype != "auto":
        check_quantization_error(case, m.keys, m.values, m.query, ref)
    return out


def _saturates(case: AttentionCase, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
    if not case.kv_dtype.startswith("fp8"):
        return False
    fmax = 448.0 if case.kv_dtype == "fp8_e4m3" else 57344.0
    for xs, sc in ((keys, case.k_scale), (values, case.v_scale)):
        for x in xs:
            if x.numel() and float(x.float().abs().max()) / min(sc) > fmax:
                return True
    return False


def _max_logit_terms(case: AttentionCase, query: torch.Tensor, keys: list[torch.Tensor]) -> float:
    """``scale * max over (token, head, key) of sum_d |q_d| * keys_d`` (keys >= 0)."""
    g = case.spec.num_queries_per_kv
    best, start = 0.0, 0
    for k, q in zip(keys, case.query_lens):
        qq = query[start : start + q].detach().cpu().double().abs()
        start += q
        if not q or not k.numel():
            continue
        kk = k.detach().cpu().double().repeat_interleave(g, dim=1)
        best = max(best, float(torch.einsum("thd,nhd->thn", qq, kk).max()))
    return best * case.spec.scale


def error_scale(
    case: AttentionCase, keys: list[torch.Tensor], values: list[torch.Tensor], query: torch.Tensor
) -> float:
    """``E = max|V| * max(1, kappa / 8)``, the unit of ``Tolerance.atol`` for attention
    outputs (see ``kvpage.testing.tolerances``)."""
    vmax = max([float(v.float().abs().max()) for v in values if v.numel()] + [1e-30])
    kappa = _max_logit_terms(case, query, [k.float().abs() for k in keys])
    return vmax * max(1.0, kappa / 8.0)


def _element_bound(case: AttentionCase, x: torch.Tensor, scales: tuple[float, ...]) -> torch.Tensor:
    b = QUANT_ERROR_BOUNDS[case.kv_dtype]
    xa = x.detach().cpu().double().abs()
    s = torch.tensor(scales, dtype=torch.float64)
    s = s.view(-1, 1) if s.numel() > 1 else s.view(())  # per head: [num_kv_heads, 1]
    return b.rel * xa + b.row_rel * xa.amax(dim=-1, keepdim=True) + b.abs_min * s


def check_quantization_error(
    case: AttentionCase,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query: torch.Tensor,
    ref_dequant: torch.Tensor,
) -> None:
    """Bound what quantization itself costs: the reference on the dequantized cache vs
    the reference on the exact K/V. With per-element errors from
    ``QUANT_ERROR_BOUNDS`` (K error ``dk``, V error ``dv``), logits move by at most
    ``d = scale * max sum_d |q_d| dk_d`` and the output by at most
    ``min(exp(2d) - 1, 2) * max|V| + max dv`` (two convex combinations of V rows differ
    by at most ``2 max|V| + max dv``). Skipped when fp8 values saturate (the error is
    then unbounded by design)."""
    if _saturates(case, keys, values):
        return
    start = 0
    for k, v, n, q in zip(keys, values, case.seq_lens, case.query_lens):
        if not q:
            continue
        qs = query[start : start + q]
        exact = reference_contiguous(
            qs.cpu(), k.cpu(), v.cpu(), case.spec, n - q, case.sinks_tensor()
        )
        dk = _element_bound(case, k, case.k_scale)
        dv = _element_bound(case, v, case.v_scale)
        sub = replace(case, seq_lens=(n,), query_lens=(q,))
        d = _max_logit_terms(sub, qs, [dk])
        vmax = float(v.double().abs().max())
        # both outputs are convex combinations of V rows, so they differ by at most
        # 2 max|V| + max dV whatever the logit shift: the factor is capped at 2 (which
        # also keeps exp() from overflowing when d is large, e.g. head_dim 256, scale 1)
        factor = 2.0 if 2 * d >= math.log(3.0) else math.expm1(2 * d)
        bound = factor * vmax + float(dv.max()) + 1e-6 * max(vmax, 1e-30)
        got = ref_dequant[start : start + q].cpu().double()
        err = float((got - exact).abs().max())
        if err > bound:
            raise AssertionError(
                f"quantization error ({case.kv_dtype}): expected <= {bound:.4g} "
                f"(logit shift <= {d:.3g}, max|V| {vmax:.3g}, max dV {float(dv.max()):.3g}), "
                f"got {err:.4g} [{case.describe()}]"
            )
        start += q


def check_write_kv_case(
    backend: AttentionBackend[Any],
    case: AttentionCase,
    device: torch.device | str = "cpu",
    *,
    skip_every: int = 0,
) -> None:
    """Write the case's new tokens with the backend and with the reference writer into
    two identical NaN-poisoned caches (context already written) and require
    bit-identical caches: mapped slots equal the reference's, every other slot keeps
    its bits, and slots set to -1 (every ``skip_every``-th token) are skipped.

    Raises:
        AssertionError: any bit differs.
    """
    from kvpage.attention.reference import reference_write_kv

    m = materialize(case, device)
    slots = m.slot_mapping.clone()
    if skip_every:
        slots[::skip_every] = -1
    # un-write the new tokens so the write is observable: start from a fresh poison
    mine = poisoned_cache(case, device)
    mine.kv.copy_(m.cache.kv)
    if mine.token_scales is not None and m.cache.token_scales is not None:
        mine.token_scales.copy_(m.cache.token_scales)
    fresh = poisoned_cache(case, device)
    keep = slots >= 0
    if bool(keep.any()):
        idx = slots[keep]
        bs = case.block_size
        for c in (mine,):
            c.kv.view(torch.uint8)[:, idx // bs, idx % bs] = fresh.kv.view(torch.uint8)[
                :, idx // bs, idx % bs
            ]
            if c.token_scales is not None and fresh.token_scales is not None:
                c.token_scales[:, idx // bs, idx % bs] = fresh.token_scales[:, idx // bs, idx % bs]
    theirs = clone_cache(mine)
    backend.write_kv(m.new_keys, m.new_values, mine, slots)
    reference_write_kv(m.new_keys, m.new_values, theirs, slots)
    assert_cache_bits_equal(mine, theirs, what=f"write_kv [{case.describe()}]")


def run_plugin_case(
    backend: AttentionBackend[Any], case: AttentionCase, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared plugin harness (what tests/backends run for every plugin): the case's
    context is written by the reference writer, its new tokens by ``backend.write_kv``
    (with the step's plan, ``plan=``, as the model's layers call it) over NaN-poisoned
    slots — required bit-identical to the reference writer — then
    ``backend.plan`` and ``backend.forward`` into a NaN-poisoned strided ``out``
    (``run_attention``); the cache must be unchanged by ``forward``.

    Returns:
        (the backend's output on ``device``, the float64 reference on the CPU), for the
        caller's tolerance check (``assert_close`` with ``tolerance_for``).

    Raises:
        AssertionError: a written bit differs, ``out`` was misused, or ``forward``
            changed the cache.
    """
    m = materialize(case, device)
    expected = clone_cache(m.cache)  # context and new tokens by the reference writer
    mine = clone_cache(m.cache)
    bs = case.block_size
    for s in m.slot_mapping.to("cpu").tolist():  # poison the new tokens' slots
        mine.kv[:, s // bs, s % bs] = float("nan") if mine.kv.is_floating_point() else 0
        if mine.token_scales is not None:
            mine.token_scales[:, s // bs, s % bs] = float("nan")
    plan = backend.plan(m.meta)  # the step's plan, as the model's layers pass it (unchecked)
    backend.write_kv(m.new_keys, m.new_values, mine, m.slot_mapping, plan=plan)
    assert_cache_bits_equal(mine, expected, what=f"write_kv [{case.describe()}]")
    out = run_attention(backend, m.query, mine, plan, case.spec, sinks=m.sinks)
    assert_cache_bits_equal(mine, expected, what=f"cache after forward [{case.describe()}]")
    ref = reference_attention(
        m.query.cpu(), clone_cache(expected), m.meta, case.spec, case.sinks_tensor()
    )
    return out, ref
