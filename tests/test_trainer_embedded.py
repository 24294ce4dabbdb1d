"""The embedded (transformers + torch) trainer on a tiny random Qwen3."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from patchgym.backends.trainer.embedded import EmbeddedTrainer  # noqa: E402
from patchgym.core.batch import Sample, TrainBatch  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from patchgym.core.losses import GRPOLoss, SFTLoss  # noqa: E402
from patchgym.core.plugins import registry  # noqa: E402
from patchgym.core.trainer import Trainer  # noqa: E402
from tests.tiny_models import random_samples, tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def params(trainer: EmbeddedTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


@pytest.mark.parametrize("attention", ["varlen", "sdpa", "eager"])
async def test_packed_padded_and_single_logprobs_agree(model_dir: Path, attention: str) -> None:
    samples = random_samples(9, seed=1)
    packed = EmbeddedTrainer(model_dir, micro_batch_tokens=128, attention=attention)
    padded = EmbeddedTrainer(model_dir, micro_batch_tokens=128, attention=attention, packing=False)
    assert isinstance(packed, Trainer) and packed.settings()["attention"] == attention
    a = await packed.logprobs(TrainBatch(samples))
    b = await padded.logprobs(TrainBatch(samples))
    singles = [(await packed.logprobs(TrainBatch([s])))[0] for s in samples]
    for x, y, z, s in zip(a, b, singles, samples, strict=True):
        assert len(x) == len(s)
        assert x == pytest.approx(z, abs=1e-5)  # packing does not leak attention across samples
        assert y == pytest.approx(z, abs=1e-5)


async def test_gradient_accumulation_matches_one_micro_batch(model_dir: Path) -> None:
    samples = random_samples(8, seed=2)
    results = []
    for budget in (512, 48):  # one micro-batch vs many
        trainer = EmbeddedTrainer(model_dir, lr=1e-3, micro_batch_tokens=budget, grad_clip=0)
        metrics = await trainer.train_step(TrainBatch(samples), GRPOLoss())
        results.append((metrics, {k: v.grad for k, v in trainer.model.named_parameters()}))
    (m1, p1), (m2, p2) = results
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    for name in p1:  # the accumulated gradients (Adam's first step would amplify float noise)
        torch.testing.assert_close(p1[name], p2[name], atol=1e-6, rtol=1e-4)


async def test_gradient_checkpointing_gives_the_same_step(model_dir: Path) -> None:
    samples = random_samples(4, seed=3)
    out = []
    for checkpointing in (False, True):
        trainer = EmbeddedTrainer(model_dir, lr=1e-3, gradient_checkpointing=checkpointing)
        out.append(await trainer.train_step(TrainBatch(samples), SFTLoss()))
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-5)


async def test_sft_loss_decreases_and_metrics(model_dir: Path) -> None:
    trainer = EmbeddedTrainer(model_dir, lr=3e-3, micro_batch_tokens=256)
    corpus = TrainBatch(random_samples(6, seed=4, advantages=False))
    losses = [(await trainer.train_step(corpus, SFTLoss()))["loss"] for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0]
    assert trainer.version == 8
    metrics = await trainer.train_step(TrainBatch(random_samples(8, seed=5)), GRPOLoss())
    for key in ("clip_fraction", "logprob_gap", "is_ess", "entropy", "grad_norm", "lr"):
        assert key in metrics
    assert 0 < metrics["is_ess"] <= 1 and metrics["logprob_gap"] > 0 and metrics["entropy"] > 0


async def test_grpo_learns_from_advantages(model_dir: Path) -> None:
    # two responses from the same prompt: the positive one must gain probability, the negative lose it
    prompt = [5, 6, 7, 8]
    good = Sample(prompt + [10, 11, 12], [0] * 4 + [1] * 3, advantage=1.0)
    bad = Sample(prompt + [20, 21, 22], [0] * 4 + [1] * 3, advantage=-1.0)
    trainer = EmbeddedTrainer(model_dir, lr=1e-2)
    before = await trainer.logprobs(TrainBatch([good, bad]))
    for _ in range(3):
        await trainer.train_step(TrainBatch([good, bad]), GRPOLoss(tis_cap=None))
    after = await trainer.logprobs(TrainBatch([good, bad]))
    assert sum(after[0][4:]) > sum(before[0][4:])
    assert sum(after[1][4:]) < sum(before[1][4:])


async def test_a_step_without_advantages_leaves_weights_and_optimiser_alone(model_dir: Path) -> None:
    trainer = EmbeddedTrainer(model_dir, lr=1e-2)
    await trainer.train_step(TrainBatch(random_samples(4, seed=7)), GRPOLoss())  # Adam now has momentum
    before, moments = params(trainer), len(trainer.optimizer.state)
    steps = trainer.step_count
    metrics = await trainer.train_step(TrainBatch(random_samples(4, seed=8, advantages=False)), GRPOLoss())
    assert metrics["optimizer_skipped"] == 1.0 and metrics["grad_norm"] == 0.0
    assert trainer.version == 2 and trainer.step_count == steps and len(trainer.optimizer.state) == moments
    for name, value in params(trainer).items():
        assert torch.equal(value, before[name]), name
    stepped = await trainer.train_step(TrainBatch(random_samples(4, seed=8)), GRPOLoss())
    assert stepped["optimizer_skipped"] == 0.0


async def test_set_lr_changes_the_next_steps_and_keeps_the_warmup(model_dir: Path) -> None:
    trainer = EmbeddedTrainer(model_dir, lr=1e-2, warmup_steps=4)
    batch = TrainBatch(random_samples(4, seed=9, advantages=False))
    assert (await trainer.train_step(batch, SFTLoss()))["lr"] == pytest.approx(1e-2 / 4)
    await trainer.set_lr(1e-4)
    assert (await trainer.train_step(batch, SFTLoss()))["lr"] == pytest.approx(1e-4 * 2 / 4)
    for _ in range(3):
        metrics = await trainer.train_step(batch, SFTLoss())
    assert metrics["lr"] == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="lr > 0"):
        await trainer.set_lr(0.0)


async def test_reset_optimizer_gives_a_fresh_adam_step_and_warmup(model_dir: Path) -> None:
    trainer = EmbeddedTrainer(model_dir, lr=1e-2, warmup_steps=2, grad_clip=0)
    batch = TrainBatch(random_samples(4, seed=10, advantages=False))
    for _ in range(3):
        await trainer.train_step(batch, SFTLoss())
    await trainer.set_lr(1e-4)
    await trainer.reset_optimizer()
    before = params(trainer)
    metrics = await trainer.train_step(batch, SFTLoss())
    assert metrics["lr"] == pytest.approx(1e-4 / 2)  # the warm-up starts again
    # Adam's first step from empty moments moves every parameter with a gradient by lr (sign-like)
    moved = max((value - before[name]).abs().max().item() for name, value in params(trainer).items())
    assert moved == pytest.approx(1e-4 / 2, rel=1e-3)


async def test_logprobs_at_the_sampling_temperature_match_the_engine(model_dir: Path) -> None:
    from patchgym.backends.inference.embedded import EmbeddedEngine
    from patchgym.core.inference import SamplingParams

    engine = EmbeddedEngine(model_dir, max_context=128, stop_at_eos=False)
    prompt = [1, 40, 7, 30, 12]
    try:
        generation = await engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.6, seed=3))
    finally:
        await engine.aclose()
    tokens = prompt + list(generation.token_ids)
    sample = Sample(tokens, [0] * len(prompt) + [1] * len(generation.token_ids))
    trainer = EmbeddedTrainer(model_dir)
    tempered = (await trainer.logprobs(TrainBatch([sample], temperature=0.6)))[0][len(prompt) :]
    plain = (await trainer.logprobs(TrainBatch([sample])))[0][len(prompt) :]
    assert tempered == pytest.approx(list(generation.logprobs), abs=1e-4)  # like with like: IS weights are right
    assert max(abs(a - b) for a, b in zip(plain, generation.logprobs, strict=True)) > 1e-2
    with pytest.raises(ConfigError, match="temperature > 0"):
        TrainBatch([sample], temperature=0.0)


async def test_kl_needs_and_uses_a_reference(model_dir: Path) -> None:
    batch = TrainBatch(random_samples(4, seed=6))
    with pytest.raises(ConfigError, match="reference"):
        await EmbeddedTrainer(model_dir).train_step(batch, GRPOLoss(kl_coef=0.1))
    trainer = EmbeddedTrainer(model_dir, lr=1e-2, reference_model=model_dir)
    first = await trainer.train_step(batch, GRPOLoss(kl_coef=0.1))
    second = await trainer.train_step(batch, GRPOLoss(kl_coef=0.1))
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # same weights as the reference
    assert second["kl"] > 0


async def test_save_load_resumes_bit_exactly(model_dir: Path, tmp_path: Path) -> None:
    batches = [TrainBatch(random_samples(6, seed=10 + i)) for i in range(4)]
    a = EmbeddedTrainer(model_dir, lr=1e-3, warmup_steps=3, micro_batch_tokens=64)
    for batch in batches[:2]:
        await a.train_step(batch, GRPOLoss())
    await a.save(tmp_path / "ckpt")
    noise_after_save = torch.rand(3)
    for batch in batches[2:]:
        await a.train_step(batch, GRPOLoss())

    b = EmbeddedTrainer(model_dir, lr=1e-3, warmup_steps=3, micro_batch_tokens=64, seed=123)
    await b.load(tmp_path / "ckpt")
    assert b.version == 2 and b.step_count == 2
    assert torch.equal(torch.rand(3), noise_after_save)  # RNG state restored
    for batch in batches[2:]:
        await b.train_step(batch, GRPOLoss())
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    with pytest.raises(ConfigError, match="not a checkpoint"):
        await b.load(tmp_path)


async def test_weights_hand_off_and_hf_export(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = EmbeddedTrainer(model_dir, lr=1e-2)
    await trainer.train_step(TrainBatch(random_samples(4, seed=7)), SFTLoss())
    weights = await trainer.weights(export_to=tmp_path / "hf")
    assert weights.version == 1 and weights.path == tmp_path / "hf"
    current = trainer.model.state_dict()
    assert weights.state_dict is not None
    assert all(torch.equal(weights.state_dict[k], current[k]) for k in current)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).state_dict()
    assert all(torch.equal(loaded[k], current[k]) for k in current)
    await trainer.train_step(TrainBatch(random_samples(4, seed=8)), SFTLoss())
    assert not all(torch.equal(weights.state_dict[k], current[k]) for k in current)  # a copy, not a view


async def test_train_step_does_not_block_the_event_loop(model_dir: Path) -> None:
    """The loop keeps turning while a step trains: a step run on the loop itself would let it turn
    only once the step is over. Counted over steps until seen, whatever the machine's speed."""
    trainer = EmbeddedTrainer(model_dir, micro_batch_tokens=512)
    batch = TrainBatch(random_samples(8, seed=9, low=100, high=200))
    loop = asyncio.get_running_loop()
    give_up, turns_while_training = loop.time() + 120, 0

    async def watch(step: asyncio.Task[Any]) -> None:
        nonlocal turns_while_training
        while not step.done():
            await asyncio.sleep(0.001)
            turns_while_training += not step.done()

    while turns_while_training < 10:
        assert loop.time() < give_up, f"the loop turned {turns_while_training} times while training"
        step = asyncio.create_task(trainer.train_step(batch, SFTLoss()))
        await asyncio.gather(step, watch(step))


def test_registered_as_trainer_backend(model_dir: Path) -> None:
    trainer = registry().create("trainer", "embedded", model=str(model_dir), micro_batch_tokens=64)
    assert trainer.settings()["micro_batch_tokens"] == 64
    with pytest.raises(ConfigError, match="config.json"):
        EmbeddedTrainer(model_dir.parent / "nowhere")
    with pytest.raises(ConfigError, match="token budget"):
        asyncio.run(trainer.logprobs(TrainBatch(random_samples(1, low=80, high=80))))
