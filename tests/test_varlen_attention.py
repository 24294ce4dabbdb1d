"""Variable-length attention for packed micro-batches in the embedded trainer (tiny random Qwen3).

That packed log-probs equal each sample's alone and the padded layout's, for every `attention`
setting, is `test_packed_padded_and_single_logprobs_agree` in test_trainer_embedded.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from patchgym.backends.trainer.embedded import EmbeddedTrainer  # noqa: E402
from patchgym.backends.trainer.varlen_attention import VARLEN, segments  # noqa: E402
from patchgym.core.batch import Sample, TrainBatch  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from patchgym.core.losses import GRPOLoss, SFTLoss  # noqa: E402
from tests.tiny_models import random_samples, tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def test_segments_start_where_positions_restart() -> None:
    assert segments(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])) == [(0, 3), (3, 5), (5, 9)]
    assert segments(torch.tensor([0, 1, 2, 3])) == [(0, 4)]
    assert segments(torch.tensor([0, 0, 0])) == [(0, 1), (1, 2), (2, 3)]


async def test_a_sample_does_not_see_its_neighbour(model_dir: Path) -> None:
    a, b = random_samples(2, seed=2, low=30, high=30)
    changed = Sample([(t % 90) + 1 for t in a.token_ids], a.loss_mask)
    trainer = EmbeddedTrainer(model_dir, micro_batch_tokens=128)
    assert len(TrainBatch([a, b], 128).micro_batches()) == 1  # one row: a then b
    before = await trainer.logprobs(TrainBatch([a, b]))
    after = await trainer.logprobs(TrainBatch([changed, b]))
    assert after[0] != pytest.approx(before[0], abs=1e-3)
    assert after[1] == pytest.approx(before[1], abs=1e-6)


async def test_attention_never_spans_the_packed_row(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = random_samples(6, seed=3)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    key_lengths: list[int] = []

    def recording(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        key_lengths.append(key.shape[-2])
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    for attention in ("varlen", "sdpa"):
        key_lengths.clear()
        await EmbeddedTrainer(model_dir, micro_batch_tokens=512, attention=attention).logprobs(TrainBatch(samples))
        longest = max(key_lengths)
        assert longest == (max(map(len, samples)) if attention == "varlen" else sum(map(len, samples)))


@pytest.mark.parametrize("checkpointing", [False, True])
async def test_packed_varlen_gradients_equal_padded(model_dir: Path, checkpointing: bool) -> None:
    samples = random_samples(8, seed=4, advantages=False)
    grads, losses = [], []
    for packing in (True, False):
        trainer = EmbeddedTrainer(
            model_dir, micro_batch_tokens=128, packing=packing, gradient_checkpointing=checkpointing, grad_clip=0
        )
        losses.append((await trainer.train_step(TrainBatch(samples), SFTLoss()))["loss"])
        grads.append({k: v.grad for k, v in trainer.model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4)


async def test_reference_model_uses_varlen_and_bad_settings_fail(model_dir: Path) -> None:
    trainer = EmbeddedTrainer(model_dir, lr=1e-2, reference_model=model_dir)
    assert trainer.reference is not None
    assert trainer.model.config._attn_implementation == trainer.reference.config._attn_implementation == VARLEN
    batch = TrainBatch(random_samples(4, seed=5))
    assert (await trainer.train_step(batch, GRPOLoss(kl_coef=0.1)))["kl"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ConfigError, match="attention"):
        EmbeddedTrainer(model_dir, attention="flash")
