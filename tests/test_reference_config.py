"""The reference recipe (configs/reference/qwen3-30b-a3b-mi355x.yaml) validates, and its TP4/EP8 layout is one
megatron-core accepts for Qwen3-30B-A3B."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from patchgym.core.errors import ConfigError
from patchgym.pipeline.config import load_run_config

REFERENCE = Path(__file__).resolve().parent.parent / "configs" / "reference" / "qwen3-30b-a3b-mi355x.yaml"
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=262144, rope_theta=10000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
"""config.json of Qwen/Qwen3-30B-A3B-Instruct-2507 on the Hugging Face Hub (not downloaded here)."""


def test_reference_config_validates_with_the_recipe_settings() -> None:
    config = load_run_config(REFERENCE)
    assert (config.agent.max_new_tokens_per_turn, config.agent.max_tokens_per_trajectory) == (8192, 65536)
    assert config.env.max_turns == 80
    rollout = config.grpo.rollout
    assert (rollout.mode, rollout.group_size, rollout.group_size * rollout.batch_groups) == ("fully_async", 8, 384)
    assert config.grpo.loss.clip_high > config.grpo.loss.clip_low and config.grpo.loss.tis_cap is not None
    assert config.inference.options["max_context"] == 65536


def test_reference_component_options_match_the_factories() -> None:
    pytest.importorskip("torch")
    from patchgym.backends.inference.sglang import SGLangEngine
    from patchgym.backends.trainer.megatron import MegatronTrainer

    config = load_run_config(REFERENCE)
    assert (config.trainer.name, config.inference.name) == ("megatron", "sglang")
    inspect.signature(MegatronTrainer).bind(config.model.path, **config.trainer.options)
    inspect.signature(SGLangEngine).bind(**config.inference.options)


def test_tp4_ep8_layout_is_accepted_by_megatron_core() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    from patchgym.backends.trainer.megatron_convert import Layout
    from patchgym.backends.trainer.megatron_moe import check_layout

    options = load_run_config(REFERENCE).trainer.options
    tp, pp, ep, etp = (options[k] for k in ("tp", "pp", "ep", "etp"))
    layout = Layout(transformers.Qwen3MoeConfig(**QWEN3_30B_A3B))
    config = layout.transformer_config(tp=tp, pp=pp, ep=ep, etp=etp, dtype=getattr(torch, options["dtype"]))
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (128, 8, 768)
    assert (config.tensor_model_parallel_size, config.expert_model_parallel_size) == (4, 8)
    assert config.expert_tensor_parallel_size == 1 and config.bf16
    world = 8  # one MI355X node
    dp = check_layout(world, tp=tp, pp=pp, ep=ep, etp=etp)
    assert dp == 2
    # megatron's own rank arithmetic for the dense and the expert layers (raises on a bad split)
    RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-ep-dp-pp")
    with pytest.raises(ConfigError, match="lower etp"):
        check_layout(world, tp=tp, pp=pp, ep=ep, etp=tp)  # experts TP-split like the dense layers: 8 / 4 < 8
