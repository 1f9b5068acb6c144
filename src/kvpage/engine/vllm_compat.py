"""Keyword arguments of vLLM's ``LLM`` and ``SamplingParams`` that kvpage does not
implement: accepted only with a value that asks for nothing, refused by name otherwise.

An argument that is neither kvpage's nor in these tables is refused by Python itself
(``TypeError: ... got an unexpected keyword argument 'x'``). The names come from vLLM's
``vllm/entrypoints/llm.py`` / ``vllm/engine/arg_utils.py`` and
``vllm/sampling_params.py`` (vLLM 0.10); docs/vllm-checklist.md lists them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM_NOT_IMPLEMENTED", "SAMPLING_NOT_IMPLEMENTED", "check_not_implemented"]

#: vLLM ``LLM(...)`` arguments kvpage does not implement -> values that ask for nothing
LLM_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "tokenizer": (None,),
    "tokenizer_mode": ("auto",),
    "skip_tokenizer_init": (False,),
    "trust_remote_code": (False,),
    "tensor_parallel_size": (1,),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "quantization": (None,),
    "revision": (None,),
    "tokenizer_revision": (None,),
    "gpu_memory_utilization": (),
    "swap_space": (),
    "cpu_offload_gb": (0, 0.0),
    "enforce_eager": (True,),
    "enable_chunked_prefill": (None, True),
    "max_seq_len_to_capture": (),
    "disable_custom_all_reduce": (False, True),  # one device: nothing to reduce
    "hf_token": (None,),
    "hf_overrides": (None,),
    "mm_processor_kwargs": (None,),
    "compilation_config": (None,),
    "enable_lora": (False,),
    "served_model_name": (None,),
}

#: vLLM ``SamplingParams(...)`` arguments kvpage does not implement
SAMPLING_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "early_stopping": (False,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "guided_decoding": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "detokenize": (True,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "output_kind": (None,),
    "extra_args": (None, {}),
}


def check_not_implemented(
    owner: str, table: dict[str, tuple[Any, ...]], kwargs: dict[str, Any]
) -> None:
    """Refuse ``kwargs`` entries of ``table`` whose value asks for something.

    Accepted no-op entries are removed from ``kwargs`` (mutated).

    Raises:
        TypeError: ``"<owner>: <name>: expected unset or one of ... (vLLM argument not
            implemented by kvpage), got <value>"``.
    """
    for name in [k for k in kwargs if k in table]:
        value = kwargs[name]
        noops = table[name]
        if any(type(value) is type(v) and value == v for v in noops) or (
            value is None and None in noops
        ):
            del kwargs[name]
            continue
        shown = ", ".join(repr(v) for v in noops) or "nothing"
        raise TypeError(
            f"{owner}: {name}: expected unset or one of {shown} (vLLM argument not "
            f"implemented by kvpage, see docs/vllm-checklist.md), got {value!r}"
        )
