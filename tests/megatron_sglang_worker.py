"""A torchrun program: Megatron (TP=2) trains a few SFT steps, then rank 0 pushes the weights to a
running SGLang server by bucketed broadcast over a process group, and exports them for checking.

Run: torchrun --nproc_per_node=2 tests/megatron_sglang_worker.py MODEL_DIR SGLANG_URL OUT_DIR
"""

from __future__ import annotations

import asyncio
import socket
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from patchgym.backends.inference.sglang import DistributedWeights, SGLangEngine  # noqa: E402
from patchgym.backends.trainer.megatron import MegatronTrainer  # noqa: E402
from patchgym.core.batch import TrainBatch  # noqa: E402
from patchgym.core.losses import SFTLoss  # noqa: E402
from tests.tiny_models import random_samples  # noqa: E402

VERSION = 6


async def drive(trainer: MegatronTrainer, url: str, out: Path) -> None:
    batch = TrainBatch(random_samples(8, seed=7, advantages=False))  # not the weights other tests load
    for _ in range(3):
        await trainer.train_step(batch, SFTLoss())
    weights = (await trainer.weights(export_to=out / "hf")).state_dict
    await trainer.aclose()
    bucket_bytes = sum(t.numel() * t.element_size() for t in weights.values()) // 4
    engine = SGLangEngine(url, max_context=512, weight_bucket_bytes=bucket_bytes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        await engine.update_weights(DistributedWeights(weights, master_port=port, timeout_s=60), version=VERSION)
    finally:
        await engine.aclose()


def main() -> None:
    model, url, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    trainer = MegatronTrainer(model, tp=2, lr=5e-2, micro_batch_tokens=512)
    if trainer.rank == 0:
        asyncio.run(drive(trainer, url, out))
    else:
        trainer.follow()


if __name__ == "__main__":
    main()
