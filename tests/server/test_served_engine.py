"""The three engines a ServingState serves implement :class:`ServedEngine` (mypy checks
the same statically: ``kvpage.server.service._served``, ``kvpage.cluster.ingress
._facade_is_served``); the client is chosen by the engine's type, and an object that is
no engine, or an engine without a tokenizer, is refused by name."""

from __future__ import annotations

import pytest

from kvpage.cluster.ingress import EngineFacade
from kvpage.engine import LLMEngine, SamplingParams
from kvpage.errors import SpecError
from kvpage.models.tokenizer import ByteTokenizer
from kvpage.server.config import ServerConfig
from kvpage.server.engine_client import LocalEngine, ServedEngine
from kvpage.server.engine_loop import AsyncEngine
from kvpage.server.service import ServingState, engine_client_for

_INFO = {
    "tokenizer": ByteTokenizer(vocab_size=300),
    "default_sampling_params": {"temperature": 0.6},
    "generation_config_path": "/models/x",
    "backend_name": "torch",
    "block_size": 16,
    "kv_dtype": "auto",
    "total_bytes": 4096,
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_config(block_size=16, num_blocks=64, max_model_len=128)


def test_llm_engine_is_a_local_served_engine(engine: LLMEngine) -> None:
    assert isinstance(engine, ServedEngine) and isinstance(engine, LocalEngine)
    assert engine.scheduler.max_servable_len <= engine.scheduler.max_model_len == 128
    assert isinstance(engine_client_for(engine), AsyncEngine)


def test_the_facade_is_served_but_not_local() -> None:
    facade = EngineFacade(_INFO, num_blocks=640, max_model_len=4096, policy="priority")
    assert isinstance(facade, ServedEngine) and not isinstance(facade, LocalEngine)
    assert (facade.cache_spec.num_blocks, facade.cache_spec.total_bytes) == (640, 4096)
    assert (facade.scheduler.max_servable_len, facade.scheduler.policy) == (4096, "priority")
    with pytest.raises(TypeError, match="EngineFacade"):
        engine_client_for(facade)  # the ingress brings its own client


def test_a_non_engine_is_refused_by_name() -> None:
    class _NoScheduler:
        tokenizer = None
        backend_name = "torch"

    assert not isinstance(_NoScheduler(), ServedEngine)
    with pytest.raises(TypeError, match="_NoScheduler"):
        engine_client_for(_NoScheduler())  # type: ignore[arg-type]


def test_serving_state_reads_the_engine_through_the_protocol(engine: LLMEngine) -> None:
    cfg = ServerConfig.model_validate({"engine": {"num_blocks": 64}, "engine_process": False})
    state = ServingState(cfg, engine, SamplingParams)
    try:
        assert state.max_model_len == engine.scheduler.max_servable_len
        assert state.scheduling_policy == engine.scheduler.policy
        assert state.sampling_defaults == dict(engine.default_sampling_params)
        assert isinstance(state.loop, AsyncEngine) and not state.loop.running
    finally:
        state.tokenize_pool.shutdown()


def test_a_model_without_a_tokenizer_is_refused(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ServerConfig.model_validate({"engine": {"num_blocks": 64}, "engine_process": False})
    monkeypatch.setattr(engine, "tokenizer", None)
    with pytest.raises(SpecError, match="tokenizer"):
        ServingState(cfg, engine, SamplingParams)
