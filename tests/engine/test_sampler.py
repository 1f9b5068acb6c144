"""The Sampler's greedy fast path agrees with its general path; rows map to logits
rows (forks) and logprob rows come back only for the rows that ask."""

from __future__ import annotations

import torch

from kvpage.engine.params import SamplingParams
from kvpage.engine.sampler import Sampler, SamplingRows


def _greedy() -> SamplingParams:
    p = SamplingParams(temperature=0.0)
    p.validate()
    return p


def test_greedy_fast_path_agrees_with_general_path() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g)
    logits[2, [3, 7]] = 100.0  # a tie: both paths take the lowest index
    logits[5] = 0.0  # all tied
    logits[6, [4, 9]] = float("nan")  # torch.argmax: the first NaN
    logits[7] = float("-inf")
    params = [_greedy() for _ in range(8)]
    fast = SamplingRows(params, [None] * 8)
    general = SamplingRows(params, [None] * 8, all_greedy=False)
    sampler = Sampler()
    a = sampler.sample(logits, fast)
    b = sampler.sample(logits, general)
    assert a.token_ids == b.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert a.token_ids[2] == 3 and a.token_ids[5] == 0
    assert a.token_ids[6] == 4 and a.token_ids[7] == 0
    assert a.logprobs is None and b.logprobs is None


def test_logit_rows_repeat_a_forked_row_and_logprobs_only_where_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    lp = SamplingParams(temperature=0.0, logprobs=1)
    lp.validate()
    rows = SamplingRows([_greedy(), lp, _greedy()], [None] * 3, logit_rows=[0, 0, 1])
    rows.all_greedy = False
    res = Sampler().sample(logits, rows)
    assert res.token_ids == [1, 1, 0]
    assert res.logprobs is not None and res.logprobs[0] is None and res.logprobs[2] is None
    ent = res.logprobs[1]
    assert ent is not None
    want = torch.log_softmax(logits[0], dim=-1)[1].item()
    assert abs(ent[0] - want) < 1e-6 and ent[1] == 1 and ent[2] == [1]


def test_bfloat16_logits_sample_as_their_float32_cast() -> None:
    """The runner hands bfloat16 logits through uncast (``float_logits=False``): greedy
    ids (fast and general path), sampled ids and logprobs equal those of the exact
    float32 cast, with generators in the same state."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 300, generator=g) * 4).to(torch.bfloat16)
    logits[1, [5, 9]] = 30.0  # a tie in bf16
    logits[2, [4, 8]] = float("nan")
    logits[3] = float("-inf")
    greedy = [_greedy() for _ in range(6)]
    sampler = Sampler()
    for all_greedy in (True, False):
        rows = SamplingRows(greedy, [None] * 6, all_greedy=all_greedy)
        a = sampler.sample(logits, rows).token_ids
        assert a == sampler.sample(logits.float(), rows).token_ids
        assert a == torch.argmax(logits.float(), dim=-1).tolist()
    params = []
    for i in range(6):
        p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, logprobs=2, seed=i)
        p.validate()
        params.append(p)
    ok = torch.randn(6, 300, generator=g).to(torch.bfloat16)
    out = []
    for lg in (ok, ok.float()):
        gens = [torch.Generator().manual_seed(i) for i in range(6)]
        res = sampler.sample(lg, SamplingRows(params, gens, all_greedy=False))
        out.append((res.token_ids, res.logprobs))
    assert out[0] == out[1]
