"""The recurrent mixers (Mamba-2, Gated DeltaNet) on the state slots: the chunked
prefill form equals the float64 token-by-token reference; any split of a sequence into
chunks (single-token decode steps included) gives the outputs and end state of one
pass; a packed batch of several sequences equals per-sequence runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.attention.state import StateBatch, StateCache
from kvpage.models.gated_deltanet import GatedDeltaNet, delta_rule_chunked, delta_rule_step
from kvpage.models.mamba2_mixer import Mamba2Mixer
from kvpage.specs.state import StateSpec

HIDDEN = 24


def _randomize(m: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 3 + 0.5))
            elif name in ("dt_bias", "D"):
                p.copy_(r * 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.2 * r)
            else:
                p.copy_(r * 0.3)
    return m.requires_grad_(False)


def make_mamba2(seed: int = 0, chunk_size: int = 4) -> Mamba2Mixer:
    m = Mamba2Mixer(HIDDEN, num_heads=4, head_dim=6, d_state=5, n_groups=2, conv_kernel=4,
                    chunk_size=chunk_size, eps=1e-5)  # fmt: skip
    return _randomize(m, seed)  # type: ignore[return-value]


def make_gdn(seed: int = 0, chunk_size: int = 4) -> GatedDeltaNet:
    m = GatedDeltaNet(HIDDEN, num_k_heads=2, num_v_heads=4, head_k_dim=6, head_v_dim=5,
                      conv_kernel=4, eps=1e-6, chunk_size=chunk_size)  # fmt: skip
    return _randomize(m, seed)  # type: ignore[return-value]


def _cache(m: Any, slots: int) -> StateCache:
    if isinstance(m, Mamba2Mixer):
        ssm = (m.num_heads, m.head_dim, m.d_state)
        kind = "mamba2"
    else:
        ssm = (m.nv, m.dk, m.dv)
        kind = "gated_deltanet"
    spec = StateSpec(kind=kind, layer_id=0, conv_dim=m.conv_dim,
                     conv_kernel=m.conv1d.weight.shape[-1], ssm_shape=ssm)  # fmt: skip
    return StateCache.allocate(spec, slots, torch.device("cpu"))


def _batch(slots: list[int], lens: list[int], initial: list[bool]) -> StateBatch:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return StateBatch(
        state_indices=torch.tensor(slots, dtype=torch.int64),
        has_initial_state=torch.tensor(initial, dtype=torch.bool),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64),
        is_decode=all(n == 1 for n in lens),
    )


def _run_split(m: Any, x: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, StateCache]:
    """Feed ``x`` to slot 1 in the chunks between ``cuts``; the outputs concatenated."""
    cache = _cache(m, 3)
    cache.conv.fill_(float("nan"))  # a fresh sequence must not read the slot
    cache.ssm.fill_(float("nan"))
    outs, lo = [], 0
    for hi in [*cuts, x.shape[0]]:
        if hi <= lo:
            continue
        outs.append(m(x[lo:hi], cache, _batch([1], [hi - lo], [lo > 0])))
        lo = hi
    return torch.cat(outs), cache


MAKERS = {"mamba2": make_mamba2, "gated_deltanet": make_gdn}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_chunked_equals_float64_reference(kind: str) -> None:
    m = MAKERS[kind](seed=1)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(2))
    out, cache = _run_split(m, x, [])  # one pass: 3 chunks of 4 tokens
    conv0 = torch.zeros(cache.conv.shape[1:])
    ssm0 = torch.zeros(cache.ssm.shape[1:])
    ref, conv, ssm = m.reference(x, conv0, ssm0)
    assert ref.dtype == torch.float64
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(cache.conv[1].double(), conv, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cache.ssm[1].double(), ssm, atol=2e-5, rtol=1e-4)
    # from a non-zero state (a prefix's), too
    cache.ssm[2] = ssm.float()
    cache.conv[2] = conv.float()
    x2 = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(3))
    out2 = m(x2, cache, _batch([2], [6], [True]))
    ref2, _, ssm2 = m.reference(x2, conv, ssm)
    torch.testing.assert_close(out2.double(), ref2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(cache.ssm[2].double(), ssm2, atol=2e-5, rtol=1e-4)


def test_delta_rule_chunked_equals_step_loop() -> None:
    g = torch.Generator().manual_seed(4)
    length, h, dk, dv = 13, 3, 4, 5
    q = torch.nn.functional.normalize(torch.randn(length, h, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, h, dk, generator=g), dim=-1)
    v = torch.randn(length, h, dv, generator=g)
    gg = -torch.rand(length, h, generator=g)
    beta = torch.rand(length, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    o, s = delta_rule_chunked(q, k, v, gg, beta, s0, chunk_size=5)
    st_, outs = s0[None], []
    for t in range(length):
        ot, st_ = delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], gg[t : t + 1],
                                  beta[t : t + 1], st_)  # fmt: skip
        outs.append(ot[0])
    torch.testing.assert_close(o, torch.stack(outs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, st_[0], atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(sorted(MAKERS)),
    length=st.integers(1, 14),
    cuts=st.lists(st.integers(0, 14), max_size=6),
    chunk_size=st.sampled_from([1, 3, 64]),
)
def test_any_split_equals_one_pass(
    kind: str, length: int, cuts: list[int], chunk_size: int
) -> None:
    m = MAKERS[kind](seed=5, chunk_size=chunk_size)
    x = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(length))
    whole, c1 = _run_split(m, x, [])
    split, c2 = _run_split(m, x, sorted(c for c in cuts if c < length))
    torch.testing.assert_close(split, whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(c2.conv[1], c1.conv[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c2.ssm[1], c1.ssm[1], atol=2e-5, rtol=1e-4)
    steps, c3 = _run_split(m, x, list(range(1, length)))  # one token per step (decode)
    torch.testing.assert_close(steps, whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(c3.ssm[1], c1.ssm[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("decode", [False, True])
def test_packed_batch_equals_per_sequence(kind: str, decode: bool) -> None:
    m = MAKERS[kind](seed=6)
    gen = torch.Generator().manual_seed(7)
    lens = [1, 1, 1] if decode else [5, 1, 9]
    initial = [True, False, True]
    slots = [4, 0, 2]
    cache = _cache(m, 5)
    cache.conv.normal_(generator=gen)
    cache.ssm.normal_(generator=gen)
    alone = StateCache(cache.conv.clone(), cache.ssm.clone())
    x = torch.randn(sum(lens), HIDDEN, generator=gen)
    packed = m(x, cache, _batch(slots, lens, initial))
    lo = 0
    for n, slot, init in zip(lens, slots, initial):
        one = m(x[lo : lo + n], alone, _batch([slot], [n], [init]))
        torch.testing.assert_close(packed[lo : lo + n], one, atol=1e-5, rtol=1e-5)
        lo += n
    torch.testing.assert_close(cache.conv, alone.conv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.ssm, alone.ssm, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.ssm[1], alone.ssm[1]) and torch.equal(cache.ssm[3], alone.ssm[3])


@pytest.mark.parametrize(
    "opts",
    [
        dict(gated_norm=False),  # Falcon-H1 without mamba_rms_norm: y * silu(z)
        dict(norm_before_gate=True, out_bias=True, use_conv_bias=False),
        dict(in_multiplier=1.3, zxbcdt_multipliers=(0.9, 1.1, 0.8, 1.2, 0.7)),
        dict(time_step_limit=(0.05, 0.5)),
    ],
)
def test_mamba2_options_chunked_equals_reference(opts: dict[str, Any]) -> None:
    m = Mamba2Mixer(HIDDEN, num_heads=4, head_dim=6, d_state=5, n_groups=2, conv_kernel=4,
                    chunk_size=4, eps=1e-5, **opts)  # fmt: skip
    _randomize(m, seed=8)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(9))
    out, cache = _run_split(m, x, [])
    steps, c2 = _run_split(m, x, list(range(1, 9)))
    ref, _, ssm = m.reference(
        x, torch.zeros(cache.conv.shape[1:]), torch.zeros(cache.ssm.shape[1:])
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(steps.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(cache.ssm[1].double(), ssm, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(c2.ssm[1].double(), ssm, atol=2e-5, rtol=1e-4)
