"""Hybrid / recurrent families greedy-equal to transformers: tiny random-weight models
built offline from their config classes, saved with ``save_pretrained`` and loaded
through kvpage's loader, driven on paged KV + state slots (``hybrid_harness``) with
one-pass prefill, chunked prefill, a prefix hit at a state snapshot and recompute
after preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_harness import HybridDriver, hf_generate, hf_logits
from hypothesis import given, settings
from hypothesis import strategies as st
from models_harness import get_test_backend

from kvpage.attention.state import StateBatch, StateCache
from kvpage.errors import ShapeError
from kvpage.models import ModelRunnerModel, load_model

transformers = pytest.importorskip("transformers")

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mlp_only_layers=[1], max_position_embeddings=512,
    ),
    "mamba2": dict(
        vocab_size=256, hidden_size=32, num_heads=8, head_dim=8, state_size=16, n_groups=2,
        num_hidden_layers=2, chunk_size=8,
    ),
    "nemotron_h": dict(
        vocab_size=256, hidden_size=64, layers_block_type=["mamba", "attention", "mlp", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8,
        max_position_embeddings=512,
    ),
    "granitemoehybrid": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0,
        attention_multiplier=0.2, max_position_embeddings=512,
    ),
    "falcon_h1": dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8,
        mamba_d_head=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
        mamba_rms_norm=True, mamba_norm_before_gate=False, projectors_bias=True,
        embedding_multiplier=1.5, lm_head_multiplier=0.7, mlp_multipliers=[0.8, 1.3],
        key_multiplier=0.9, attention_in_multiplier=1.2, attention_out_multiplier=0.6,
        ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], ssm_in_multiplier=1.3,
        ssm_out_multiplier=0.8, max_position_embeddings=512,
    ),
}  # fmt: skip
PREFIX = [5, 17, 99, 3, 200, 41, 7, 8]  # two blocks of 4
PROMPTS = [PREFIX + [9, 10, 11, 12, 13], [250, 1, 33, 44, 55, 66, 77, 90], list(range(30, 51))]
OTHER = PREFIX + [60, 61, 62, 63, 64, 65]  # shares PREFIX with PROMPTS[0]
NUM_NEW = 12


def make_hf(model_type: str, seed: int = 0, **over: Any) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.CONFIG_MAPPING[model_type](
        **{
            **CONFIGS[model_type],
            "initializer_range": 0.1,
            "bos_token_id": 1,
            "eos_token_id": None,
            "pad_token_id": 0,
            **over,
        }  # fmt: skip
    )
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(0.2 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request: Any, tmp_path_factory: Any) -> tuple[str, Any, ModelRunnerModel]:
    mt = request.param
    hf = make_hf(mt)
    folder = tmp_path_factory.mktemp(mt)
    hf.save_pretrained(folder)
    model = load_model(Path(folder))
    assert model.config["model_type"] == mt and model.mixers is not None
    return mt, hf, model


def _want(hf: Any, prompt: list[int]) -> list[int]:
    return hf_generate(hf, prompt, NUM_NEW)


def test_greedy_one_pass_chunked_prefix_hit_preemption(
    family: tuple[str, Any, ModelRunnerModel],
) -> None:
    check_greedy(*family)


VARIANTS = [
    ("falcon_h1", dict(mamba_rms_norm=False)),  # y * silu(z), its default
    ("falcon_h1", dict(mamba_rms_norm=True, mamba_norm_before_gate=True)),
    ("granitemoehybrid", dict(num_local_experts=0, position_embedding_type=None)),
    ("qwen3_next", dict(num_experts=0)),  # dense MLPs only
    ("mamba2", dict(n_groups=1, residual_in_fp32=False)),
]


@pytest.mark.slow
@pytest.mark.parametrize(("mt", "over"), VARIANTS)
def test_config_variants(mt: str, over: dict[str, Any], tmp_path: Path) -> None:
    hf = make_hf(mt, seed=3, **over)
    hf.save_pretrained(tmp_path)
    check_greedy(mt, hf, load_model(tmp_path))


def check_greedy(mt: str, hf: Any, model: ModelRunnerModel) -> None:
    """Greedy equality (and logits within 1e-4) in the four schedules."""
    want = [_want(hf, p) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 4  # not a degenerate constant output
    backend = get_test_backend()
    # one-pass prefill of three sequences in one batch, then batched decode
    d = HybridDriver(model, backend)
    seqs = [d.new(p, slot) for p, slot in zip(PROMPTS, [3, 0, 5])]
    d.run(seqs, NUM_NEW)
    assert [s.generated for s in seqs] == want, mt
    # chunked prefill: 5 tokens per step ends chunks at arbitrary positions
    d = HybridDriver(model, backend)
    seqs = [d.new(p, slot) for p, slot in zip(PROMPTS, [1, 2, 4])]
    d.run(seqs, NUM_NEW, chunk=5)
    assert [s.generated for s in seqs] == want, mt
    err = max(float((torch.stack(s.logits) - hf_logits(hf, s)).abs().max()) for s in seqs)
    assert err < 1e-4, (mt, err)
    print(f"{mt}: tokens equal, max |logit error| {err:.2e}")
    # prefix hit: PROMPTS[0]'s prefill stops at the PREFIX block boundary, its state is
    # snapshotted (slot 0 -> 5); OTHER shares the two prefix blocks and continues from
    # a copy of the snapshot (5 -> 2)
    d = HybridDriver(model, backend)
    a = d.new(PROMPTS[0], 0)
    d.step([(a, len(PREFIX))])
    d.snapshot(0, 5)
    d.run([a], NUM_NEW, chunk=3)
    assert a.generated == want[0]
    b = d.new(OTHER, 2)
    b.tables = [t[: len(PREFIX) // d.bs] for t in a.tables]
    b.computed = len(PREFIX)
    d.snapshot(5, 2)
    d.run([b], NUM_NEW)
    assert b.generated == _want(hf, OTHER), mt
    # preemption after 5 generated tokens: drop blocks and state, recompute, continue
    d = HybridDriver(model, backend)
    c = d.new(PROMPTS[2], 1)
    d.run([c], 5, chunk=4)
    d.drop(c)
    d.run([c], NUM_NEW, chunk=7)
    assert c.generated == want[2], mt


def test_missing_state_arguments_refused(family: tuple[str, Any, ModelRunnerModel]) -> None:
    _, _, model = family
    d = HybridDriver(model, get_test_backend())
    with pytest.raises(ShapeError, match="state_caches"):
        model(torch.tensor([1]), torch.tensor([0]), d.kv, [], get_test_backend(),
              torch.tensor([0]))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
@pytest.mark.parametrize("cut", [4, 8, 12])
def test_prefix_hit_at_every_block_boundary(
    family: tuple[str, Any, ModelRunnerModel], chunk: int, cut: int
) -> None:
    mt, hf, model = family
    prompt = PROMPTS[2]
    d = HybridDriver(model, get_test_backend())
    a = d.new(prompt, 0)
    for lo in range(0, cut, chunk):  # chunked up to the snapshot boundary
        d.step([(a, min(chunk, cut - lo))])
    d.snapshot(0, 4)
    other = prompt[:cut] + [7, 77, 177, 17]
    b = d.new(other, 3)
    b.tables = [t[: cut // d.bs] for t in a.tables]
    b.computed = cut
    d.snapshot(4, 3)
    d.run([a, b], NUM_NEW, chunk=chunk)
    assert a.generated == _want(hf, prompt), mt
    assert b.generated == _want(hf, other), mt


def test_memory_and_folder_layouts_agree(family: tuple[str, Any, ModelRunnerModel]) -> None:
    """An in-memory transformers model loads to the folder's weights, and
    ``to_transformers`` writes them back under transformers' names with equal logits."""
    from kvpage.models import to_transformers

    mt, hf, folder_model = family
    mem = load_model(hf)
    a, b = mem.state_dict(), folder_model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (mt, k)
    back = to_transformers(mem)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "bad",
    ["slot_out_of_range", "duplicate_slot", "offsets", "cache_shape", "decode_flag"],
)
def test_bad_state_input_is_refused_and_changes_nothing(
    family: tuple[str, Any, ModelRunnerModel], bad: str
) -> None:
    _, _, model = family
    backend = get_test_backend()
    d = HybridDriver(model, backend)
    a, b = d.new([5, 6, 7], 0), d.new([8, 9], 1)
    d.step([(a, 3), (b, 2)])  # valid: fills slots 0 and 1
    before = [(s.conv.clone(), s.ssm.clone()) for s in d.states]
    slots, qsl, decode = [0, 1], [0, 1, 2], True
    if bad == "slot_out_of_range":
        slots = [0, 99]
    elif bad == "duplicate_slot":
        slots = [1, 1]
    elif bad == "offsets":
        qsl = [0, 2, 1]
    elif bad == "decode_flag":
        qsl, decode = [0, 1, 3], True
    states = d.states
    if bad == "cache_shape":
        s0 = d.states[0]
        states = [StateCache(s0.conv[:, :-1], s0.ssm), *d.states[1:]]
    n = qsl[-1]
    batch = StateBatch(torch.tensor(slots), torch.tensor([True, True]), torch.tensor(qsl), decode)
    plans = [backend.plan(_meta(d, [a, b], [1, n - 1])) for _ in d.spec.kv_groups]
    with pytest.raises(ShapeError):
        model(torch.tensor([3] * n), torch.tensor([3, 2, 3][:n]), d.kv, plans, backend,
              torch.tensor([0, n - 1]), state_caches=states, state_batch=batch)  # fmt: skip
    for s, (conv, ssm) in zip(d.states, before):
        assert torch.equal(s.conv.nan_to_num(), conv.nan_to_num())
        assert torch.equal(s.ssm.nan_to_num(), ssm.nan_to_num())


