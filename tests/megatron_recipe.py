"""The training the Megatron tests run in every layout (tests/megatron_worker.py), and the same steps on the
embedded trainer in float32 and float64, which measure how large fp32 rounding error is for this model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from patchgym.core.batch import TrainBatch
from patchgym.core.losses import GRPOLoss, SFTLoss
from tests.tiny_models import random_samples

LR = 3e-3
MICRO_BATCH_TOKENS = 96
SFT_STEPS, GRPO_STEPS = 4, 2


def sft_batch() -> TrainBatch:
    return TrainBatch(random_samples(8, seed=21, advantages=False))


def grpo_batch() -> TrainBatch:
    return TrainBatch(random_samples(8, seed=22))


async def embedded_run(model: Path, dtype: str) -> dict[str, Any]:
    """Log-probs, then SFT_STEPS SFT and GRPO_STEPS GRPO steps (the steps whose weights the workers export)."""
    from patchgym.backends.trainer.embedded import EmbeddedTrainer

    trainer = EmbeddedTrainer(model, lr=LR, micro_batch_tokens=MICRO_BATCH_TOKENS, dtype=dtype)
    grpo = grpo_batch()
    result: dict[str, Any] = {"logprobs": await trainer.logprobs(grpo)}
    result["steps"] = [await trainer.train_step(sft_batch(), SFTLoss()) for _ in range(SFT_STEPS)]
    result["steps"] += [await trainer.train_step(grpo, GRPOLoss()) for _ in range(GRPO_STEPS)]
    result["weights"] = (await trainer.weights()).state_dict
    await trainer.aclose()
    return result
