"""The Megatron trainer's distributed checkpoints, run for real on CPU (torchrun, gloo): a bf16 resume
continues exactly where the uninterrupted run is, and a DP1 checkpoint resumes at DP2."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from patchgym.backends.trainer import megatron_checkpoint  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from tests.tiny_models import tiny_qwen3, tiny_qwen3_moe  # noqa: E402
from tests.torchrun_launch import torchrun_json  # noqa: E402

WORKER = Path(__file__).with_name("megatron_ckpt_worker.py")
TORCHRUN_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(6 * TORCHRUN_TIMEOUT_S + 300)
SAFETY = 2
"""DP2 resumed from a DP1 checkpoint may differ from DP1 by SAFETY times what the two layouts measurably
differ by (the same steps from the same initial weights: data-parallel gradient sums in another order),
at least bf16's relative rounding of the compared quantity."""
BF16_EPS = torch.finfo(torch.bfloat16).eps


def torchrun(model: Path, out: Path, nproc: int, *checkpoint: Path, ep: int = 1) -> dict:
    return torchrun_json(WORKER, out, nproc, model, out, "bfloat16", ep, *checkpoint, timeout_s=TORCHRUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("megatron_ckpt")
    model = tiny_qwen3(base / "model")
    runs = {"base": base, "model": model, "dp1": torchrun(model, base / "dp1", 1)}
    checkpoint = base / "dp1" / "ckpt"
    runs["resumed"] = torchrun(model, base / "resumed", 1, checkpoint)
    runs["dp2"] = torchrun(model, base / "dp2", 2)
    runs["dp2_from_dp1"] = torchrun(model, base / "dp2_from_dp1", 2, checkpoint)
    return runs


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Qwen3-MoE at EP2 (two ranks, the experts split): megatron chains a dense and an expert
    optimizer, each checkpointed with its own state."""
    base = tmp_path_factory.mktemp("megatron_ckpt_moe")
    model = tiny_qwen3_moe(base / "model")
    runs = {"base": base, "model": model, "ep2": torchrun(model, base / "ep2", 2, ep=2)}
    runs["resumed"] = torchrun(model, base / "resumed", 2, base / "ep2" / "ckpt", ep=2)
    return runs


def exported(runs: dict, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(runs["base"] / name / "hf" / "model.safetensors")


def test_bf16_resume_equals_the_uninterrupted_run(runs: dict) -> None:
    assert runs["resumed"]["settings"]["dtype"] == "bfloat16"
    for a, b in zip(runs["dp1"]["steps"], runs["resumed"]["steps"], strict=True):
        assert (a["loss"], a["grad_norm"], a["version"]) == (b["loss"], b["grad_norm"], b["version"])
    straight, resumed = exported(runs, "dp1"), exported(runs, "resumed")
    assert set(straight) == set(resumed) and all(torch.equal(straight[k], resumed[k]) for k in straight)


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The Euclidean distance between two sets of weights (every tensor, in float32)."""
    return sum((a[k].float() - b[k].float()).pow(2).sum().item() for k in a) ** 0.5


def test_moe_ep2_bf16_resume_equals_the_uninterrupted_run(moe: dict) -> None:
    assert moe["resumed"]["settings"]["ep"] == 2
    for a, b in zip(moe["ep2"]["steps"], moe["resumed"]["steps"], strict=True):
        assert (a["loss"], a["grad_norm"], a["version"]) == (b["loss"], b["grad_norm"], b["version"])
    straight, resumed = exported(moe, "ep2"), exported(moe, "resumed")
    assert set(straight) == set(resumed) and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_dp1_checkpoint_resumes_at_dp2(runs: dict) -> None:
    """Compared by distances: bf16 weights differ by whole ulps (a 1.0 norm weight by 2^-7), so an
    element-wise bound would be as large as the training update itself."""
    from safetensors.torch import load_file

    assert runs["dp2_from_dp1"]["settings"]["dp"] == 2
    initial = load_file(runs["model"] / "model.safetensors")
    dp1, dp2, resumed = (exported(runs, name) for name in ("dp1", "dp2", "dp2_from_dp1"))
    moved = distance(dp1, initial)
    tolerance = SAFETY * max(distance(dp2, dp1), BF16_EPS * moved)
    assert tolerance < 0.2 * moved  # a resume that lost the trained weights would stand out
    assert distance(resumed, dp1) <= tolerance
    steps = list(zip(runs["dp1"]["steps"], runs["dp2"]["steps"], runs["dp2_from_dp1"]["steps"], strict=True))
    loss_tol = SAFETY * max(max(abs(a["loss"] - b["loss"]) for a, b, _ in steps), BF16_EPS * abs(steps[0][0]["loss"]))
    for a, _, c in steps:
        assert c["loss"] == pytest.approx(a["loss"], rel=0, abs=loss_tol)
        assert c["version"] == a["version"]


def test_the_checkpoint_is_distributed_and_has_no_hf_export(runs: dict) -> None:
    for name, ranks in (("dp1", 1), ("dp2", 2)):
        checkpoint = runs["base"] / name / "ckpt"
        assert (checkpoint / "dist" / "metadata.json").is_file() and (checkpoint / "megatron.json").is_file()
        writers = {p.name.split("_")[2] for p in (checkpoint / "dist").glob("__*_*.distcp")}
        assert writers == {str(r) for r in range(ranks)}, writers  # every rank wrote its own files
        assert not list(checkpoint.glob("*.pt")) and not (checkpoint / "model").exists()


def test_loading_what_is_not_a_distributed_checkpoint_names_it(tmp_path: Path) -> None:
    (tmp_path / "megatron_state_rank0.pt").write_bytes(b"")  # the format before distributed checkpoints
    with pytest.raises(ConfigError, match="not a megatron distributed checkpoint"):
        megatron_checkpoint.load(object(), tmp_path)
