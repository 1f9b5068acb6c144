"""SimConfig's fields shared with the engine: defaults taken from ``EngineConfig`` (one
source per default) except the GPU-server ones, and the engine's rule on each."""

from __future__ import annotations

import dataclasses

import pytest

from kvpage.errors import SpecError
from kvpage.sim.config import ENGINE_DEFAULTS, GPU_DEFAULTS, SimConfig
from kvpage.sim.simulator import ENGINE_FIELDS, build_setup
from kvpage.specs.engine_config import EngineConfig

SIM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SimConfig)}
ENGINE = EngineConfig.model_fields


def test_shared_defaults_are_the_engine_defaults() -> None:
    for sim_name, engine_name in ENGINE_DEFAULTS.items():
        assert SIM_DEFAULTS[sim_name] == ENGINE[engine_name].default, sim_name


def test_gpu_defaults_differ_from_the_engine_and_are_used() -> None:
    for name, value in GPU_DEFAULTS.items():
        assert SIM_DEFAULTS[name] == value
        assert ENGINE[name].default != value, f"{name}: same as the engine: take its default"


def test_every_shared_field_has_one_default_source() -> None:
    """A SimConfig field named like an engine field (or checked by an engine rule) is in
    exactly one of ENGINE_DEFAULTS and GPU_DEFAULTS. ``model`` only shares the name: the
    simulator's is a config-only preset (no weights), the engine's a model to load."""
    shared = ({n for n in SIM_DEFAULTS if n in ENGINE} - {"model"}) | set(ENGINE_FIELDS)
    assert not set(ENGINE_DEFAULTS) & set(GPU_DEFAULTS)
    assert shared == set(ENGINE_DEFAULTS) | set(GPU_DEFAULTS)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, r"^block_size: expected an int >= 1, got 0"),
        (
            "kv_dtype",
            "fp4",
            r"^kv_dtype: expected 'auto', 'int8', 'fp8_e4m3' or 'fp8_e5m2', got 'fp4'",
        ),
        ("num_blocks", 1, r"^num_blocks: expected None or an int >= 2"),
        ("swap_space_bytes", -1, r"^swap_space_bytes: expected an int >= 0 \(bytes\), got -1"),
        ("max_num_batched_tokens", 0, r"^max_num_batched_tokens: expected an int >= 1, got 0"),
    ],
)
def test_shared_fields_follow_the_engine_rule(field: str, value: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build_setup(dataclasses.replace(SimConfig(), **{field: value}))
