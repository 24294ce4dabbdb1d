"""The Megatron trainer run for real on CPU: torchrun, gloo, TP=2 and DP=2 against TP=1."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from patchgym.backends.trainer.embedded import EmbeddedTrainer  # noqa: E402
from patchgym.core.batch import TrainBatch  # noqa: E402
from tests.tiny_models import random_samples, tiny_qwen3  # noqa: E402

WORKER = Path(__file__).with_name("megatron_worker.py")
LOGPROB_TOLERANCE = 1e-5
"""Same HF weights, embedded (transformers) vs megatron, float32: per-token log-probs agree to this."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(model: Path, out: Path, nproc: int, tp: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(WORKER), str(model), str(out), str(tp),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("megatron")
    model = tiny_qwen3(base / "model")
    return {
        "model": model,
        "tp1": torchrun(model, base / "tp1", 1, 1),
        "tp2": torchrun(model, base / "tp2", 2, 2),
        "dp2": torchrun(model, base / "dp2", 2, 1),
        "base": base,
    }


def test_same_hf_weights_same_logprobs_as_embedded(runs: dict) -> None:
    embedded = EmbeddedTrainer(runs["model"])
    expected = asyncio.run(embedded.logprobs(TrainBatch(random_samples(8, seed=22))))
    for name in ("tp1", "tp2", "dp2"):
        got = runs[name]["logprobs"]
        for a, b in zip(got, expected, strict=True):
            assert a == pytest.approx(b, abs=LOGPROB_TOLERANCE), name


def test_tp2_and_dp2_match_tp1_over_several_steps(runs: dict) -> None:
    assert runs["tp2"]["settings"]["tp"] == 2 and runs["dp2"]["settings"]["dp"] == 2
    for name in ("tp2", "dp2"):
        for kind in ("sft", "grpo"):
            for a, b in zip(runs["tp1"][kind], runs[name][kind], strict=True):
                assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (name, kind)
                assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (name, kind)
    grpo = runs["tp2"]["grpo"][-1]
    assert {"clip_fraction", "logprob_gap", "is_ess", "entropy"} <= set(grpo)


def test_save_load_resumes_exactly(runs: dict) -> None:
    for name in ("tp1", "tp2", "dp2"):
        for a, b in zip(runs[name]["grpo"], runs[name]["grpo_resumed"], strict=True):
            assert (a["loss"], a["grad_norm"], a["version"]) == (b["loss"], b["grad_norm"], b["version"]), name


def test_sft_loss_decreases(runs: dict) -> None:
    losses = [m["loss"] for m in runs["tp2"]["sft"]]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.9 * losses[0], losses


def test_export_loads_in_transformers_exactly(runs: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(runs["model"], local_files_only=True).state_dict()
    exported = {}
    for name in ("tp1", "tp2", "dp2"):
        directory = runs["base"] / name / "hf"
        loaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).state_dict()
        on_disk = load_file(directory / "model.safetensors")
        assert set(on_disk) == set(initial)  # the HF names transformers and SGLang load
        assert all(torch.equal(loaded[k], on_disk[k]) for k in on_disk)  # exact round trip
        assert not torch.equal(
            loaded["model.layers.0.mlp.gate_proj.weight"], initial["model.layers.0.mlp.gate_proj.weight"]
        )
        exported[name] = loaded
    for name in ("tp2", "dp2"):
        for k in initial:
            torch.testing.assert_close(exported[name][k], exported["tp1"][k], atol=1e-5, rtol=1e-4)
