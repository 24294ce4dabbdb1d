"""The tiny-model factory writes a Hugging Face model that transformers loads offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from patchgym.cli import app

MESSAGES = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "héllo ✓ 日本\n    def f(x): return x"},
]


def test_model_and_tokenizer_load_and_generate(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from patchgym.models.tiny import IM_END, IM_START

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == len(tokenizer)
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 16
    assert model.config.tie_word_embeddings is False

    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{IM_START}system\nYou fix bugs.{IM_END}\n{IM_START}user\n{MESSAGES[1]['content']}{IM_END}\n"
        f"{IM_START}assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # byte-level: any text round-trips
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 3
    assert tokenizer.eos_token == IM_END

    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, len(ids) + 5) or int(out[0, -1]) in model.generation_config.eos_token_id


def test_same_seed_same_model_other_seed_differs(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    from patchgym.models.tiny import init_tiny_model

    again = load_file(init_tiny_model(tmp_path / "a", seed=0) / "model.safetensors")
    other = load_file(init_tiny_model(tmp_path / "b", seed=1, num_hidden_layers=1) / "model.safetensors")
    first = load_file(tiny_model_dir / "model.safetensors")
    assert again.keys() == first.keys() and all((again[k] == first[k]).all() for k in first)
    assert "lm_head.weight" in first
    assert not any(k.startswith("model.layers.1.") for k in other)


def test_bad_override_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    from patchgym.models.tiny import init_tiny_model

    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        init_tiny_model(tmp_path, num_attention_heads=3, num_key_value_heads=2)
    with pytest.raises(ValueError, match="hidden_sise"):
        init_tiny_model(tmp_path, hidden_sise=32)


def test_cli_init_tiny(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(app, ["model", "init-tiny", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "m").iterdir()
    }
