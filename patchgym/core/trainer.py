"""The trainer contract: log-probs, one optimisation step, weights out, checkpoints.

Backends (an embedded torch trainer, Megatron-core) implement `Trainer`. The batch and loss
types are defined with the training issue; here they are opaque.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Trainer(Protocol):
    """Holds the policy being trained and its optimiser."""

    version: int
    """Policy version: incremented by every `train_step`."""

    async def logprobs(self, batch: Any) -> Any:
        """Per-token log-probs of `batch` under the current weights."""
        ...

    async def train_step(self, batch: Any, loss: Any) -> Mapping[str, float]:
        """One optimiser step (SFT: masked NLL; GRPO: clipped, importance-corrected); returns metrics.

        A batch whose loss has no gradient (`core.losses.has_gradient`) leaves the weights and
        optimiser state untouched; the version still advances and `optimizer_skipped` is 1.
        """
        ...

    async def set_lr(self, lr: float) -> None:
        """Change the peak learning rate for the following steps (warm-up continues where it is)."""
        ...

    async def reset_optimizer(self) -> None:
        """Forget the optimiser's moments and restart the warm-up (e.g. between SFT and RL)."""
        ...

    async def weights(self) -> Any:
        """The current weights in a form an inference engine's `update_weights` accepts."""
        ...

    async def save(self, directory: Path) -> None:
        """Checkpoint model, optimiser (with its step count and learning rate) and RNG state."""
        ...

    async def load(self, directory: Path) -> None:
        """Restore a checkpoint written by `save`."""
        ...
