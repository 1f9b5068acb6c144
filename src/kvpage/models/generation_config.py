"""A model folder's ``generation_config.json``: its EOS ids and its sampling defaults.

Read with transformers' own ``GenerationConfig.from_pretrained`` (local files only);
only the fields the file sets count (``GenerationConfig.to_diff_dict()``, as vLLM's
``try_get_generation_config``), so transformers' class defaults (``top_k=50``, ...)
never leak in as if the model asked for them.

Sampling defaults follow vLLM's ``ModelConfig.get_diff_sampling_param``: the fields
``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
``max_new_tokens`` (renamed ``max_tokens``) that the file sets, non-null.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpage.errors import SpecError

__all__ = [
    "GENERATION_CONFIG_FILE",
    "SAMPLING_DEFAULT_FIELDS",
    "generation_eos_ids",
    "read_generation_config",
    "sampling_defaults",
]

#: the file name transformers and vLLM read
GENERATION_CONFIG_FILE = "generation_config.json"

#: generation_config.json field -> SamplingParams field (vLLM's list and renaming)
SAMPLING_DEFAULT_FIELDS: dict[str, str] = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The fields ``folder/generation_config.json`` sets ({} when there is no file).

    Args:
        folder: a model folder.

    Returns:
        ``GenerationConfig.from_pretrained(folder).to_diff_dict()`` (JSON values; the
        ``transformers_version`` entry dropped).

    Raises:
        SpecError: the file is not valid JSON or transformers refuses it, naming the
            file.
    """
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(f"{path}: expected a JSON object, got {e}") from None
    try:
        from transformers import GenerationConfig

        cfg = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except ImportError as e:  # pragma: no cover - transformers is an extra
        raise SpecError(f"{path}: expected transformers installed, got ImportError") from e
    except Exception as e:  # noqa: BLE001 - ValueError/TypeError/OSError from transformers
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise SpecError(f"{path}: expected a valid generation config, got {why}") from None
    out = dict(cfg.to_diff_dict())
    out.pop("transformers_version", None)
    return out


def generation_eos_ids(gen: dict[str, Any]) -> list[int]:
    """``eos_token_id`` of a generation config (int or list) as a list ([] if unset).

    Raises:
        SpecError: an id is not an int.
    """
    raw = gen.get("eos_token_id")
    if raw is None:
        return []
    items = raw if isinstance(raw, list) else [raw]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise SpecError(
            f"{GENERATION_CONFIG_FILE} eos_token_id: expected an int or a list of ints, "
            f"got {raw!r}"[:200]
        )
    return [int(i) for i in items]


def sampling_defaults(gen: dict[str, Any]) -> dict[str, Any]:
    """The request defaults a generation config gives, keyed by SamplingParams field
    (see the module docstring): e.g. ``{"temperature": 0.6, "top_p": 0.9,
    "max_tokens": 256}``. Fields left unset or null are absent."""
    return {
        ours: gen[theirs]
        for theirs, ours in SAMPLING_DEFAULT_FIELDS.items()
        if gen.get(theirs) is not None
    }
