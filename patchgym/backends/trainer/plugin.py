"""Registers the built-in trainer backends (torch and megatron-core are imported on use)."""

from __future__ import annotations

from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.plugins import Register, hookimpl


def _embedded(**settings: Any) -> Any:
    try:
        from patchgym.backends.trainer.embedded import EmbeddedTrainer
    except ImportError as exc:
        raise ConfigError(
            f"the embedded trainer needs torch and transformers: pip install 'patchgym[train]' ({exc})"
        ) from exc
    return EmbeddedTrainer(**settings)


def _megatron(**settings: Any) -> Any:
    try:
        from patchgym.backends.trainer.megatron import MegatronTrainer
    except ImportError as exc:
        raise ConfigError(
            f"the megatron trainer needs megatron-core: pip install 'patchgym[megatron]' ({exc})"
        ) from exc
    return MegatronTrainer(**settings)


@hookimpl
def register_trainer_backends(register: Register) -> None:
    register("embedded", _embedded, "transformers model trained in-process with torch (packing, AdamW, checkpoints)")
    register(
        "megatron", _megatron, "megatron-core GPTModel, tensor and data parallel under torchrun (CPU shim without GPU)"
    )
