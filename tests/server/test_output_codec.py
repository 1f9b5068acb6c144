"""The engine-process output codec: deltas on the wire, the engine's cumulative outputs
rebuilt exactly on the server side (checked against a real engine's outputs)."""

from __future__ import annotations

import pickle

from kvpage.engine import LLMEngine, SamplingParams
from kvpage.server.engine_loop import EngineFailure
from kvpage.server.output_codec import OutputDecoder, OutputEncoder


def test_roundtrip_equals_the_engine_outputs_and_is_smaller():
    eng = LLMEngine.from_config(num_blocks=65, max_num_seqs=8)
    eng.add_request("a", list(range(3, 120)), SamplingParams(max_tokens=20, seed=1, n=2))
    eng.add_request("b", [5, 6, 7], SamplingParams(max_tokens=12, seed=2, logprobs=2))
    eng.add_request("c", [5, 6, 7, 8], SamplingParams(max_tokens=30, seed=3))
    enc, dec = OutputEncoder(), OutputDecoder()
    sent = raw = 0
    steps = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        if steps == 4:
            eng.abort_request("c")  # aborted mid-way: no finished output ever comes
        for out in outs:
            wire = pickle.loads(pickle.dumps(enc.encode(out)))
            raw += len(pickle.dumps(out))
            sent += len(pickle.dumps(wire))
            got = dec.decode(out.request_id, wire)
            assert got == out
            assert got.outputs[0].token_ids is not out.outputs[0].token_ids
    assert len(enc) == 1  # "c"
    enc.prune(set())  # the engine loop prunes to its live requests
    assert len(enc) == 0 and set(dec._acc) == {"c"}
    dec.forget("c")
    assert not dec._acc
    assert sent < raw / 2, (sent, raw)


def test_failures_pass_through_and_end_the_state():
    enc, dec = OutputEncoder(), OutputDecoder()
    f = EngineFailure("boom", oom=True)
    assert enc.encode(f) is f
    back = pickle.loads(pickle.dumps(f))
    assert isinstance(back, EngineFailure) and back.oom and str(back) == "boom"
    assert dec.decode("x", back) is back
