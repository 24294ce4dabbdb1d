"""The dry run's memory arithmetic (`patchgym.launch.memory`): parameter counts against the real models,
the public figures of the reference model, and how each setting moves the estimate."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from patchgym.backends.trainer.parallel import MegatronLayout
from patchgym.core.errors import ConfigError
from patchgym.launch.memory import (
    ESTIMATE_DEFAULTS,
    GB,
    MemoryEstimate,
    ModelDims,
    TrainerMemorySettings,
    check_fits,
    engine_memory,
    trainer_memory,
)
from tests.test_reference_config import QWEN3_30B_A3B

QWEN = ModelDims.from_hf({**QWEN3_30B_A3B, "model_type": "qwen3_moe", "torch_dtype": "bfloat16"})
REFERENCE = MegatronLayout(tp=4, pp=1, dp=2, ep=8, etp=1)
MI355X = 288 * GB
TiB = 2**40


def estimate(layout: MegatronLayout = REFERENCE, rank: int = 0, **settings: object) -> MemoryEstimate:
    return trainer_memory(QWEN, layout, TrainerMemorySettings(dtype="bfloat16", **settings), rank, MI355X)  # type: ignore[arg-type]


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
def test_parameter_count_is_the_hf_models(tmp_path: Path, moe: bool) -> None:
    """Every weight counted once: the same total as transformers' model of the same config.json."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_models import tiny_qwen3, tiny_qwen3_moe

    directory = tiny_qwen3_moe(tmp_path / "m") if moe else tiny_qwen3(tmp_path / "m")
    config = transformers.AutoConfig.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    dims = ModelDims.from_hf(config.to_dict())
    assert dims.total_params() == sum(p.numel() for p in model.parameters())


def test_the_reference_model_matches_its_public_figures() -> None:
    """gpu-scale-facts: 30.5 B parameters; about 4.0 B per rank at TP4/EP8; 96 KiB of bf16 KV per token;
    about 1.43 M KV tokens per MI355X at mem_fraction_static 0.7; unfused attention at 64K tokens ~9.2 TiB."""
    assert QWEN.total_params() == pytest.approx(30.5e9, rel=0.01)
    assert estimate().facts["params"] == pytest.approx(4.0e9, rel=0.02)
    engine = engine_memory(QWEN, tp=1, dtype="auto", mem_fraction_static=0.7, context_length=65536, device_bytes=MI355X)
    assert engine.facts["kv_bytes_per_token"] == 96 * 1024
    assert engine.facts["kv_tokens"] == pytest.approx(1.43e6, rel=0.01)
    assert engine.parts["weights"] == pytest.approx(61e9, rel=0.01)
    dense = estimate(micro_batch_tokens=65536, attention="dense").parts["activations"]
    assert dense == pytest.approx(9.2 * TiB, rel=0.1)


def test_varlen_attention_is_linear_in_tokens_and_dense_is_quadratic() -> None:
    acts = {
        (attention, tokens): estimate(micro_batch_tokens=tokens, attention=attention).parts["activations"]
        for attention in ("varlen", "dense")
        for tokens in (16384, 32768)
    }
    assert acts["varlen", 32768] / acts["varlen", 16384] == pytest.approx(2.0, rel=1e-6)
    assert acts["dense", 32768] / acts["dense", 16384] > 3.5


def test_recompute_offload_and_sharding_each_shrink_their_part() -> None:
    recomputes = ("none", "selective", "full")
    none, selective, full = (estimate(attention="dense", recompute=r).parts["activations"] for r in recomputes)
    assert full < selective < none
    offloaded = estimate(optimizer_cpu_offload=True)
    assert offloaded.parts["optimizer"] == 0 and offloaded.host["optimizer"] == estimate().parts["optimizer"]
    unsharded = estimate(use_distributed_optimizer=False).parts["optimizer"]
    fp32 = TrainerMemorySettings(dtype="float32", use_distributed_optimizer=False)
    single = trainer_memory(QWEN, REFERENCE, fp32, 0, None).parts["optimizer"]
    assert unsharded > estimate().parts["optimizer"]  # the dense part is split over dp=2
    assert unsharded == pytest.approx(single * 12 / 8)  # bf16 adds the fp32 main parameters to Adam's moments
    assert estimate(sync_bucket_bytes=1 << 30).parts["weight sync"] == 3 * (1 << 30)


def test_pipeline_stages_hold_their_share() -> None:
    """With pp=2 the first stage holds the embedding and two micro-batches in flight, the last the logits."""
    layout = MegatronLayout(tp=4, pp=2, dp=1, ep=4, etp=1)
    first, last = estimate(layout, rank=0), estimate(layout, rank=4)
    assert first.parts["logits"] == 0 < last.parts["logits"]
    assert first.parts["activations"] == pytest.approx(2 * last.parts["activations"])


def test_a_setting_the_estimate_cannot_read_is_refused() -> None:
    with pytest.raises(ConfigError, match="attention: 'flash' is not one of varlen, dense"):
        TrainerMemorySettings.from_options({"attention": "flash"})
    with pytest.raises(ConfigError, match="recompute"):
        TrainerMemorySettings.from_options({"recompute": "uniform"})
    with pytest.raises(ConfigError, match="negative"):
        MemoryEstimate({"weights": -1.0})


def test_what_does_not_fit_names_the_part_and_the_setting() -> None:
    too_long = estimate(micro_batch_tokens=65536, attention="dense")
    with pytest.raises(ConfigError, match=r"trainer-rank-0 needs about \d+ GB .* attention: varlen"):
        check_fits("trainer-rank-0", too_long, "trainer")
    check_fits("trainer-rank-0", estimate(micro_batch_tokens=65536), "trainer")  # the reference fits
    small = engine_memory(QWEN, tp=1, dtype="auto", mem_fraction_static=0.2, context_length=8192, device_bytes=MI355X)
    with pytest.raises(ConfigError, match="weights take 61.1 GB per GPU, more than mem_fraction_static=0.2"):
        check_fits("sglang-engine-0", small, "engine")
    h100 = engine_memory(QWEN, tp=1, dtype="auto", mem_fraction_static=0.8, context_length=65536, device_bytes=80e9)
    with pytest.raises(ConfigError, match="KV cache holds 29864 tokens, fewer than one sequence"):
        check_fits("sglang-engine-0", h100, "engine")
    check_fits("sglang-engine-0", engine_memory(QWEN, tp=2, dtype="auto", mem_fraction_static=0.8,
                                                  context_length=65536, device_bytes=80e9), "engine")  # fmt: skip


def test_the_estimates_defaults_are_the_trainers() -> None:
    """Each setting the estimate reads defaults to the Megatron trainer's own default, once the trainer has it
    (sync_bucket_bytes is being added to it)."""
    pytest.importorskip("megatron.core")
    from patchgym.backends.trainer.megatron import MegatronTrainer

    parameters = inspect.signature(MegatronTrainer).parameters
    shared = {name for name in ESTIMATE_DEFAULTS if name in parameters}
    assert {"dtype", "micro_batch_tokens", "use_distributed_optimizer", "attention", "recompute"} <= shared
    assert "optimizer_cpu_offload" in shared
    assert {name: parameters[name].default for name in shared} == {name: ESTIMATE_DEFAULTS[name] for name in shared}
