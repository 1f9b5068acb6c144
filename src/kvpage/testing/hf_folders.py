"""Offline Hugging Face model folders for tokenizer / chat-template / generation-config
tests: a small byte-level BPE trained with the ``tokenizers`` library on local text,
wrapped as a ``PreTrainedTokenizerFast``, beside a tiny random-weight model built from
transformers' own config class (``CONFIG_MAPPING[model_type](**small)``).

Two setups, as real checkpoints ship them:

* ``"qwen"``: no BOS added (``encode`` adds nothing), EOS ``<|im_end|>``, a ChatML chat
  template, config.json ``bos_token_id``/``eos_token_id`` = ``<|endoftext|>`` (as Qwen2
  has), and a generation_config.json with two EOS ids and sampling defaults;
* ``"llama"``: ``encode`` prepends ``<s>`` (a TemplateProcessing post-processor), EOS
  ``</s>``, a template that writes ``{{ bos_token }}`` itself, no generation_config.json.

The model can be made to emit one chosen token at every step whatever the prompt
(:func:`set_emitted_token`): column 0 of the embeddings is a large constant, so the
final normed hidden state has a positive first entry, and the untied ``lm_head`` has a
single non-zero entry, in the chosen token's row. That makes stop-id tests exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHATML_TEMPLATE",
    "HERMES_TEMPLATE",
    "LLAMA_TEMPLATE",
    "QWEN_GENERATION_CONFIG",
    "TOOL_MESSAGES",
    "byte_level_bpe",
    "make_chat_folder",
    "set_emitted_token",
]

#: ChatML (Qwen2 / many instruct models), with add_generation_prompt
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] }}"
    "{% if message.get('name') %}{{ ' name=' + message['name'] }}{% endif %}"
    "{{ '\n' + (message['content'] or '') }}"
    "{% if message.get('tool_calls') %}{% for c in message['tool_calls'] %}"
    "{{ '\n<tool_call>' + c['function']['name'] + ' ' + (c['function']['arguments'] | tojson)"
    " + '</tool_call>' }}{% endfor %}{% endif %}"
    "{% if message.get('tool_call_id') %}{{ ' id=' + message['tool_call_id'] }}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}"
    "{% endif %}{% endif %}"
)

#: ChatML with Hermes-style tools (as Qwen2.5 / Hermes checkpoints ship it): the tools'
#: signatures in a system turn, assistant calls as ``<tool_call>{json}</tool_call>``,
#: tool results as ``<tool_response>`` user turns
HERMES_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nFunctions you may call:\n<tools>' }}"
    "{% for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}"
    '{{ \'\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}'
    "</tool_call>.<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif m.get('tool_calls') %}{{ '<|im_start|>assistant' }}"
    "{% for c in m['tool_calls'] %}{{ '\n<tool_call>\n{\"name\": \"' + c['function']['name']"
    " + '\", \"arguments\": ' + (c['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: a Llama-2-like template that writes BOS itself
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '<<SYS>>' + message['content'] + '<</SYS>>' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)

#: the "qwen" folder's generation_config.json besides its EOS ids
QWEN_GENERATION_CONFIG: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 7,
}

#: a conversation with the message fields templates render (``name``, an assistant
#: ``tool_calls`` with JSON ``arguments``, a ``tool`` result with ``tool_call_id``)
TOOL_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "weather?", "name": "bob"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
]

_TEXT = [
    "Once upon a time there was a little cat who sat on a mat.",
    "The system said hello to the user, and the assistant answered politely.",
    "Tools are called with arguments; the weather in Paris is sunny today.",
    "A dog ran in the park, and the children laughed at the funny dog.",
]

_SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_bpe(texts: list[str], special_tokens: list[str], vocab_size: int = 400) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2 style pre-tokenizer and decoder,
    every byte in its alphabet, so any text encodes) trained on ``texts``; the special
    tokens take the first ids in order (``special_tokens[0]`` is also the unknown token).
    Wrap it with ``transformers.PreTrainedTokenizerFast(tokenizer_object=...)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token=special_tokens[0]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(texts, trainer)
    return t


def _tokenizer(style: str, chat_template: str | None = None) -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    t = byte_level_bpe(_TEXT, _SPECIALS)
    if style == "llama":
        bos = t.token_to_id("<s>")
        t.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
        return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=t,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            chat_template=LLAMA_TEMPLATE,
        )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=t,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template or CHATML_TEMPLATE,
    )


def make_chat_folder(
    path: str | Path,
    style: str = "qwen",
    *,
    emit: int | None = None,
    generation_config: bool = True,
    seed: int = 0,
    chat_template: str | None = None,
    max_position_embeddings: int = 256,
) -> Path:
    """Write a model folder (config.json, safetensors, tokenizer files, for "qwen" a
    generation_config.json with EOS ``[<|im_end|>, <|endoftext|>]`` and
    :data:`QWEN_GENERATION_CONFIG`).

    Args:
        path: the folder (created).
        style: ``"qwen"`` (qwen2 model) or ``"llama"`` (llama model).
        emit: make the model emit this token id at every step (see the module
            docstring); None = plain random weights.
        generation_config: write the "qwen" generation_config.json (False: none).
        seed: torch seed of the random weights.
        chat_template: the "qwen" folder's template instead of :data:`CHATML_TEMPLATE`
            (e.g. :data:`HERMES_TEMPLATE`).
        max_position_embeddings: the model's context length.

    Returns:
        The folder.
    """
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(style, chat_template)
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = {
        "qwen": dict(bos_token_id=endoftext, eos_token_id=endoftext),
        "llama": dict(
            bos_token_id=tok.convert_tokens_to_ids("<s>"),
            eos_token_id=tok.convert_tokens_to_ids("</s>"),
        ),
    }[style]
    model_type = "qwen2" if style == "qwen" else "llama"
    cfg = CONFIG_MAPPING[model_type](  # type: ignore[call-arg]
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()  # type: ignore[no-untyped-call]
    if emit is not None:
        set_emitted_token(model, emit)
    model.save_pretrained(out)
    gen_path = out / "generation_config.json"
    if gen_path.exists():
        gen_path.unlink()  # save_pretrained derives one from config.json: write ours only
    if style == "qwen" and generation_config:
        eos = [tok.convert_tokens_to_ids("<|im_end|>"), endoftext]
        GenerationConfig(  # type: ignore[no-untyped-call]
            bos_token_id=endoftext, eos_token_id=eos, do_sample=True, **QWEN_GENERATION_CONFIG
        ).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def set_emitted_token(model: Any, token_id: int) -> None:
    """Make a transformers causal LM (untied ``lm_head``) emit ``token_id`` at every
    step, by a margin of ~1000 logits (see the module docstring). Mutates its weights."""
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 10.0
        head = model.get_output_embeddings().weight
        head.zero_()
        head[token_id, 0] = 1000.0
