"""A tiny random-weight Qwen3-style model with a locally trained tokenizer, for tests and quickstarts.

`init_tiny_model(dir)` writes a Hugging Face model directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a Qwen-style chat template)
that transformers (`AutoModelForCausalLM`, `AutoTokenizer`) and SGLang load offline. Nothing is
downloaded: the byte-level BPE tokenizer is trained in well under a second on a synthetic corpus
of shell, Python and English text, and the weights are random (seeded, so reproducible).

Defaults: `Qwen3ForCausalLM`, hidden 64, 2 layers, 4 attention heads, 2 KV heads, head_dim 16,
intermediate 128, untied embeddings (`lm_head.weight` is its own tensor, the general case for
weight updates), fp32, 4096 positions, vocab about 1k. Any `Qwen3Config` field can be
overridden by keyword (e.g. `num_hidden_layers=4`, `tie_word_embeddings=True`); `vocab_size`
is always the tokenizer's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
BPE_VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool with <tool_call>\\n{"name": <name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{%- if loop.first and message['content'] %}{{- '\\n' }}{%- endif %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen's ChatML layout, `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, with Qwen's tool format:
the tools (JSON schemas) in the system turn, an assistant's calls as `<tool_call>` JSON, tool results
as `<tool_response>` blocks in a user turn. Without tools it renders plain ChatML."""

DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

_WORD_TEXT = (
    "the a an to of and in is it that for on with as this be are was fix bug issue test tests error "
    "function return value list dict string file line path repo patch change update add remove check "
    "should must when if else import from class def self None True False raise except try print len "
    "range open read write assert cd ls cat grep sed echo python pytest git diff apply submit run "
    "command output exit code failed passed module package install version"
)
_WORDS = _WORD_TEXT.split()
_SYMBOLS = list("()[]{}:;,.=+-*/<>!'\"#_|&$%\\`~@^?")


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic synthetic text mixing words, identifiers, numbers, symbols and some non-ASCII."""
    rng = random.Random(seed)
    extra = ["héllo", "naïve", "日本", "✓", "→", "ß"]
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(3, 14)):
            roll = rng.random()
            if roll < 0.6:
                parts.append(rng.choice(_WORDS))
            elif roll < 0.75:
                parts.append("_".join(rng.sample(_WORDS, 2)))
            elif roll < 0.85:
                parts.append(str(rng.randint(0, 999)))
            elif roll < 0.97:
                parts.append(rng.choice(_SYMBOLS))
            else:
                parts.append(rng.choice(extra))
        indent = " " * rng.choice((0, 0, 4, 8))
        out.append(indent + " ".join(parts))
    return out


def train_tokenizer(seed: int = 0, vocab_size: int = BPE_VOCAB_SIZE) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` with Qwen's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEFAULT_CONFIG["max_position_embeddings"],
    )


def init_tiny_model(directory: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random Qwen3 model and its tokenizer to `directory` (created); returns the path."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed)
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)]
    unknown = sorted(key for key in overrides if not hasattr(Qwen3Config(), key) or key == "vocab_size")
    if unknown:
        raise ValueError(f"unknown tiny-model setting(s) {unknown}: use Qwen3Config fields (vocab_size is fixed)")
    settings = {**DEFAULT_CONFIG, **overrides, "vocab_size": len(tokenizer)}
    if settings["num_attention_heads"] % settings["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads ({settings['num_attention_heads']}) must be a multiple of "
            f"num_key_value_heads ({settings['num_key_value_heads']})"
        )
    config = Qwen3Config(**settings, bos_token_id=None, eos_token_id=eos_ids[0], pad_token_id=eos_ids[1])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=eos_ids[1], bos_token_id=None, do_sample=False
    )
    model.save_pretrained(path)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(path)
    return path
