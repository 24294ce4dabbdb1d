"""The Megatron trainer run for real on CPU: torchrun, gloo, TP=2, DP=2 and PP=2 against TP=1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from patchgym.backends.trainer.embedded import EmbeddedTrainer  # noqa: E402
from patchgym.core.batch import TrainBatch  # noqa: E402
from tests.tiny_models import random_samples, tiny_qwen3  # noqa: E402
from tests.torchrun_launch import torchrun_json  # noqa: E402

WORKER = Path(__file__).with_name("megatron_worker.py")
LOGPROB_TOLERANCE = 1e-5
"""Same HF weights, embedded (transformers) vs megatron, float32: per-token log-probs agree to this."""
LOSS_REL, LOSS_ABS, GRAD_NORM_REL = 1e-4, 1e-5, 1e-3
"""Another parallel layout vs TP=1, float32, over several optimiser steps (measured: PP=2 within 3e-7)."""


def torchrun(model: Path, out: Path, nproc: int, tp: int, pp: int = 1) -> dict:
    return torchrun_json(WORKER, out, nproc, model, out, tp, pp, timeout_s=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("megatron")
    model = tiny_qwen3(base / "model")
    return {
        "model": model,
        "tp1": torchrun(model, base / "tp1", 1, 1),
        "tp2": torchrun(model, base / "tp2", 2, 2),
        "dp2": torchrun(model, base / "dp2", 2, 1),
        "pp2": torchrun(model, base / "pp2", 2, 1, pp=2),
        "base": base,
    }


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tied embeddings: with PP=2 the last stage holds megatron's copy of the first stage's embedding."""
    base = tmp_path_factory.mktemp("megatron_tied")
    model = tiny_qwen3(base / "model", tie=True)
    return {
        "model": model,
        "pp1": torchrun(model, base / "pp1", 1, 1),
        "pp2": torchrun(model, base / "pp2", 2, 1, pp=2),
        "base": base,
    }


def assert_same_run(reference: dict, other: dict, name: str) -> None:
    """Same log-probs, and the same loss and grad norm at every step, as the reference layout."""
    for a, b in zip(reference["logprobs"], other["logprobs"], strict=True):
        assert b == pytest.approx(a, abs=LOGPROB_TOLERANCE), name
    for kind in ("sft", "grpo"):
        for a, b in zip(reference[kind], other[kind], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_REL, abs=LOSS_ABS), (name, kind)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=GRAD_NORM_REL), (name, kind)


def test_same_hf_weights_same_logprobs_as_embedded(runs: dict) -> None:
    embedded = EmbeddedTrainer(runs["model"])
    samples = random_samples(8, seed=22)
    expected = asyncio.run(embedded.logprobs(TrainBatch(samples)))
    tempered = asyncio.run(embedded.logprobs(TrainBatch(samples, temperature=0.7)))  # the sampling temperature
    for name in ("tp1", "tp2", "dp2", "pp2"):
        for key, reference in (("logprobs", expected), ("logprobs_t07", tempered)):
            for a, b in zip(runs[name][key], reference, strict=True):
                assert a == pytest.approx(b, abs=LOGPROB_TOLERANCE), (name, key)
    assert tempered[0][5:] != pytest.approx(expected[0][5:], abs=1e-3)


def test_tp2_dp2_and_pp2_match_tp1_over_several_steps(runs: dict) -> None:
    assert runs["tp2"]["settings"]["tp"] == 2 and runs["dp2"]["settings"]["dp"] == 2
    assert runs["pp2"]["settings"]["pp"] == 2 and runs["pp2"]["settings"]["dp"] == 1
    for name in ("tp2", "dp2", "pp2"):
        assert_same_run(runs["tp1"], runs[name], name)
    grpo = runs["tp2"]["grpo"][-1]
    assert {"clip_fraction", "logprob_gap", "is_ess", "entropy"} <= set(grpo)


def test_save_load_resumes_exactly(runs: dict) -> None:
    for name in ("tp1", "tp2", "dp2", "pp2"):
        for a, b in zip(runs[name]["grpo"], runs[name]["grpo_resumed"], strict=True):
            assert (a["loss"], a["grad_norm"], a["version"]) == (b["loss"], b["grad_norm"], b["version"]), name


def test_no_gradient_no_step_set_lr_and_reset_optimizer(runs: dict) -> None:
    for name in ("tp1", "tp2", "dp2", "pp2"):
        run = runs[name]
        assert run["no_signal"]["optimizer_skipped"] == 1.0 and run["no_signal_unchanged"], name
        assert run["after_reset"]["lr"] == pytest.approx(1e-4) and run["after_reset"]["optimizer_skipped"] == 0.0
        # Adam's first step from empty moments moves every parameter with a gradient by lr (sign-like)
        assert run["after_reset_max_change"] == pytest.approx(1e-4, rel=1e-3), name


def test_sft_loss_decreases(runs: dict) -> None:
    losses = [m["loss"] for m in runs["tp2"]["sft"]]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.9 * losses[0], losses


def test_export_loads_in_transformers_exactly(runs: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(runs["model"], local_files_only=True).state_dict()
    exported = {}
    for name in ("tp1", "tp2", "dp2", "pp2"):
        directory = runs["base"] / name / "hf"
        loaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).state_dict()
        on_disk = load_file(directory / "model.safetensors")
        assert set(on_disk) == set(initial)  # the HF names transformers and SGLang load
        assert all(torch.equal(loaded[k], on_disk[k]) for k in on_disk)  # exact round trip
        assert not torch.equal(
            loaded["model.layers.0.mlp.gate_proj.weight"], initial["model.layers.0.mlp.gate_proj.weight"]
        )
        exported[name] = loaded
    for name in ("tp2", "dp2", "pp2"):
        for k in initial:
            torch.testing.assert_close(exported[name][k], exported["tp1"][k], atol=1e-5, rtol=1e-4)


def test_tied_embeddings_pp2_match_pp1_and_export_once(tied: dict) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert_same_run(tied["pp1"], tied["pp2"], "tied pp2")
    for a, b in zip(tied["pp2"]["grpo"], tied["pp2"]["grpo_resumed"], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    names = set(load_file(tied["model"] / "model.safetensors"))
    assert "lm_head.weight" not in names
    pp1, pp2 = (load_file(tied["base"] / name / "hf" / "model.safetensors") for name in ("pp1", "pp2"))
    assert set(pp1) == set(pp2) == names
    for k in names:
        torch.testing.assert_close(pp2[k], pp1[k], atol=1e-5, rtol=1e-4)
    loaded = AutoModelForCausalLM.from_pretrained(tied["base"] / "pp2" / "hf", local_files_only=True)
    assert torch.equal(loaded.lm_head.weight, pp2["model.embed_tokens.weight"])
