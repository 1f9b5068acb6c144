"""Models that run on the paged KV cache: the bundled llama2.c ``stories260K``, Hugging
Face checkpoints of every family in ``kvpage.specs.families`` (Llama, Mistral, Qwen2/3,
Gemma-2/3, Phi-3, OLMo-2, Granite, GLM-4, Cohere, StarCoder2, GPT-2, Mixtral,
Qwen3-MoE, gpt-oss), and their tokenizers.

Entry point: ``load_model(name_or_path_or_hf_model, dtype="float32", device="cpu")``.
"""

from kvpage.models.config import SUPPORTED_MODEL_TYPES, ArchConfig, arch_from_hf
from kvpage.models.llama2c import BUNDLED_MODEL, bundled_model_path, read_llama2c
from kvpage.models.loader import load_model, to_transformers
from kvpage.models.model import ModelRunnerModel
from kvpage.models.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    Llama2cTokenizer,
    Tokenizer,
    bundled_tokenizer_path,
    decode_continuation,
)

__all__ = [
    "BUNDLED_MODEL",
    "SUPPORTED_MODEL_TYPES",
    "ArchConfig",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDecoder",
    "Llama2cTokenizer",
    "ModelRunnerModel",
    "Tokenizer",
    "arch_from_hf",
    "bundled_model_path",
    "bundled_tokenizer_path",
    "decode_continuation",
    "load_model",
    "read_llama2c",
    "to_transformers",
]
