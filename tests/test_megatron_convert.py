"""HF <-> Megatron name and layout conversion (no megatron-core needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from patchgym.backends.trainer.megatron_convert import Layout, shard, unshard  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402


def small(kind: str):
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_round_trip_and_tp_sharding(kind: str) -> None:
    model = small(kind)
    layout = Layout(model.config)
    hf = model.state_dict()
    full = layout.hf_to_mcore(hf)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in full) == (kind == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in full) == (kind == "qwen3")
    back = layout.mcore_to_hf(full)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(back) == set(hf) - tied
    assert all(torch.equal(back[k], hf[k]) for k in back)
    for name, tensor in full.items():
        parts = [shard(name, tensor, 2, r) for r in range(2)]
        assert torch.equal(unshard(name, parts), tensor), name
    # qkv of TP rank 0 holds query group 0 only: its first query heads, then k and v of that group
    qkv0 = shard(
        "decoder.layers.0.self_attention.linear_qkv.weight",
        full["decoder.layers.0.self_attention.linear_qkv.weight"],
        2,
        0,
    )
    d = layout.head_dim
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv0[: 2 * d], q[: 2 * d]) and torch.equal(qkv0[2 * d : 3 * d], k[:d])


def test_unsupported_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="not supported"):
        Layout(transformers.GPT2Config())


def test_each_pipeline_stage_converts_its_own_part() -> None:
    """Per-stage weight groups: stage 0 (embedding, layer 0) and stage 1 (layer 1, norm, head) convert
    separately to disjoint HF tensors that together make the whole model."""
    model = small("llama")
    layout = Layout(model.config)
    full = layout.hf_to_mcore(model.state_dict())
    first = {k: v for k, v in full.items() if k.startswith(("embedding.", "decoder.layers.0."))}
    second = {k: v for k, v in full.items() if k not in first}
    parts = [layout.mcore_to_hf(first), layout.mcore_to_hf(second)]
    assert "model.embed_tokens.weight" in parts[0] and "lm_head.weight" in parts[1]
    assert not set(parts[0]) & set(parts[1])
    whole = layout.mcore_to_hf(full)
    assert {**parts[0], **parts[1]}.keys() == whole.keys()
    assert all(torch.equal(t, whole[k]) for part in parts for k, t in part.items())
