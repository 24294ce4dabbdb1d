"""A torchrun program for the Megatron checkpoint tests: train, checkpoint, go on; or resume and go on.

Run: torchrun --nproc_per_node=N tests/megatron_ckpt_worker.py MODEL_DIR OUT_DIR DTYPE EP [CHECKPOINT]

Without CHECKPOINT: BEFORE GRPO steps, a checkpoint in OUT_DIR/ckpt, then AFTER more steps. With
one: a new trainer loads it and takes the same AFTER steps. Either way OUT_DIR/result.json holds
the AFTER steps' metrics and OUT_DIR/hf the HF export of the final weights.
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from patchgym.backends.trainer.megatron import MegatronTrainer  # noqa: E402
from patchgym.core.losses import GRPOLoss  # noqa: E402
from tests.megatron_recipe import LR, MICRO_BATCH_TOKENS, grpo_batch  # noqa: E402

BEFORE, AFTER = 2, 2


async def drive(trainer: MegatronTrainer, out: Path, checkpoint: Path | None) -> None:
    batch = grpo_batch()
    if checkpoint is None:
        for _ in range(BEFORE):
            await trainer.train_step(batch, GRPOLoss())
        await trainer.save(out / "ckpt")
    else:
        await trainer.load(checkpoint)
    steps = [await trainer.train_step(batch, GRPOLoss()) for _ in range(AFTER)]
    await trainer.export(out / "hf")
    result = {"settings": trainer.settings(), "steps": steps}
    await trainer.aclose()
    (out / "result.json").write_text(json.dumps(result))


def main() -> None:
    model, out, dtype, ep = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    checkpoint = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    trainer = MegatronTrainer(model, lr=LR, micro_batch_tokens=MICRO_BATCH_TOKENS, dtype=dtype, ep=ep)
    if trainer.rank == 0:
        asyncio.run(drive(trainer, out, checkpoint))
    else:
        trainer.follow()


if __name__ == "__main__":
    main()
