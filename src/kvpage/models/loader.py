"""``load_model``: the bundled model, a llama2.c file, a Hugging Face folder or an
in-memory ``transformers`` model, as a ``ModelRunnerModel``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvpage.attention.metadata import MODEL_DTYPES
from kvpage.errors import SpecError
from kvpage.models.config import arch_from_hf
from kvpage.models.llama2c import BUNDLED_MODEL, bundled_model_path, read_llama2c
from kvpage.models.model import ModelRunnerModel, rotary_embeddings
from kvpage.models.moe import FLOAT32_WEIGHTS, moe_weights_from_hf, moe_weights_to_hf
from kvpage.models.tokenizer import (
    HFTokenizer,
    Llama2cTokenizer,
    Tokenizer,
    bundled_tokenizer_path,
)
from kvpage.specs import ModelDType, hf_config_dict, read_hf_config_file
from kvpage.specs.families import Family, rename_weights

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_model(
    name_or_path_or_hf_model: Any = BUNDLED_MODEL,
    *,
    dtype: ModelDType = "float32",
    device: str | torch.device = "cpu",
    tokenizer: Tokenizer | Any | None = None,
) -> ModelRunnerModel:
    """Load a model to run on the paged KV cache.

    Args:
        name_or_path_or_hf_model: ``"stories260K"`` (bundled, with ``tok512.bin``); a
            llama2.c ``.bin`` file (tokenizer: ``tokenizer.bin`` or ``tok<vocab>.bin``
            beside it, else the bundled one when the vocabulary is 512); a folder with
            ``config.json`` and ``*.safetensors`` (tokenizer from the folder via
            ``AutoTokenizer`` when present); or an in-memory ``transformers``
            ``PreTrainedModel`` (its weights are copied).
        dtype: ``float32`` (default), ``float16`` or ``bfloat16``.
        device: where the weights live.
        tokenizer: override: a kvpage Tokenizer or a ``transformers`` tokenizer.
            Without one, models that ship none get a ``ByteTokenizer``.

    Returns:
        The model in eval mode with gradients off.

    Raises:
        SpecError: unknown name, missing files, unsupported architecture or dtype,
            weights that do not match the config.
    """
    if dtype not in MODEL_DTYPES:
        raise SpecError(f"dtype: expected one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
    src = name_or_path_or_hf_model
    tok = _as_tokenizer(tokenizer)
    if isinstance(src, ModelRunnerModel):  # a kvpage model: its own names, copied
        sd = {k: v.detach() for k, v in src.hf_state_dict().items()}
        return _build(dict(src.config), sd, tok, dtype, device, hf_names=False)
    if hasattr(src, "state_dict") and hasattr(src, "config"):
        cfg = hf_config_dict(src.config)
        sd = {k: v.detach() for k, v in src.state_dict().items()}
        return _build(cfg, sd, tok, dtype, device)
    if not isinstance(src, (str, Path)):
        raise SpecError(
            "model: expected 'stories260K', a path or a transformers model, got "
            f"{type(src).__name__}"
        )
    if str(src) == BUNDLED_MODEL:
        path = bundled_model_path()
        cfg, sd = read_llama2c(path)
        tok = tok or Llama2cTokenizer(bundled_tokenizer_path(), vocab_size=cfg["vocab_size"])
        return _build(cfg, sd, tok, dtype, device)
    path = Path(src).expanduser()
    if path.is_file() and path.suffix == ".bin":
        cfg, sd = read_llama2c(path)
        tok = tok or _llama2c_tokenizer_for(path, cfg["vocab_size"])
        return _build(cfg, sd, tok, dtype, device)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise SpecError(f"model folder {str(path)!r}: expected a config.json, got none")
        cfg = read_hf_config_file(cfg_path, str(cfg_path))
        try:
            arch_from_hf(cfg)  # refuse an unsupported architecture before reading weights
        except SpecError:
            raise
        except (TypeError, ValueError) as e:  # e.g. "hidden_size": "big"
            raise SpecError(f"{cfg_path}: expected HF config values, got {e}") from None
        sd = _read_weights(path)
        if tok is None and any((path / f).is_file() for f in _TOKENIZER_FILES):
            # BOS as the tokenizer adds it; EOS = tokenizer + config + generation config
            tok = HFTokenizer.from_pretrained(path, eos_id=cfg.get("eos_token_id"))
        return _build(cfg, sd, tok, dtype, device)
    raise SpecError(
        f"model: expected {BUNDLED_MODEL!r}, a llama2.c .bin file or an HF model folder, "
        f"got {str(src)!r}"
    )


def to_transformers(model: ModelRunnerModel) -> Any:
    """The equivalent ``transformers`` ``*ForCausalLM`` (same weights, float32, eager
    attention), e.g. to compare against HF ``generate``.

    Raises:
        SpecError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError as e:  # pragma: no cover
        raise SpecError("to_transformers: expected transformers installed, got ImportError") from e
    cfg = dict(model.config)
    mt = cfg["model_type"]
    config_cls = transformers.AutoConfig.for_model(mt).__class__
    keep = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype", "dtype")}
    amap = getattr(config_cls, "attribute_map", {}) or {}
    for k in list(keep):  # computed read-only properties (Mamba2Config.layer_types, ...)
        attr = getattr(config_cls, amap.get(k, k), None)
        if isinstance(attr, property) and attr.fset is None:
            del keep[k]
    hf_cfg = config_cls(**keep)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)  # type: ignore[no-untyped-call]
    sd = model.hf_state_dict()
    if model.arch.moe is not None:  # transformers' in-memory fused expert tensors
        sd = moe_weights_to_hf(sd, model.arch.moe)
    sd = family_weights_to_hf(sd, model.arch.family)
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise SpecError(f"to_transformers: expected matching weights, got {missing} {unexpected}")
    return hf.eval()


