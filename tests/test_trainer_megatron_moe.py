"""Mixture of experts in the Megatron trainer, run for real on CPU: a tiny Qwen3-MoE, EP=2 against EP=1.

Two torchrun launches: EP=1 on one rank (which also measures float32 summation noise by repacking),
and four ranks as TP2 x DP2 with EP2 (experts without TP, sequence parallelism on), which covers
the all-to-all dispatch, balanced micro-batch counts, expert data parallelism and TP with MoE.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from patchgym.backends.trainer.embedded import EmbeddedTrainer  # noqa: E402
from patchgym.backends.trainer.megatron_convert import Layout, fuse_experts  # noqa: E402
from patchgym.core.batch import TrainBatch  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from tests.tiny_models import random_samples, tiny_qwen3_moe  # noqa: E402
from tests.torchrun_launch import free_port, torchrun_json  # noqa: E402

LOGPROB_TOLERANCE = 1e-5
"""Same weights, two float32 computations of the log-probs: tests/test_trainer_megatron.py measures
float32's rounding of log-probs at E = 4.8e-7 (float32 minus float64); the MoE paths here measured
gaps of 4.8e-7 (trainer vs transformers) and 9.5e-7 (SGLang after a weight load): 1e-5 is 10x that."""

pytestmark = pytest.mark.timeout(1500)  # two torchrun launches and an SGLang server start, on a busy machine

WORKER = Path(__file__).with_name("megatron_moe_worker.py")
NOISE_FACTOR = 8.0
"""EP=2 may differ from EP=1 by this many times the float32 summation noise measured by repacking."""
EPS32 = torch.finfo(torch.float32).eps
EXPORT_REL = 1e-3
"""After 3 steps, EP=2's exported weights differ from EP=1's by at most this fraction of the training update."""


def torchrun(model: Path, out: Path, nproc: int, *, tp: int = 1, ep: int = 1, etp: int = 1) -> dict:
    return torchrun_json(WORKER, out, nproc, model, out, tp, ep, etp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("megatron_moe")
    model = tiny_qwen3_moe(base / "model")
    return {
        "model": model,
        "base": base,
        "ep1": torchrun(model, base / "ep1", 1),
        "ep2": torchrun(model, base / "ep2", 4, tp=2, ep=2, etp=1),  # + TP2 (sequence parallel), DP2
    }


def max_abs_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert set(a) == set(b)
    return max(max(abs(x - y) for x, y in zip(a[k], b[k], strict=True)) for k in a)


def test_conversion_reads_both_hf_layouts_and_writes_the_on_disk_one(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    directory = tiny_qwen3_moe(tmp_path / "m")
    config = transformers.AutoConfig.from_pretrained(directory)
    layout = Layout(config)
    on_disk = load_file(directory / "model.safetensors")
    in_memory = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory  # transformers fuses the experts in memory
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk  # and stores them one by one
    from_disk, from_memory = layout.hf_to_mcore(on_disk), layout.hf_to_mcore(in_memory)
    assert set(from_disk) == set(from_memory)
    assert all(torch.equal(from_disk[k], from_memory[k]) for k in from_disk)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in from_disk
    back = layout.mcore_to_hf(from_disk)
    assert set(back) == set(on_disk) and all(torch.equal(back[k], on_disk[k]) for k in back)
    fused = fuse_experts(back, config.num_hidden_layers, config.num_experts)
    assert set(fused) == set(in_memory) and all(torch.equal(fused[k], in_memory[k]) for k in fused)


def test_moe_layouts_that_cannot_work_are_refused(tmp_path: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(tiny_qwen3_moe(tmp_path / "m", experts=4))
    with pytest.raises(ConfigError, match="not divisible by expert parallel size 3"):
        Layout(config).moe_settings(3)
    config.mlp_only_layers = [0]
    with pytest.raises(ConfigError, match="every layer must be a mixture of experts"):
        Layout(config)
    dense = transformers.Qwen3Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        Layout(dense).moe_settings(2)


def test_logprobs_match_transformers(runs: dict) -> None:
    samples = random_samples(8, seed=22)
    expected = asyncio.run(EmbeddedTrainer(runs["model"]).logprobs(TrainBatch(samples)))
    for name in ("ep1", "ep2"):
        for a, b in zip(runs[name]["logprobs"], expected, strict=True):
            assert a == pytest.approx(b, abs=LOGPROB_TOLERANCE), name


def test_ep2_equals_ep1_on_loss_and_gradients(runs: dict) -> None:
    ep1, ep2 = runs["ep1"], runs["ep2"]
    layout = {k: ep2["settings"][k] for k in ("tp", "ep", "etp", "dp", "world_size")}
    assert layout == {"tp": 2, "ep": 2, "etp": 1, "dp": 2, "world_size": 4} and ep1["settings"]["ep"] == 1
    grad_noise = max_abs_diff(ep1["grads"], ep1["repacked_grads"])
    loss_noise = abs(ep1["grpo"][0]["loss"] - ep1["repacked"]["loss"])
    largest = max(abs(x) for values in ep1["grads"].values() for x in values)
    grad_tol = NOISE_FACTOR * max(grad_noise, EPS32 * largest)
    loss_tol = NOISE_FACTOR * max(loss_noise, EPS32 * abs(ep1["grpo"][0]["loss"]))
    assert max_abs_diff(ep1["grads"], ep2["grads"]) <= grad_tol
    assert abs(ep2["grpo"][0]["loss"] - ep1["grpo"][0]["loss"]) <= loss_tol
    norm1 = math.sqrt(sum(x * x for values in ep1["grads"].values() for x in values))
    assert ep2["grpo"][0]["grad_norm"] == pytest.approx(norm1, rel=1e-5)  # megatron's norm covers every expert
    assert ep1["grpo"][0]["grad_norm"] == pytest.approx(norm1, rel=1e-5)


def test_grpo_steps_run_and_learn(runs: dict) -> None:
    for name in ("ep1", "ep2"):
        steps = runs[name]["grpo"]
        assert all(s["optimizer_skipped"] == 0.0 and math.isfinite(s["loss"]) for s in steps), name
        assert {"clip_fraction", "logprob_gap", "is_ess", "entropy"} <= set(steps[-1])
        assert steps[-1]["loss"] < steps[0]["loss"], name  # the same batch again: its GRPO loss falls
        before, after = (sum(runs[name][key], []) for key in ("logprobs", "logprobs_after"))
        assert max(abs(x - y) for x, y in zip(before, after, strict=True)) > 1e-3, name  # the weights moved
    for a, b in zip(runs["ep1"]["grpo"], runs["ep2"]["grpo"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_export_loads_in_transformers_exactly(runs: dict) -> None:
    from safetensors.torch import load_file

    initial = load_file(runs["model"] / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(runs["model"])
    exported = {}
    for name in ("ep1", "ep2"):
        directory = runs["base"] / name / "hf"
        on_disk = load_file(directory / "model.safetensors")
        assert set(on_disk) == set(initial)  # per-expert names, as transformers and SGLang read them
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).state_dict()
        fused = fuse_experts(on_disk, config.num_hidden_layers, config.num_experts)
        assert set(fused) == set(loaded) and all(torch.equal(loaded[k], fused[k]) for k in fused)
        assert not torch.equal(
            on_disk["model.layers.0.mlp.experts.3.up_proj.weight"],
            initial["model.layers.0.mlp.experts.3.up_proj.weight"],
        )
        exported[name] = on_disk
    # Adam turns float32 noise in near-zero gradients into sign-sized steps, so the layouts' weights are
    # compared relative to how far training moved them (measured: at most 2.2e-5 of it, lm_head)
    for k in initial:
        moved = (exported["ep1"][k] - initial[k]).norm()
        assert (exported["ep2"][k] - exported["ep1"][k]).norm() <= EXPORT_REL * moved, k
    for a, b in zip(runs["ep1"]["logprobs_after"], runs["ep2"]["logprobs_after"], strict=True):
        assert b == pytest.approx(a, abs=LOGPROB_TOLERANCE)  # the trained models agree token by token


def test_cpu_shim_is_inert_when_cuda_is_available() -> None:
    """With a GPU reported, install() patches nothing: megatron's dispatcher and CUDA calls stay as shipped."""
    program = """
import torch
torch.cuda.is_available = lambda: True
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D
from megatron.core.transformer import utils as tutils
before = (D._maybe_dtoh_and_synchronize, D.cuda_dtoh_stream, hasattr(moe_utils, "te_general_gemm"),
          torch.cuda.current_device, torch.cuda.synchronize, tutils.get_default_causal_mask)
from patchgym.backends.trainer import mcore_cpu
assert not mcore_cpu.needed()
mcore_cpu.install()
with mcore_cpu.active():
    assert torch.empty(1, device="meta").device.type == "meta"
after = (D._maybe_dtoh_and_synchronize, D.cuda_dtoh_stream, hasattr(moe_utils, "te_general_gemm"),
         torch.cuda.current_device, torch.cuda.synchronize, tutils.get_default_causal_mask)
assert before == after and not mcore_cpu._installed, (before, after)
torch.cuda.is_available = lambda: False
assert mcore_cpu.needed()
mcore_cpu.install()
assert D._maybe_dtoh_and_synchronize is not before[0] and moe_utils.te_general_gemm is None
print("inert")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "inert" in proc.stdout, proc.stderr[-3000:]


SGLANG_LOGPROB_TOLERANCE = LOGPROB_TOLERANCE
"""SGLang (CPU, float32, its native MoE path) vs the megatron trainer on the same weights, per token
(measured: 4.8e-7 before training, 9.5e-7 after, so the trainer-vs-transformers bound holds here too)."""


@pytest.fixture(scope="module")
def sglang_moe(runs: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real SGLang server (CPU venv) serving the tiny MoE: no tokenizer, token ids in and out."""
    from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings, launch_sglang, stop_servers
    from patchgym.backends.inference.sglang_venv import stubs_path, venv_python
    from tests.test_sglang import require_sglang_venv

    venv = require_sglang_venv()
    settings = SGLangLaunchSettings(
        runs["model"], python=venv_python(venv), stubs_dir=stubs_path(venv), device="cpu", base_port=free_port(),
        context_length=256, max_total_tokens=4096, dtype="float32", mem_fraction_static=None,
        extra_args=["--skip-tokenizer-init"],
    )  # fmt: skip
    servers = launch_sglang(settings, tmp_path_factory.mktemp("sglang-moe-logs"))
    try:
        yield servers[0].url
    finally:
        stop_servers(servers)


