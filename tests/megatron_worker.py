"""A torchrun program for the Megatron trainer tests: train a few steps, write what it saw as JSON.

Run: torchrun --nproc_per_node=N tests/megatron_worker.py MODEL_DIR OUT_DIR TP PP
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from patchgym.backends.trainer.megatron import MegatronTrainer  # noqa: E402
from patchgym.core.batch import TrainBatch  # noqa: E402
from patchgym.core.losses import GRPOLoss, SFTLoss  # noqa: E402
from tests.megatron_recipe import GRPO_STEPS, LR, MICRO_BATCH_TOKENS, SFT_STEPS, grpo_batch, sft_batch  # noqa: E402
from tests.tiny_models import random_samples  # noqa: E402


async def drive(trainer: MegatronTrainer, out: Path) -> None:
    sft, grpo = sft_batch(), grpo_batch()
    result = {"settings": trainer.settings(), "logprobs": await trainer.logprobs(grpo), "sft": [], "grpo": []}
    result["logprobs_t07"] = await trainer.logprobs(TrainBatch(grpo.samples, temperature=0.7))
    for _ in range(SFT_STEPS):
        result["sft"].append(await trainer.train_step(sft, SFTLoss()))
    await trainer.save(out / "ckpt")
    for _ in range(GRPO_STEPS):
        result["grpo"].append(await trainer.train_step(grpo, GRPOLoss()))
    await trainer.load(out / "ckpt")  # resume: the same steps again must give the same numbers
    result["grpo_resumed"] = [await trainer.train_step(grpo, GRPOLoss()) for _ in range(GRPO_STEPS)]
    await trainer.weights(export_to=out / "hf")
    before = (await trainer.weights()).state_dict
    no_signal = TrainBatch(random_samples(8, seed=23, advantages=False))
    result["no_signal"] = await trainer.train_step(no_signal, GRPOLoss())
    after = (await trainer.weights()).state_dict
    result["no_signal_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    await trainer.set_lr(1e-4)
    await trainer.reset_optimizer()
    before = (await trainer.weights()).state_dict
    result["after_reset"] = await trainer.train_step(sft, SFTLoss())
    after = (await trainer.weights()).state_dict
    result["after_reset_max_change"] = max((after[k] - before[k]).abs().max().item() for k in before)
    await trainer.aclose()
    (out / "result.json").write_text(json.dumps(result))


def main() -> None:
    model, out, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    trainer = MegatronTrainer(model, tp=tp, pp=pp, lr=LR, micro_batch_tokens=MICRO_BATCH_TOKENS)
    if trainer.rank == 0:
        asyncio.run(drive(trainer, out))
    else:
        trainer.follow()


if __name__ == "__main__":
    main()