# ---- helpers -----------------------------------------------------------------------------
def _build(
    cfg: dict[str, Any],
    sd: Mapping[str, torch.Tensor],
    tok: Tokenizer | None,
    dtype: ModelDType,
    device: str | torch.device,
    hf_names: bool = True,
) -> ModelRunnerModel:
    # build on the meta device (no init, no memory), then adopt copies of the weights
    with torch.device("meta"):
        model = ModelRunnerModel(cfg, tok, dtype=dtype)
    weights = family_weights_from_hf(sd, model.arch.family) if hf_names else dict(sd)
    if model.arch.moe is not None:  # the family's expert layout -> kvpage's names
        weights = moe_weights_from_hf(weights, model.arch.moe)
    if model.lm_head is None:
        weights.pop("lm_head.weight", None)
    weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
    own = model.state_dict()
    missing = sorted(k for k in own if k not in weights)
    unexpected = sorted(k for k in weights if k not in own)
    if missing or unexpected:
        raise SpecError(
            f"weights: expected the keys of a {cfg.get('model_type')} model, got "
            f"missing={missing[:5]} unexpected={unexpected[:5]}"
        )
    for k, v in weights.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise SpecError(
                f"weights[{k}]: expected shape {tuple(own[k].shape)}, got {tuple(v.shape)}"
            )
    target = MODEL_DTYPES[dtype]
    copies = {
        k: v.detach().to(
            device=device, dtype=torch.float32 if k.endswith(FLOAT32_WEIGHTS) else target, copy=True
        )
        for k, v in weights.items()
    }
    model.load_state_dict(copies, strict=True, assign=True)
    full, local = rotary_embeddings(model.arch)
    model.rotary = None if full is None else full.to(device)
    model.rotary_local = None if local is None else local.to(device)
    return model.eval()


#: checkpoint entries that are buffers, not weights (GPT-2's causal-mask ``attn.bias``)
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")


def family_weights_from_hf(
    sd: Mapping[str, torch.Tensor], family: Family
) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under kvpage's names: the family's ``renames`` (GPT-2
    ``transformer.h.<i>.attn.c_attn`` -> ``model.layers.<i>.self_attn.qkv_proj``,
    GLM-4's norms, StarCoder2's ``c_fc`` / ``c_proj``), its ``Conv1D`` weights
    transposed to ``[out, in]``, GPT-2's mask buffers and the family's
    ``skip_prefixes`` (Qwen3-Next's ``mtp.*``) dropped. Other keys (kvpage's own
    names, e.g. of a ``ModelRunnerModel`` loaded again) unchanged."""
    names = rename_weights(list(sd), family)
    out: dict[str, torch.Tensor] = {}
    for old, new in names.items():
        if family.model_type == "gpt2" and old.endswith(_NOT_WEIGHTS):
            continue
        if old.startswith(family.skip_prefixes) and family.skip_prefixes:
            continue  # e.g. Qwen3-Next's mtp.* (Qwen3NextPreTrainedModel ignores them)
        v = sd[old]
        if new != old and any(new.endswith(c) for c in family.conv1d):
            v = v.T.contiguous()  # a checkpoint name (kvpage's own names: as they are)
        out[new] = v
    return out


def family_weights_to_hf(sd: Mapping[str, torch.Tensor], family: Family) -> dict[str, torch.Tensor]:
    """The inverse of :func:`family_weights_from_hf` (transformers' names and
    ``Conv1D`` layout)."""
    names = rename_weights(list(sd), family, to_kvpage=False)
    out: dict[str, torch.Tensor] = {}
    for old, new in names.items():
        v = sd[old]
        if new != old and any(old.endswith(c) for c in family.conv1d):
            v = v.T.contiguous()
        out[new] = v
    return out


def _as_tokenizer(tok: Any) -> Tokenizer | None:
    if tok is None or hasattr(tok, "incremental_decoder"):
        ours: Tokenizer | None = tok  # already kvpage's Tokenizer
        return ours
    if hasattr(tok, "encode") and hasattr(tok, "decode"):
        return HFTokenizer(tok)
    raise SpecError(f"tokenizer: expected a tokenizer, got {type(tok).__name__}")


def _llama2c_tokenizer_for(path: Path, vocab_size: int) -> Tokenizer | None:
    for cand in (path.parent / "tokenizer.bin", path.parent / f"tok{vocab_size}.bin"):
        if cand.is_file():
            return Llama2cTokenizer(cand, vocab_size=vocab_size)
    if vocab_size == 512:
        return Llama2cTokenizer(bundled_tokenizer_path(), vocab_size=512)
    return None


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``*.safetensors`` (else ``pytorch_model.bin``) in ``folder``.

    Raises:
        SpecError: no weight file, or one that cannot be read (truncated, not a
            safetensors/torch file), naming the file.
    """
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        sd: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                sd.update(load_file(str(f)))
            except Exception as e:  # SafetensorError, OSError: a corrupt or truncated file
                why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                raise SpecError(f"{f}: expected a safetensors file, got {why}") from None
        return sd
    pt = folder / "pytorch_model.bin"
    if pt.is_file():
        try:
            loaded = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError, RuntimeError, EOFError: not a checkpoint
            why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise SpecError(f"{pt}: expected a torch checkpoint, got {why}") from None
        if not isinstance(loaded, Mapping):
            raise SpecError(f"{pt}: expected a state dict, got {type(loaded).__name__}")
        return dict(loaded)
    raise SpecError(f"model folder {str(folder)!r}: expected *.safetensors, got none")


__all__ = ["family_weights_from_hf", "family_weights_to_hf", "load_model", "to_transformers"]
