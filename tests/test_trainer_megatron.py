"""The Megatron trainer run for real on CPU: torchrun, gloo, TP=2, DP=2 and PP=2 against TP=1."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from patchgym.backends.trainer.embedded import EmbeddedTrainer  # noqa: E402
from patchgym.core.batch import TrainBatch  # noqa: E402
from tests.megatron_recipe import embedded_run  # noqa: E402
from tests.tiny_models import random_samples, tiny_qwen3  # noqa: E402
from tests.torchrun_launch import torchrun_json  # noqa: E402

WORKER = Path(__file__).with_name("megatron_worker.py")
TORCHRUN_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(4 * TORCHRUN_TIMEOUT_S + 300)  # the first test pays for four torchrun programs
SAFETY = 2
"""Two float32 computations of the same thing in different reduction orders (TP=1 vs TP=2, megatron vs
transformers) each carry float32's rounding error E, measured below as float32 minus float64 over the same
steps, so they differ by up to 2E; tolerances are SAFETY * 2E. Measured: E = 4.8e-7 (log-probs), 2.9e-7
(losses), 8.8e-7 (relative grad norm), 1.2e-4 (weights after 6 Adam steps at lr 3e-3); TP2, DP2 and PP2 vs TP1
differed by at most 0.50, 0.42, 0.37 and 0.12 of 2E (0.16 for the 3.7e-5 a loaded CI machine saw)."""
FP32_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Tolerances:
    logprob: float
    loss: float
    grad_norm_rel: float
    weight: float


def rounding_bound(errors: list[float], magnitudes: list[float]) -> float:
    """SAFETY * 2 * the largest measured error, at least the rounding of the largest value to float32."""
    return SAFETY * 2 * max(max(errors), FP32_EPS * max(magnitudes))


def torchrun(model: Path, out: Path, nproc: int, tp: int, pp: int = 1) -> dict:
    return torchrun_json(WORKER, out, nproc, model, out, tp, pp, timeout_s=TORCHRUN_TIMEOUT_S)


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


@pytest.fixture(scope="module")
def tol(runs: dict) -> Tolerances:
    """The size of float32 rounding error in the tests' training, measured on the embedded trainer."""
    fp32, fp64 = (asyncio.run(embedded_run(runs["model"], dtype)) for dtype in ("float32", "float64"))
    pairs = zip(fp32["logprobs"], fp64["logprobs"], strict=True)
    logprobs = [(a, b) for ra, rb in pairs for a, b in zip(ra, rb, strict=True)]
    steps = list(zip(fp32["steps"], fp64["steps"], strict=True))
    weights = [((fp32["weights"][k] - w).abs().max().item(), w.abs().max().item()) for k, w in fp64["weights"].items()]
    return Tolerances(
        logprob=rounding_bound([abs(a - b) for a, b in logprobs], [abs(b) for _, b in logprobs]),
        loss=rounding_bound([abs(a["loss"] - b["loss"]) for a, b in steps], [abs(b["loss"]) for _, b in steps]),
        grad_norm_rel=rounding_bound([abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in steps], [1.0]),
        weight=rounding_bound([error for error, _ in weights], [size for _, size in weights]),
    )


def assert_same_run(reference: dict, other: dict, name: str, tol: Tolerances) -> None:
    """Same log-probs, and the same loss and grad norm at every step, as the reference layout."""
    for a, b in zip(reference["logprobs"], other["logprobs"], strict=True):
        assert b == pytest.approx(a, abs=tol.logprob), name
    for kind in ("sft", "grpo"):
        for a, b in zip(reference[kind], other[kind], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=0, abs=tol.loss), (name, kind)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=tol.grad_norm_rel), (name, kind)


def test_tolerances_are_float32_rounding_not_a_bug(tol: Tolerances) -> None:
    """The measured bounds are rounding-sized: a real layout bug (a misplaced shard) moves values by ~1e-2."""
    assert 0 < tol.logprob < 1e-4 and 0 < tol.loss < 1e-4 and 0 < tol.grad_norm_rel < 1e-4 and 0 < tol.weight < 1e-3


def test_same_hf_weights_same_logprobs_as_embedded(runs: dict, tol: Tolerances) -> None:
    embedded = EmbeddedTrainer(runs["model"])
    samples = random_samples(8, seed=22)
    expected = asyncio.run(embedded.logprobs(TrainBatch(samples)))
    tempered = asyncio.run(embedded.logprobs(TrainBatch(samples, temperature=0.7)))  # the sampling temperature
    for name in ("tp1", "tp2", "dp2", "pp2"):
        for key, reference in (("logprobs", expected), ("logprobs_t07", tempered)):
            for a, b in zip(runs[name][key], reference, strict=True):
                assert a == pytest.approx(b, abs=tol.logprob), (name, key)
    assert tempered[0][5:] != pytest.approx(expected[0][5:], abs=1e-3)


def test_tp2_dp2_and_pp2_match_tp1_over_several_steps(runs: dict, tol: Tolerances) -> None:
    assert runs["tp2"]["settings"]["tp"] == 2 and runs["dp2"]["settings"]["dp"] == 2
    assert runs["pp2"]["settings"]["pp"] == 2 and runs["pp2"]["settings"]["dp"] == 1
    assert {runs[n]["settings"]["device"] for n in ("tp1", "tp2", "dp2", "pp2")} == {"cpu"}  # no GPU here
    for name in ("tp2", "dp2", "pp2"):
        assert_same_run(runs["tp1"], runs[name], name, tol)
    grpo = runs["tp2"]["grpo"][-1]
    assert {"clip_fraction", "logprob_gap", "is_ess", "entropy"} <= set(grpo)
    # DP2 splits the SFT batch's samples by tokens, 102 and 99 (round robin over its micro-batches: 106 and 95)
    assert runs["dp2"]["sft"][0]["dp_tokens_max_over_mean"] == pytest.approx(102 / 100.5)
    assert runs["tp1"]["sft"][0]["dp_tokens_max_over_mean"] == 1.0


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


def test_export_loads_in_transformers_exactly(runs: dict, tol: Tolerances) -> None:
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
            torch.testing.assert_close(exported[name][k], exported["tp1"][k], atol=tol.weight, rtol=0)


def test_tied_embeddings_pp2_match_pp1_and_export_once(tied: dict, tol: Tolerances) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert_same_run(tied["pp1"], tied["pp2"], "tied pp2", tol)
    for a, b in zip(tied["pp2"]["grpo"], tied["pp2"]["grpo_resumed"], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    names = set(load_file(tied["model"] / "model.safetensors"))
    assert "lm_head.weight" not in names
    pp1, pp2 = (load_file(tied["base"] / name / "hf" / "model.safetensors") for name in ("pp1", "pp2"))
    assert set(pp1) == set(pp2) == names
    for k in names:
        torch.testing.assert_close(pp2[k], pp1[k], atol=tol.weight, rtol=0)
    loaded = AutoModelForCausalLM.from_pretrained(tied["base"] / "pp2" / "hf", local_files_only=True)
    assert torch.equal(loaded.lm_head.weight, pp2["model.embed_tokens.weight"])
