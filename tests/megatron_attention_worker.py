"""A one-process program for tests/test_megatron_attention.py: the same steps under each attention and recompute.

Run: python tests/megatron_attention_worker.py MODEL_DIR OUT_FILE CASE... (CASE: attention/recompute, e.g.
varlen/full). For each case it builds a `MegatronTrainer` (one rank), takes the log-probs of a batch, then
an SFT and a GRPO step, capturing megatron's reduced gradients (`main_grad`) before each optimizer step,
and writes everything with torch.save. It also records how often the varlen core attention ran.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from patchgym.backends.trainer import megatron_attention  # noqa: E402
from patchgym.backends.trainer.megatron import MegatronTrainer  # noqa: E402
from patchgym.core.losses import GRPOLoss, SFTLoss  # noqa: E402
from tests.megatron_recipe import LR, MICRO_BATCH_TOKENS, grpo_batch, sft_batch  # noqa: E402


def capture_gradients(trainer: MegatronTrainer, into: list[dict[str, torch.Tensor]]) -> None:
    """Wrap the optimizer's step: store every parameter's reduced gradient (full names) first."""
    step = trainer.optimizer.step

    def tapped() -> Any:
        into.append({trainer.names[n]: p.main_grad.detach().clone() for n, p in trainer.gpt.named_parameters()})
        return step()

    trainer.optimizer.step = tapped


async def run_case(model: Path, attention: str, recompute: str) -> dict[str, Any]:
    trainer = MegatronTrainer(
        model, lr=LR, micro_batch_tokens=MICRO_BATCH_TOKENS, attention=attention, recompute=recompute
    )
    grads: list[dict[str, torch.Tensor]] = []
    capture_gradients(trainer, grads)
    calls = [0]
    forward = megatron_attention.VarlenCoreAttention.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return forward(self, *args, **kwargs)

    megatron_attention.VarlenCoreAttention.forward = counted  # type: ignore[method-assign]
    try:
        result = {
            "settings": trainer.settings(),
            "logprobs": await trainer.logprobs(grpo_batch()),
            "steps": [
                await trainer.train_step(sft_batch(), SFTLoss()),
                await trainer.train_step(grpo_batch(), GRPOLoss()),
            ],
        }
    finally:
        megatron_attention.VarlenCoreAttention.forward = forward  # type: ignore[method-assign]
    await trainer.aclose()
    trainer.ps.destroy_model_parallel()
    return {**result, "grads": grads, "varlen_calls": calls[0]}


def main() -> None:
    model, out, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    results = {}
    for case in cases:
        attention, recompute = case.split("/")
        results[case] = asyncio.run(run_case(model, attention, recompute))
    torch.save(results, out)


if __name__ == "__main__":
    main()
