"""The policy as a Hugging Face model directory, apart from the resumable checkpoints.

A checkpoint (`Trainer.save`) is what a resume needs and may be in a trainer's own format (the
Megatron trainer's is a distributed checkpoint); an export is what transformers and SGLang
load. The run writes one at the end of SFT, at the end of GRPO and every `export_every` GRPO
steps, under `RUN_DIR/exports/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


async def export_policy(trainer: Any, directory: Path) -> Path:
    """Write `trainer`'s current weights to `directory` in HF format: its `export` where it has one
    (without bringing the weights to this process), else `weights(export_to=...)`."""
    export = getattr(trainer, "export", None)
    if export is not None:
        return await export(directory)
    weights = await trainer.weights(export_to=directory)
    return weights.path
