"""The Megatron trainer's attention and memory settings on CPU: varlen (THD, cu_seqlens) against the dense
block mask, recompute against none, the settings that cannot run here, and tokens-per-rank batching.

One program (tests/megatron_attention_worker.py, one rank) runs the same log-probs, SFT step and GRPO step
under each setting; tolerances come from float32's rounding error on this model, measured as the embedded
trainer's float32 minus float64 (as tests/test_trainer_megatron.py does)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from patchgym.backends.trainer import megatron_attention, megatron_memory  # noqa: E402
from patchgym.backends.trainer.megatron import MegatronTrainer  # noqa: E402
from patchgym.backends.trainer.megatron_batching import rank_share, split_by_tokens  # noqa: E402
from patchgym.core.batch import Sample, TrainBatch  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from patchgym.core.losses import SFTLoss  # noqa: E402
from tests.megatron_recipe import LR, MICRO_BATCH_TOKENS, grpo_batch, sft_batch  # noqa: E402
from tests.processes import run_group  # noqa: E402
from tests.tiny_models import random_samples, tiny_qwen3  # noqa: E402

WORKER = Path(__file__).with_name("megatron_attention_worker.py")
CASES = ("dense/none", "varlen/none", "varlen/selective", "varlen/full", "dense/full")
SAFETY = 2
"""Two float32 computations of the same thing each carry float32's rounding error E: they differ by up to 2E;
tolerances are SAFETY * 2E (measured: dense vs varlen differed by 0.5 of 2E or less)."""
WORKER_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(WORKER_TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("attention") / "runs.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_group([sys.executable, str(WORKER), str(model), str(out), *CASES], WORKER_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def embedded_steps(model: Path, dtype: str) -> tuple[list[list[float]], list[dict[str, torch.Tensor]]]:
    """The embedded trainer's log-probs and its gradients for the worker's SFT and GRPO steps."""
    from patchgym.backends.trainer.embedded import EmbeddedTrainer
    from patchgym.core.losses import GRPOLoss

    trainer = EmbeddedTrainer(model, lr=LR, micro_batch_tokens=MICRO_BATCH_TOKENS, dtype=dtype, grad_clip=0)
    logprobs = asyncio.run(trainer.logprobs(grpo_batch()))
    grads = []
    for batch, loss in ((sft_batch(), SFTLoss()), (grpo_batch(), GRPOLoss())):
        asyncio.run(trainer.train_step(batch, loss))
        grads.append({k: p.grad.detach().double().clone() for k, p in trainer.model.named_parameters()})
    return logprobs, grads


@pytest.fixture(scope="module")
def tolerances(model: Path) -> dict[str, float]:
    """SAFETY * 2 * float32's measured error: log-probs (absolute) and gradients (relative to the largest)."""
    (lp32, g32), (lp64, g64) = embedded_steps(model, "float32"), embedded_steps(model, "float64")
    eps = torch.finfo(torch.float32).eps
    logprob = max(abs(a - b) for ra, rb in zip(lp32, lp64, strict=True) for a, b in zip(ra, rb, strict=True))
    grad = max(
        (a[k] - b[k]).abs().max().item() / max(v.abs().max().item() for v in b.values())
        for a, b in zip(g32, g64, strict=True)
        for k in b
    )
    return {"logprob": SAFETY * 2 * max(logprob, eps), "grad_rel": SAFETY * 2 * max(grad, eps)}


def assert_same(reference: dict, other: dict, tolerances: dict[str, float], name: str) -> None:
    for a, b in zip(reference["logprobs"], other["logprobs"], strict=True):
        assert b == pytest.approx(a, abs=tolerances["logprob"]), name
    for ga, gb in zip(reference["grads"], other["grads"], strict=True):
        scale = max(g.abs().max().item() for g in ga.values())
        assert set(ga) == set(gb)
        for key in ga:
            torch.testing.assert_close(gb[key], ga[key], atol=tolerances["grad_rel"] * scale, rtol=0, msg=name)


def test_tolerances_are_rounding_sized(tolerances: dict[str, float]) -> None:
    assert 0 < tolerances["logprob"] < 1e-4 and 0 < tolerances["grad_rel"] < 1e-4


