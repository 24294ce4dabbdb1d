"""A torchrun program for the streamed weight sync: Megatron ranks send their weights to a receiving
engine process through `WeightSync` (staged groups, buckets), twice, with a GRPO step in between.

Run: torchrun --nproc_per_node=N tests/megatron_sync_worker.py MODEL_DIR OUT_DIR TP EP ETP BUCKET_BYTES PP

Writes OUT_DIR/v1.safetensors and v2.safetensors (what the engine received at each sync), OUT_DIR/hf
(the trainer's HF export after the second) and OUT_DIR/result.json (the two sync reports). The
collectives time out after `COLLECTIVE_TIMEOUT_S`: a rank left waiting in a gather fails the run.
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
from patchgym.core.batch import TrainBatch  # noqa: E402
from patchgym.core.losses import GRPOLoss  # noqa: E402
from patchgym.launch.sync import WeightSync  # noqa: E402
from patchgym.testing.weight_receiver import ReceiverEngine  # noqa: E402
from tests.tiny_models import random_samples  # noqa: E402

COLLECTIVE_TIMEOUT_S = 120.0


async def drive(trainer: MegatronTrainer, out: Path) -> None:
    engine = ReceiverEngine(weight_bucket_bytes=1 << 40, timeout_s=COLLECTIVE_TIMEOUT_S)  # the trainer's bucket rules
    sync = WeightSync(trainer, engine, mode="distributed", run_dir=out, timeout_s=COLLECTIVE_TIMEOUT_S)
    reports = []
    try:
        reports.append((await sync(1)).as_dict())
        await engine.save(out / "v1.safetensors")
        await trainer.train_step(TrainBatch(random_samples(8, seed=22)), GRPOLoss())
        reports.append((await sync(2)).as_dict())
        await engine.save(out / "v2.safetensors")
        reports.append({"joins": engine.joins})
    finally:
        await engine.aclose()
    await trainer.weights(export_to=out / "hf")
    await trainer.aclose()
    (out / "result.json").write_text(json.dumps({"settings": trainer.settings(), "reports": reports}))


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    tp, ep, etp, bucket_bytes, pp = (int(a) for a in sys.argv[3:8])
    trainer = MegatronTrainer(
        model, tp=tp, pp=pp, ep=ep, etp=etp, lr=3e-3, micro_batch_tokens=96, use_distributed_optimizer=False,
        timeout_s=COLLECTIVE_TIMEOUT_S, sync_bucket_bytes=bucket_bytes,
    )  # fmt: skip
    if trainer.rank == 0:
        asyncio.run(drive(trainer, out))
    else:
        trainer.follow()


if __name__ == "__main__":
    main()
