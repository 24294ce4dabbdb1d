"""A torchrun program for the MoE Megatron trainer tests: GRPO steps with gradients captured, then an export.

Run: torchrun --nproc_per_node=N tests/megatron_moe_worker.py MODEL_DIR OUT_DIR TP EP ETP

Every rank wraps the optimizer's `step` to hand rank 0 the reduced gradients (megatron's
`main_grad`, under full megatron names, TP shards joined) before the step. With one process the
worker first takes the same GRPO step with a different micro-batch packing and no optimizer step:
the two gradients differ only by float32 summation order, which measures the reduction error the
tests scale their tolerances by.
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from patchgym.backends.trainer import megatron_moe  # noqa: E402
from patchgym.backends.trainer.megatron import MegatronTrainer  # noqa: E402
from patchgym.backends.trainer.megatron_convert import unshard  # noqa: E402
from patchgym.core.batch import TrainBatch  # noqa: E402
from patchgym.core.losses import GRPOLoss  # noqa: E402
from tests.tiny_models import random_samples  # noqa: E402

STEPS = 3
MICRO_BATCH_TOKENS = 96
REPACKED_TOKENS = 48


class GradientTap:
    """Wraps `trainer.optimizer.step`: gathers every gradient to rank 0 first; can skip the step."""

    def __init__(self, trainer: MegatronTrainer) -> None:
        self.trainer = trainer
        self.captured: list[dict[str, torch.Tensor]] = []
        self.skip_next = False
        self._step = trainer.optimizer.step
        trainer.optimizer.step = self.step

    def step(self) -> Any:
        t = self.trainer
        mine = {}
        for name, param in t.gpt.named_parameters():  # (rank within the tensor's TP group, shard)
            rank = t.etp_rank if megatron_moe.is_expert(name) else t.tp_rank
            mine[t.names[name]] = (rank, param.main_grad.detach().float().clone())
        parts: list[Any] | None = [None] * t.world if t.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if parts is not None:
            shards: dict[str, dict[int, torch.Tensor]] = {}
            for part in parts:
                for name, (rank, grad) in part.items():
                    shards.setdefault(name, {})[rank] = grad
            self.captured.append({k: unshard(k, [v[r] for r in sorted(v)]) for k, v in shards.items()})
        if self.skip_next:
            self.skip_next = False
            return True, 0.0, None
        return self._step()


def flat(grads: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in sorted(grads.items())}


async def drive(trainer: MegatronTrainer, tap: GradientTap, out: Path) -> None:
    grpo = TrainBatch(random_samples(8, seed=22))
    result: dict[str, Any] = {"settings": trainer.settings(), "logprobs": await trainer.logprobs(grpo)}
    if trainer.world == 1:  # the same step packed differently, not applied: float32 summation noise
        trainer.micro_batch_tokens = REPACKED_TOKENS
        tap.skip_next = True
        result["repacked"] = await trainer.train_step(grpo, GRPOLoss())
        result["repacked_grads"] = flat(tap.captured.pop())
        trainer.micro_batch_tokens = MICRO_BATCH_TOKENS
    result["grpo"] = [await trainer.train_step(grpo, GRPOLoss()) for _ in range(STEPS)]
    result["grads"] = flat(tap.captured[0])
    result["logprobs_after"] = await trainer.logprobs(grpo)
    await trainer.weights(export_to=out / "hf")
    await trainer.aclose()
    (out / "result.json").write_text(json.dumps(result))


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    tp, ep, etp = (int(a) for a in sys.argv[3:6])
    trainer = MegatronTrainer(
        model, tp=tp, ep=ep, etp=etp, lr=3e-3, micro_batch_tokens=MICRO_BATCH_TOKENS, use_distributed_optimizer=False
    )
    tap = GradientTap(trainer)
    if trainer.rank == 0:
        asyncio.run(drive(trainer, tap, out))
    else:
        trainer.follow()


if __name__ == "__main__":
    main()