def _meta(d: HybridDriver, seqs: list[Any], qlens: list[int]) -> Any:
    from kvpage.attention.metadata import AttentionMetadata

    return AttentionMetadata.build(
        qlens, [s.computed + q for s, q in zip(seqs, qlens)], [s.tables[0] for s in seqs], d.bs
    )


@settings(max_examples=6, deadline=None)
@given(cuts=st.lists(st.integers(1, 20), max_size=4), num_new=st.integers(1, 4))
def test_any_chunk_schedule_equals_one_pass(
    family: tuple[str, Any, ModelRunnerModel], cuts: list[int], num_new: int
) -> None:
    """The conformance property at the model level: the prompt split at arbitrary
    positions (each chunk one step, state carried in the slot) gives the logits and
    tokens of one pass."""
    mt, _, model = family
    prompt = PROMPTS[2]
    backend = get_test_backend()
    d = HybridDriver(model, backend)
    whole = d.new(prompt, 0)
    d.run([whole], num_new)
    d = HybridDriver(model, backend)
    s = d.new(prompt, 3)
    lo = 0
    for hi in [*sorted(set(cuts)), len(prompt)]:
        if hi > lo:
            d.step([(s, hi - lo)])
            lo = hi
    d.run([s], num_new)
    assert s.generated == whole.generated, mt
    err = float((torch.stack(s.logits) - torch.stack(whole.logits)).abs().max())
    assert err < 2e-5, (mt, err)
