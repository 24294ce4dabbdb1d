"""The embedded trainer: a transformers causal LM trained in this process with torch.

Packed micro-batches go through the model without an attention mask and with position ids
that restart at every sample. With `attention="varlen"` (the default) each sample's attention
runs on its own (`varlen_attention.py`), at sum(L_i^2) cost; with "sdpa" or "eager",
transformers builds a block-diagonal causal mask over the whole row instead. Either way
attention never crosses samples. All compute runs in one worker thread: the event loop stays
free while a step runs, and steps never overlap.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from patchgym.backends.device import resolve_device
from patchgym.backends.trainer import varlen_attention
from patchgym.backends.trainer.common import (
    OptimSettings,
    TrainerWeights,
    accumulate_gradients,
    per_sample_logprobs,
    rng_state,
    set_rng_state,
    step_metrics,
)
from patchgym.core.batch import TrainBatch
from patchgym.core.errors import ConfigError
from patchgym.core.losses import Loss, has_gradient, token_logprobs

STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
ATTENTION = {"varlen": varlen_attention.VARLEN, "sdpa": "sdpa", "eager": "eager"}
"""The `attention` setting -> transformers' attention implementation."""


def _load_model(model: Any, dtype: torch.dtype, attention: str) -> Any:
    from transformers import AutoModelForCausalLM, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        loaded = model.to(dtype)
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model {str(model)!r} is not a Hugging Face model directory (no config.json there)")
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    loaded.set_attn_implementation(ATTENTION[attention])
    if loaded.config._attn_implementation != ATTENTION[attention]:
        raise ConfigError(f"{type(loaded).__name__} cannot switch to attention {attention!r}; use 'sdpa' or 'eager'")
    return loaded


