"""Pieces shared by the trainer backends: settings, weight hand-off, step metrics, RNG state."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from patchgym.core.batch import TrainBatch
from patchgym.core.errors import ConfigError
from patchgym.core.losses import GRPOLoss, Loss, Normaliser, add_sums, check_batch, micro_batch_loss, summarize


@dataclass(frozen=True)
class OptimSettings:
    """AdamW with linear warm-up to a constant learning rate, and gradient-norm clipping."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping; the norm is reported either way)."""
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.grad_clip < 0 or self.warmup_steps < 0:
            raise ConfigError(
                f"need lr > 0, grad_clip >= 0, warmup_steps >= 0 (got {self.lr}, {self.grad_clip}, {self.warmup_steps})"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimiser step `step` (counted from 0)."""
        return self.lr * (min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainerWeights:
    """Weights handed to an inference engine: an in-process state dict and/or an HF-format directory."""

    version: int
    state_dict: dict[str, torch.Tensor] | None = None
    path: Path | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def step_metrics(batch: TrainBatch, started: float, sums: Mapping[str, float], **values: float) -> dict[str, float]:
    """A train step's metrics: `values` (loss, grad norm, lr, ...), its time and speed, and the loss sums."""
    elapsed = time.perf_counter() - started
    return {**values, "step_s": elapsed, "tokens_per_s": batch.total_tokens / elapsed, **summarize(sums)}


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (torch CPU, Python, NumPy)."""
    return {"torch": torch.random.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


Forward = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
"""Micro-batch tensors -> (per-token log-probs with grad, per-token entropy), both [rows, T]."""


def accumulate_gradients(
    batch: TrainBatch, loss: Loss, forward: Forward, *, reference: Forward | None = None, device: Any = "cpu"
) -> tuple[float, dict[str, float]]:
    """Forward and backward over every micro-batch; returns the step's loss and metric sums.

    Each micro-batch's loss is scaled by the step-wide normaliser, so the accumulated gradient
    is the gradient of the whole batch's loss whatever the micro-batch split.
    """
    check_batch(loss, batch)
    norm = Normaliser.of(batch)
    wants_reference = isinstance(loss, GRPOLoss) and loss.kl_coef > 0
    if wants_reference and reference is None:
        raise ConfigError("GRPOLoss.kl_coef > 0 needs a reference model: give the trainer reference_model=...")
    total, sums = 0.0, {}
    for mb in batch.micro_batches():
        tensors = mb.tensors(device)
        ref = None
        if wants_reference and reference is not None:
            with torch.no_grad():
                ref = reference(tensors)[0]
        logp, entropy = forward(tensors)
        value, part = micro_batch_loss(loss, logp, tensors, norm, ref_logprobs=ref, entropy=entropy)
        value.backward()
        total += value.item()
        add_sums(sums, part)
    return total, sums


def per_sample_logprobs(batch: TrainBatch, forward: Forward, device: Any = "cpu") -> list[list[float]]:
    """Per-token log-probs of every sample (aligned with its tokens; entry 0 is 0.0), without grad."""
    out: list[list[float]] = [[] for _ in batch.samples]
    with torch.no_grad():
        for mb in batch.micro_batches():
            logp = forward(mb.tensors(device))[0]
            for index, (row, start, length) in mb.spans.items():
                values = logp[row, start : start + length].tolist()
                values[0] = 0.0
                out[index] = values
    return out