def sglang_logprobs(url: str, samples: list) -> list[list[float]]:
    """Each sample's per-token log-probs as SGLang scores its tokens (entry 0 is 0.0, like the trainer's)."""
    body = {
        "input_ids": [s.token_ids for s in samples],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    response = httpx.post(url + "/generate", json=body, timeout=600)
    response.raise_for_status()
    return [[lp or 0.0 for lp, _, _ in r["meta_info"]["input_token_logprobs"]] for r in response.json()]


def test_sglang_serves_the_moe_with_the_trainers_logprobs(runs: dict, sglang_moe: str) -> None:
    samples = random_samples(8, seed=22)
    served = sglang_logprobs(sglang_moe, samples)
    gap = max(
        abs(a - b) for x, y in zip(served, runs["ep2"]["logprobs"], strict=True) for a, b in zip(x, y, strict=True)
    )
    assert gap <= SGLANG_LOGPROB_TOLERANCE, gap
    # the trained weights, exported by the EP=2 trainer, loaded by SGLang from disk
    response = httpx.post(
        sglang_moe + "/update_weights_from_disk", json={"model_path": str(runs["base"] / "ep2" / "hf")}, timeout=600
    )
    assert response.status_code == 200 and response.json()["success"], response.text
    after = sglang_logprobs(sglang_moe, samples)
    trained = runs["ep2"]["logprobs_after"]
    gap_after = max(abs(a - b) for x, y in zip(after, trained, strict=True) for a, b in zip(x, y, strict=True))
    assert gap_after <= SGLANG_LOGPROB_TOLERANCE, gap_after
    assert after[0][5:] != pytest.approx(served[0][5:], abs=1e-3)  # the weights really changed
    print(f"SGLang vs trainer max |logprob gap|: initial {gap:.2e}, after training {gap_after:.2e}")