class EmbeddedTrainer:
    """`Trainer` on a transformers model: AdamW, clipping, accumulation, checkpoints with RNG state."""

    def __init__(
        self,
        model: Any,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        warmup_steps: int = 0,
        micro_batch_tokens: int = 8192,
        packing: bool = True,
        micro_batch_rows: int | None = None,
        gradient_checkpointing: bool = False,
        attention: str = "varlen",
        reference_model: Any = None,
        dtype: str = "float32",
        seed: int = 0,
        threads: int | None = None,
        device: str = "auto",
    ) -> None:
        """`model`: a folder, or a loaded model (used as is).

        Args:
            model: the policy's Hugging Face folder (the pipeline passes model.path or the tiny model)
            lr: peak learning rate of AdamW (a stage's sft.lr or grpo.lr replaces it)
            weight_decay: AdamW's decoupled weight decay
            betas: AdamW's moment coefficients (beta1, beta2)
            grad_clip: the gradient's largest global norm (0: no clipping)
            warmup_steps: optimiser steps of linear warm-up to lr
            micro_batch_tokens: tokens per forward/backward pass; a step accumulates over its micro-batches
            packing: pack samples end to end into rows of micro_batch_tokens (else one sample per row)
            micro_batch_rows: at most this many rows per micro-batch without packing (null: by tokens only)
            gradient_checkpointing: recompute activations in the backward pass (less memory, more compute)
            attention: varlen (each packed sample attends on its own), sdpa or eager
            reference_model: a frozen reference policy's folder, for a KL term (null: none)
            dtype: weights, gradients and optimiser state: float32 or bfloat16
            seed: torch's seed at start-up
            threads: torch CPU threads (null: torch's default, one per core)
            device: cpu, cuda, cuda:N, rocm, rocm:N, or auto (the first GPU torch sees, else the CPU)
        """
        if micro_batch_tokens < 2:
            raise ConfigError(f"micro_batch_tokens must be at least 2 (got {micro_batch_tokens})")
        if not hasattr(torch, dtype):
            raise ConfigError(f"unknown dtype {dtype!r}; use float32 or bfloat16")
        if attention not in ATTENTION:
            raise ConfigError(f"unknown attention {attention!r}; use one of {sorted(ATTENTION)}")
        torch.manual_seed(seed)
        if threads is not None:
            torch.set_num_threads(threads)
        self.dtype = getattr(torch, dtype)
        self.device = resolve_device(device)
        self.model = _load_model(model, self.dtype, attention).to(self.device)
        self.model.train()
        if gradient_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5
                self.model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference = None
        if reference_model is not None:
            reference = _load_model(reference_model, self.dtype, attention).to(self.device)
            self.reference = reference.eval().requires_grad_(False)
        self.optim = OptimSettings(lr, weight_decay, betas, grad_clip=grad_clip, warmup_steps=warmup_steps)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=betas, eps=self.optim.eps, weight_decay=weight_decay
        )
        self.step_count = 0
        """Optimiser steps taken (the warm-up's clock; steps skipped for lack of a gradient do not count)."""
        self.micro_batch_tokens = micro_batch_tokens
        self.packing = packing
        self.micro_batch_rows = micro_batch_rows
        self.gradient_checkpointing = gradient_checkpointing
        self.attention = attention
        self.threads = threads
        self.version = 0
        self._pad_id = self.model.config.pad_token_id or 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="patchgym-trainer")

    def settings(self) -> dict[str, Any]:
        """Every limit and knob of this trainer."""
        return {
            "backend": "embedded",
            "micro_batch_tokens": self.micro_batch_tokens,
            "packing": self.packing,
            "micro_batch_rows": self.micro_batch_rows,
            "gradient_checkpointing": self.gradient_checkpointing,
            "attention": self.attention,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "threads": self.threads or torch.get_num_threads(),
            "worker_threads": 1,
            "reference_model": self.reference is not None,
            **self.optim.as_dict(),
        }

    # -- compute (worker thread) ----------------------------------------------------------
    def _prepare(self, batch: TrainBatch) -> TrainBatch:
        """Apply this trainer's micro-batch settings to `batch`."""
        return TrainBatch(
            batch.samples, self.micro_batch_tokens, self.packing, self._pad_id, self.micro_batch_rows, batch.temperature
        )

    def _forward_with(self, model: Any, temperature: float = 1.0) -> Any:
        def forward(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            packed = t["input_ids"].shape[0] == 1  # one row: samples end to end, separated by position ids
            logits = model(
                input_ids=t["input_ids"],
                position_ids=t["position_ids"],
                attention_mask=None if packed else t["attention_mask"],
                use_cache=False,
            ).logits
            return token_logprobs(logits / temperature if temperature != 1.0 else logits, t["input_ids"])

        return forward

    def _logprobs(self, batch: TrainBatch) -> list[list[float]]:
        was_training = self.model.training
        self.model.eval()
        try:
            forward = self._forward_with(self.model, batch.temperature)
            return per_sample_logprobs(self._prepare(batch), forward, device=self.device)
        finally:
            self.model.train(was_training)

    def _train_step(self, batch: TrainBatch, loss: Loss) -> dict[str, float]:
        started = time.perf_counter()
        batch = self._prepare(batch)
        self.optimizer.zero_grad(set_to_none=True)
        reference = self._forward_with(self.reference, batch.temperature) if self.reference is not None else None
        forward = self._forward_with(self.model, batch.temperature)
        total, sums = accumulate_gradients(batch, loss, forward, reference=reference, device=self.device)
        clip = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        lr = self.optim.lr_at(self.step_count)
        stepped = has_gradient(loss, batch)
        if stepped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step_count += 1
        self.version += 1
        return step_metrics(
            batch,
            started,
            sums,
            loss=total,
            grad_norm=grad_norm,
            lr=lr,
            version=float(self.version),
            optimizer_skipped=float(not stepped),
        )

    def _set_lr(self, lr: float) -> None:
        self.optim = replace(self.optim, lr=lr)

    def _reset_optimizer(self) -> None:
        self.optimizer.state.clear()  # AdamW starts its moments afresh at the next step
        self.step_count = 0

    def _state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def _export(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        return directory

    def _save(self, directory: Path) -> None:
        self._export(directory / MODEL_DIR)
        state = {
            "version": self.version,
            "optimizer": self.optimizer.state_dict(),
            "step": self.step_count,
            "lr": self.optim.lr,
            "rng": rng_state(),
            "settings": self.settings(),
        }
        torch.save(state, directory / STATE_FILE)

    def _load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        state_path = directory / STATE_FILE
        if not state_path.is_file():
            raise ConfigError(f"{directory} is not a checkpoint of the embedded trainer (no {STATE_FILE})")
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted((directory / MODEL_DIR).glob("*.safetensors")):
            weights.update(load_file(shard))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or set(missing) - tied:
            raise ConfigError(
                f"checkpoint {directory} does not fit this model: missing {sorted(set(missing) - tied)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        if tied:
            self.model.tie_weights()
        state = torch.load(state_path, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        self.version, self.step_count = state["version"], state["step"]
        self.optim = replace(self.optim, lr=state["lr"])

    # -- the Trainer contract ---------------------------------------------------------------
    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-token log-probs of every sample under the current weights (entry 0 is 0.0)."""
        return await self._run(self._logprobs, batch)

    async def train_step(self, batch: TrainBatch, loss: Loss) -> dict[str, float]:
        """One optimiser step over `batch` (accumulated over its micro-batches); returns metrics."""
        return await self._run(self._train_step, batch, loss)

    async def set_lr(self, lr: float) -> None:
        """Change the peak learning rate for the following steps (warm-up continues where it is)."""
        await self._run(self._set_lr, lr)

    async def reset_optimizer(self) -> None:
        """Forget the optimiser's moments and restart the warm-up (e.g. between SFT and RL)."""
        await self._run(self._reset_optimizer)

    async def weights(self, export_to: Path | None = None) -> TrainerWeights:
        """A copy of the current state dict; with `export_to`, also an HF-format directory (for SGLang)."""
        state = await self._run(self._state_dict)
        path = await self._run(self._export, Path(export_to)) if export_to is not None else None
        return TrainerWeights(self.version, state, path, {"format": "hf"})

    async def save(self, directory: Path) -> None:
        await self._run(self._save, Path(directory))

    async def load(self, directory: Path) -> None:
        await self._run(self._load, Path(directory))

    async def aclose(self) -> None:
        self._executor.shutdown(wait=True)
