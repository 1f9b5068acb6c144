"""Named model presets (top-level ``specs/*.yaml``, shipped as ``kvpage/presets``)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from kvpage.errors import SpecError, got_repr
from kvpage.specs.core import CacheSpec, KVCacheDType, ModelDType, validated


class Preset(BaseModel):
    """A named model preset from top-level ``specs/*.yaml``.

    Attributes:
        name: preset name (the file stem).
        source: where the numbers come from (a config.json, a paper).
        num_parameters: parameter count, for weight bytes in capacity planning.
        max_model_len: the model's context length in tokens.
        hf_config: HF ``config.json`` fields enough for ``CacheSpec.from_hf_config``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    source: str
    num_parameters: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    hf_config: dict[str, Any]

    def cache_spec(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 0,
        kv_dtype: KVCacheDType = "auto",
        dtype: ModelDType | None = None,
    ) -> CacheSpec:
        """The preset lowered to a CacheSpec (see ``CacheSpec.from_hf_config``)."""
        return CacheSpec.from_hf_config(
            self.hf_config,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_dtype=kv_dtype,
            dtype=dtype,
        )


def _preset_dirs() -> list[Path]:
    dirs: list[Path] = []
    try:
        packaged = resources.files("kvpage") / "presets"
        if packaged.is_dir():
            dirs.append(Path(str(packaged)))
    except (ModuleNotFoundError, FileNotFoundError):  # pragma: no cover
        pass
    repo = Path(__file__).resolve().parents[3] / "specs"
    if repo.is_dir():
        dirs.append(repo)
    return dirs


def list_presets() -> list[str]:
    """Names of the presets shipped with kvpage (sorted)."""
    names: set[str] = set()
    for d in _preset_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_preset(name: str) -> Preset:
    """Load a preset by name (``specs/<name>.yaml``) or from a YAML/JSON file path.

    Raises:
        SpecError: no such preset, or the file is invalid.
    """
    path = Path(name)
    if not path.suffix or not path.exists():
        path = Path()
        for d in _preset_dirs():
            if (d / f"{name}.yaml").exists():
                path = d / f"{name}.yaml"
                break
        else:
            raise SpecError(f"preset: expected one of {list_presets()}, got {got_repr(name)}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise SpecError(f"preset {path}: expected a mapping, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return validated(Preset, data, source=str(path))


__all__ = ["Preset", "list_presets", "load_preset"]
