"""One EngineConfig: the engine, ``kvpage serve``'s config, the generated CLI flags and
the simulator's shared fields all use the same pydantic model and rules."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

import kvpage
from kvpage.engine import EngineConfig
from kvpage.engine.cli_flags import engine_flag, engine_kwargs
from kvpage.errors import SpecError
from kvpage.specs.engine_config import FIELD_RULES

#: two configs that together give every field a value other than its default
NON_DEFAULT: list[dict[str, Any]] = [
    dict(
        model="some/folder",
        block_size=32,
        num_blocks=64,
        kv_cache_memory_bytes=1000,
        max_num_seqs=3,
        max_num_batched_tokens=77,
        max_model_len=99,
        enable_prefix_caching=False,
        kv_cache_dtype="int8",
        backend="torch",
        dtype="bfloat16",
        seed=5,
        device="cuda:1",
        num_threads=2,
        scheduling_policy="priority",
        kv_retention_max_share=0.25,
        preemption_mode="swap",
        swap_space_bytes=12345,
        generation_config="none",
        kv_pool="per_group",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    ),
    dict(
        num_threads=0,
        kv_host_tier_bytes=4096,
        kv_disk_tier_bytes=8192,
        kv_disk_tier_path="/tmp/kvpage-tier",
        state_snapshot_share=0.3,
        state_snapshot_slots=17,
        state_share_threshold=3,
        state_predicted_share=0.5,
        state_decode_snapshots=False,
    ),
]


def _argv(cfg: EngineConfig) -> list[str]:
    argv: list[str] = []
    for name in cfg.model_fields_set:
        v = getattr(cfg, name)
        if isinstance(v, bool):
            argv.append(engine_flag(name) if v else "--no-" + engine_flag(name)[2:])
        else:
            argv += [engine_flag(name), json.dumps(v) if isinstance(v, dict) else str(v)]
    return argv


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from kvpage.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    return {name: sub[name] for name in ("generate", "replay", "serve")}


def test_one_class_everywhere() -> None:
    from kvpage.cluster.config import GroupConfig
    from kvpage.engine.config import EngineConfig as FromEngineConfig
    from kvpage.server.config import EngineConfig as FromServer
    from kvpage.server.config import ServerConfig

    assert FromServer is FromEngineConfig is EngineConfig
    assert ServerConfig.model_fields["engine"].annotation is EngineConfig
    assert GroupConfig.model_fields["engine"].annotation is EngineConfig
    src = Path(kvpage.__file__).parent
    defs = [p for p in src.rglob("*.py") if "class EngineConfig" in p.read_text()]
    assert [p.name for p in defs] == ["engine_config.py"]
    assert set(FIELD_RULES) == set(EngineConfig.model_fields)  # every field has its rule


def test_every_field_has_a_flag_and_round_trips() -> None:
    fields = set(EngineConfig.model_fields)
    assert {n for cfg in NON_DEFAULT for n in cfg} == fields  # the fixture covers all
    for name, parser in _parsers().items():
        dests = {a.dest for a in parser._actions}
        assert fields <= dests, (name, fields - dests)
        for kw in NON_DEFAULT:
            cfg = EngineConfig(**kw)
            pre = ["--trace", "azure-conv"] if name == "replay" else []
            args = parser.parse_args([*pre, *_argv(cfg)])
            assert EngineConfig(**engine_kwargs(args)) == cfg, name
    serve = _parsers()["serve"]
    from kvpage.server.cli import config_from_args

    for kw in NON_DEFAULT:
        cfg = EngineConfig(**kw)
        args = serve.parse_args(_argv(cfg))
        args.model_positional = None
        assert config_from_args(args).engine == cfg
    args = serve.parse_args([])
    args.model_positional = None
    assert config_from_args(args).engine == EngineConfig()  # no flag: the defaults


def test_flag_help_is_the_field_description() -> None:
    for parser in _parsers().values():
        helps: dict[str, str] = {}
        for a in parser._actions:  # a bool field's first flag is the positive one
            if a.option_strings:
                helps.setdefault(a.dest, a.help or "")
        for name, info in EngineConfig.model_fields.items():
            assert (info.description or "?").replace("%", "%%") in helps[name], name


@pytest.mark.parametrize(
    ("sim_field", "value", "message"),
    [
        ("block_size", 0, "block_size: expected an int >= 1, got 0"),
        ("num_blocks", 1, "num_blocks: expected None or an int >= 2"),
        ("kv_dtype", "int4", "kv_dtype: expected 'auto', 'int8'"),
        ("preemption_mode", "drop", "preemption_mode: expected 'recompute' or 'swap'"),
        ("swap_space_bytes", -1, "swap_space_bytes: expected an int >= 0 (bytes)"),
    ],
)
def test_simulator_uses_the_engine_rules(sim_field: str, value: Any, message: str) -> None:
    from kvpage.sim.simulator import SimConfig, simulate

    with pytest.raises(SpecError, match=f"^{message}".replace("(", r"\(").replace(")", r"\)")):
        simulate([], SimConfig(**{sim_field: value}))