def test_varlen_gives_the_dense_paths_logprobs_and_gradients(runs: dict, tolerances: dict[str, float]) -> None:
    dense, varlen = runs["dense/none"], runs["varlen/none"]
    assert (dense["settings"]["attention"], varlen["settings"]["attention"]) == ("dense", "varlen")
    assert dense["varlen_calls"] == 0 < varlen["varlen_calls"]  # the THD core attention ran, and only there
    assert_same(dense, varlen, tolerances, "varlen")
    for a, b in zip(dense["steps"], varlen["steps"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=tolerances["logprob"])
        assert b["dp_tokens_max_over_mean"] == 1.0  # one rank


def test_recompute_changes_memory_not_results(runs: dict, tolerances: dict[str, float]) -> None:
    """Selective and full recompute run the attention again in the backward, and give the same gradients."""
    none = runs["varlen/none"]
    for name in ("varlen/selective", "varlen/full"):
        assert runs[name]["settings"]["recompute"] == name.split("/")[1]
        assert runs[name]["varlen_calls"] > none["varlen_calls"], name
        assert_same(none, runs[name], tolerances, name)
    assert_same(runs["dense/none"], runs["dense/full"], tolerances, "dense/full")


def test_varlen_core_attention_is_causal_attention_inside_each_sample() -> None:
    """Against a dense softmax with a block-diagonal causal mask, on random Q/K/V with grouped KV heads."""
    torch.manual_seed(0)
    config = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=8)
    attention = megatron_attention.VarlenCoreAttention(config, 1, None, "self")
    index = torch.tensor([[0] * 5 + [1] * 7 + [2] * 3 + [-1] * 2])
    t = index.shape[1]
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    params = megatron_attention.packed_seq_params(index)
    assert params.cu_seqlens_q.tolist() == [0, 5, 12, 15, 17] and params.max_seqlen_q == 7
    out = attention(q, k, v, None, packed_seq_params=params)
    forbidden = megatron_attention.block_causal_mask(index)[0, 0]
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / 8**0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(forbidden, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out, expected.reshape(t, -1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="packed"):
        attention(q, k, v, None)


def test_settings_that_cannot_run_here_are_refused(model: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("with a GPU, CPU optimizer offload can run")
    with pytest.raises(ConfigError, match="optimizer_cpu_offload: true needs a GPU"):
        MegatronTrainer(model, optimizer_cpu_offload=True)
    with pytest.raises(ConfigError, match="needs use_distributed_optimizer: true"):
        megatron_memory.offload_config(True, distributed_optimizer=False, gpu=True)
    assert megatron_memory.offload_config(True, distributed_optimizer=True, gpu=True)["optimizer_offload_fraction"] == 1
    with pytest.raises(ConfigError, match="recompute: 'uniform' is not one of none, selective, full"):
        MegatronTrainer(model, recompute="uniform")
    with pytest.raises(ConfigError, match="attention: 'flash' is not one of varlen, dense"):
        MegatronTrainer(model, attention="flash")


def test_dense_attention_refuses_a_token_cap_it_cannot_hold(model: Path) -> None:
    """2 layers x 4 heads of fp32 [s, s] scores and one layer's backward at 2^21 tokens: about 356 TB."""
    expected = (
        r"attention: dense at micro_batch_tokens=2097152 needs about 35\d{4}\.\d GB.*attention: varlen.*"
        r"lower micro_batch_tokens \(and agent.max_tokens_per_trajectory"
    )
    with pytest.raises(ConfigError, match=expected):
        MegatronTrainer(model, attention="dense", micro_batch_tokens=2**21)
    megatron_memory.check_dense_fits(
        attention="varlen", tokens=2**21, heads=4, layers=2, act_bytes=4, device_bytes=1e9, device="x"
    )


def test_samples_are_split_between_ranks_by_tokens() -> None:
    split = split_by_tokens([90, 90, 90, 10, 10, 10, 50, 50], 2)
    assert sorted(split.tokens) == [200, 200] and split.max_over_mean == 1.0
    assert sorted(i for share in split.shares for i in share) == list(range(8))
    assert split_by_tokens([100, 10], 2).max_over_mean == pytest.approx(100 / 55)
    assert split_by_tokens([5], 3).shares == ((0,), (), ())


def test_a_ranks_micro_batches_keep_batch_indices_and_equal_counts() -> None:
    samples = random_samples(7, seed=5, low=20, high=60)
    batch = TrainBatch(samples)
    shares = [rank_share(batch, 96, 2, r, equal_counts=True)[0] for r in range(2)]
    assert len(shares[0]) == len(shares[1])
    seen = {}
    for mbs in shares:
        for mb in mbs:
            for index, (row, start, length) in mb.spans.items():
                assert mb.input_ids[row][start : start + length] == samples[index].token_ids
                assert set(mb.sample_index[row][start : start + length]) == {index}
                seen[index] = length
    assert seen == {i: len(s) for i, s in enumerate(samples)}
    too_long = TrainBatch([Sample([1] * 100, [0] * 100)])
    with pytest.raises(ConfigError, match="micro_batch_tokens=96.*agent.max_tokens_per_trajectory"):
        rank_share(too_long, 96, 1, 0)
