"""The reference recipe (configs/reference/qwen3-30b-a3b-mi355x.yaml) validates, and its TP4/EP8 layout is one
megatron-core accepts for Qwen3-30B-A3B."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from patchgym.backends.trainer.parallel import MegatronLayout
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
    from patchgym.launch.engines import EngineLaunch
    from patchgym.launch.ranks import megatron_backend

    config = load_run_config(REFERENCE)
    assert (config.trainer.name, config.inference.name) == ("megatron", "sglang")
    inspect.signature(megatron_backend).bind(config.model.path, **config.trainer.options)
    trainer_options = {k: v for k, v in config.trainer.options.items() if k != "dp"}  # dp is the backend's
    inspect.signature(MegatronTrainer).bind(config.model.path, **trainer_options)
    client = {k: v for k, v in config.inference.options.items() if k != "launch"}
    inspect.signature(SGLangEngine).bind(["url"], **client)
    EngineLaunch.model_validate(config.inference.options["launch"])


def test_tp4_ep8_layout_is_accepted_by_megatron_core() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    from patchgym.backends.trainer.megatron_convert import Layout

    options = load_run_config(REFERENCE).trainer.options
    layout = MegatronLayout.from_options(**{k: options[k] for k in ("tp", "pp", "dp", "ep", "etp")})
    model = Layout(transformers.Qwen3MoeConfig(**QWEN3_30B_A3B))
    config = model.transformer_config(
        tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, dtype=getattr(torch, options["dtype"])
    )
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (128, 8, 768)
    assert (config.tensor_model_parallel_size, config.expert_model_parallel_size) == (4, 8)
    assert config.expert_tensor_parallel_size == 1 and config.bf16 and config.sequence_parallel
    assert (layout.world, layout.dp, layout.expert_dp) == (8, 2, 1)  # one MI355X node
    assert MegatronLayout.for_world(8, tp=4, pp=1, ep=8, etp=1) == layout  # what the trainer derives from its world
    # megatron's own rank arithmetic for the dense and the expert layers (raises on a bad split)
    RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
    RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
    with pytest.raises(ConfigError, match="lower etp"):
        MegatronLayout.for_world(8, tp=4, pp=1, ep=8, etp=4)  # experts TP-split like the dense layers: 8 / 4 < 8


@pytest.mark.parametrize("path", sorted(REFERENCE.parent.parent.rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_scores_an_unsubmitted_episode_zero(path: Path) -> None:
    """README: every shipped config uses `env.unsubmitted: zero` (with `graded`, GRPO drifted to the turn cap)."""
    assert load_run_config(path).env.unsubmitted == "zero"


def test_reference_cluster_places_on_four_nodes_and_leaves_ray_start_settings_to_ray_start() -> None:
    """The cluster block is live (not commented out): one trainer node and three inference nodes of 8 GPUs,
    each role pinned to its nodes by a custom resource; RAY_EXPERIMENTAL_NOSET_* is the image's, not the run's."""
    cluster = load_run_config(REFERENCE).cluster
    assert cluster is not None and cluster.backend == "ray"
    assert [(n.name, n.gpus, n.gpu_memory_gb) for n in cluster.node_list()] == [
        ("trainer", 8, 288), ("inference-0", 8, 288), ("inference-1", 8, 288), ("inference-2", 8, 288),
    ]  # fmt: skip
    assert cluster.trainer.resources == {"trainer_node": 1} and cluster.engines.resources == {"engine_node": 1}
    assert not any(name.startswith("RAY_EXPERIMENTAL_NOSET_") for name in cluster.env)
    dockerfile = (REFERENCE.parent.parent.parent / "deploy" / "Dockerfile.rocm").read_text()
    assert "ENV RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1" in dockerfile


def test_the_reference_token_settings_need_varlen_attention() -> None:
    """A 64K-token trajectory fits one micro-batch; the trainer's dense-attention cap refuses 65,536 tokens on
    a 288 GB MI355X (48 layers x 8 heads per TP4 rank of [s, s] scores: ~2 TB), and varlen passes it."""
    from patchgym.backends.trainer.megatron_memory import check_dense_fits

    config = load_run_config(REFERENCE)
    options = config.trainer.options
    assert options["attention"] == "varlen"
    assert config.agent.max_tokens_per_trajectory <= options["micro_batch_tokens"] == 65536
    heads = QWEN3_30B_A3B["num_attention_heads"] / options["tp"]
    shape = dict(tokens=options["micro_batch_tokens"], heads=heads, layers=QWEN3_30B_A3B["num_hidden_layers"],
                 act_bytes=2, device_bytes=288e9, device="an MI355X")  # fmt: skip
    check_dense_fits(attention=options["attention"], **shape)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="attention: dense at micro_batch_tokens=65536 .* attention: varlen"):
        check_dense_fits(attention="dense", **shape)  # type: ignore[arg-type]
