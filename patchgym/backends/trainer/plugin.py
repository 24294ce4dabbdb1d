"""Registers the built-in trainer backends (torch and megatron-core are imported on use)."""

from __future__ import annotations

from patchgym.core.plugins import LazyFactory, Register, hookimpl


@hookimpl
def register_trainer_backends(register: Register) -> None:
    register(
        "embedded",
        LazyFactory("patchgym.backends.trainer.embedded:EmbeddedTrainer", "pip install 'patchgym[train]'"),
        "transformers model trained in-process with torch (packing, AdamW, checkpoints)",
    )
    register(
        "megatron",
        LazyFactory("patchgym.launch.ranks:megatron_backend", "pip install 'patchgym[megatron]'"),
        "megatron-core GPTModel (dense or MoE), tp/pp/dp/ep parallel; starts its ranks or joins torchrun",
    )
