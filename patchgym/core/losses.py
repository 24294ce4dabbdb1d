"""Training losses in plain torch: masked NLL (SFT) and GRPO with importance-sampling correction.

This module is the training contract every trainer backend calls; it imports torch, so import
it only where training happens (`import patchgym` does not load it).

Per micro-batch a trainer computes the per-token log-probs of the batch's tokens under its
current weights (`logprobs[r, i] = log p(input_ids[r, i] | input_ids[r, <i])`, aligned with the
tokens as in `patchgym.core.batch`) and calls `micro_batch_loss`. The returned loss is already
divided by the whole step's normaliser (`Normaliser`), so summing the gradients of the micro-
batches gives the gradient of the step's loss: gradient accumulation is exact. The returned
`sums` add up over micro-batches; `summarize` turns them into the step's metrics.

GRPO per token, with `old` the trainer's log-prob before the step (detached), `engine` the
sampling engine's log-prob and `A` the token's advantage:
    ratio = exp(logp - old)
    pg    = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    w     = min(exp(old - engine), tis_cap)             (truncated importance sampling)
    loss  = w * pg * keep + kl_coef * (exp(ref - logp) - (ref - logp) - 1)
`keep` is 0 for tokens whose importance ratio exp(old - engine) lies outside `tis_mask`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from patchgym.core.batch import TrainBatch
from patchgym.core.errors import ConfigError

Aggregation = Literal["token_mean", "seq_mean"]
"""token_mean: every trained token weighs the same; seq_mean: every sample weighs the same."""


@dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the masked (assistant) tokens."""

    aggregation: Aggregation = "token_mean"


@dataclass(frozen=True)
class GRPOLoss:
    """Clipped policy-gradient loss with truncated importance sampling against the engine."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    """Upper bound on the importance weight exp(old - engine); None: no importance weighting."""
    tis_mask: tuple[float, float] | None = None
    """Drop tokens whose importance ratio is outside [low, high] (None: keep all)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to a reference policy; 0 (the default) needs no reference."""
    aggregation: Aggregation = "token_mean"

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ConfigError(f"clip_low must be in [0, 1) and clip_high >= 0 (got {self.clip_low}, {self.clip_high})")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"tis_cap must be positive or None (got {self.tis_cap})")
        if self.tis_mask is not None and not 0 <= self.tis_mask[0] < self.tis_mask[1]:
            raise ConfigError(f"tis_mask must be (low, high) with 0 <= low < high (got {self.tis_mask})")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0 (got {self.kl_coef})")

    @property
    def uses_engine_logprobs(self) -> bool:
        return self.tis_cap is not None or self.tis_mask is not None


Loss = SFTLoss | GRPOLoss


def group_advantages(
    rewards: Sequence[float | None], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float | None]:
    """Advantages of one GRPO group: reward minus the mean over the valid members.

    `None` marks an invalid member (an infrastructure error): it gets advantage None and does
    not enter the mean or the std. With `normalize_std` the centred rewards are divided by the
    (population) std + eps; `normalize_std=False` is Dr.GRPO. A group whose valid rewards are all
    equal gets advantage 0 for every valid member.
    """
    valid = [float(r) for r in rewards if r is not None]
    if not valid:
        return [None] * len(rewards)
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / len(valid))
    scale = (std + eps) if normalize_std and std > 0 else 1.0
    return [None if r is None else (float(r) - mean) / scale for r in rewards]


@dataclass(frozen=True)
class Normaliser:
    """The step-wide denominators: trained tokens and samples with at least one trained token."""

    tokens: int
    samples: int

    @classmethod
    def of(cls, batch: TrainBatch) -> Normaliser:
        if batch.trained_tokens == 0:
            raise ConfigError("the batch has no trained tokens (every loss_mask is 0)")
        return cls(batch.trained_tokens, batch.trained_samples)


def check_batch(loss: Loss, batch: TrainBatch) -> None:
    """Refuse a batch the loss cannot be computed on, saying what is missing."""
    if isinstance(loss, GRPOLoss) and loss.uses_engine_logprobs:
        missing = [i for i, s in enumerate(batch.samples) if s.engine_logprobs is None]
        if missing:
            raise ConfigError(
                f"GRPO with importance sampling needs engine_logprobs on every sample; samples {missing[:5]} "
                "have none (set tis_cap=None and tis_mask=None to train without the correction)"
            )


def has_gradient(loss: Loss, batch: TrainBatch) -> bool:
    """Whether `loss` on `batch` can have a nonzero gradient.

    A GRPO batch whose every advantage is 0 (all groups solved, or all failed) and that has no
    KL term has none: trainers then skip the optimiser step, since AdamW would otherwise keep
    moving the weights on its stale momentum with nothing to learn from.
    """
    trained = [s for s in batch.samples if s.trained_tokens]
    if isinstance(loss, GRPOLoss):
        return (loss.kl_coef > 0 and bool(trained)) or any(s.advantage != 0 for s in trained)
    return bool(trained)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies aligned with `input_ids` ([rows, T]); position 0 gets 0."""
    logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = picked.new_zeros(picked.shape[0], 1)
    return torch.cat([zero, picked], dim=1), torch.cat([zero, entropy], dim=1)


def _aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor, how: Aggregation, norm: Normaliser
) -> torch.Tensor:
    masked = per_token * mask
    if how == "token_mean":
        return masked.sum() / norm.tokens
    if how != "seq_mean":
        raise ConfigError(f"unknown aggregation {how!r}; use 'token_mean' or 'seq_mean'")
    index = (sample_index + 1).flatten()  # slot 0 collects padding
    slots = int(index.max()) + 1
    totals = masked.new_zeros(slots).index_add(0, index, masked.flatten())
    counts = mask.new_zeros(slots, dtype=masked.dtype).index_add(0, index, mask.flatten().to(masked.dtype))
    present = counts[1:] > 0
    return (totals[1:][present] / counts[1:][present]).sum() / norm.samples


def micro_batch_loss(
    loss: Loss,
    logprobs: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    norm: Normaliser,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch (scaled for the whole step) and its metric sums.

    `batch` is `MicroBatch.tensors()`. For GRPO, `old_logprobs` defaults to the detached
    `logprobs` (one optimiser step per batch, so the weights before the step are the current ones).
    """
    mask = batch["loss_mask"].to(logprobs.dtype)
    n = float(mask.sum())
    sums: dict[str, float] = {"tokens": n}
    if entropy is not None:
        sums["entropy_sum"] = float((entropy.detach() * mask).sum())
    if isinstance(loss, SFTLoss):
        value = _aggregate(-logprobs, mask, batch["sample_index"], loss.aggregation, norm)
        sums["nll_sum"] = float((-logprobs.detach() * mask).sum())
        return value, sums
    if not isinstance(loss, GRPOLoss):
        raise ConfigError(f"unknown loss {type(loss).__name__}; use SFTLoss or GRPOLoss")
    old = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
    adv = batch["advantages"].to(logprobs.dtype)
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 1 - loss.clip_low, 1 + loss.clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    clip_active = ((adv > 0) & (ratio > 1 + loss.clip_high)) | ((adv < 0) & (ratio < 1 - loss.clip_low))
    inside = torch.ones_like(pg)
    weight = torch.ones_like(pg)
    if loss.uses_engine_logprobs:
        raw = torch.exp(old - batch["engine_logprobs"].to(logprobs.dtype))
        gap = (old - batch["engine_logprobs"]).abs()
        sums["gap_sum"] = float((gap * mask).sum())
        sums["is_w_sum"] = float((raw * mask).sum())
        sums["is_w_sq_sum"] = float((raw * raw * mask).sum())
        if loss.tis_cap is not None:
            weight = torch.clamp(raw, max=loss.tis_cap)
        if loss.tis_mask is not None:
            inside = ((raw >= loss.tis_mask[0]) & (raw <= loss.tis_mask[1])).to(mask.dtype)
            sums["is_masked"] = float((mask * (1 - inside)).sum())
    per_token = pg * weight * inside
    sums["pg_sum"] = float((per_token.detach() * mask).sum())
    if loss.kl_coef > 0:
        if ref_logprobs is None:
            raise ConfigError("GRPOLoss.kl_coef > 0 needs reference log-probs; set kl_coef=0 or load a reference")
        d = ref_logprobs.detach() - logprobs
        kl = torch.exp(d) - d - 1
        sums["kl_sum"] = float((kl.detach() * mask).sum())
        per_token = per_token + loss.kl_coef * kl
    sums["clipped"] = float((clip_active.to(mask.dtype) * mask).sum())
    return _aggregate(per_token, mask, batch["sample_index"], loss.aggregation, norm), sums


def add_sums(total: dict[str, float], part: Mapping[str, float]) -> dict[str, float]:
    """Accumulate `micro_batch_loss` sums across micro-batches (in place; returns `total`)."""
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value
    return total


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
    """Step metrics from summed micro-batch statistics.

    clip_fraction: share of trained tokens where the clipped branch is active; logprob_gap: mean
    |trainer - engine| log-prob; is_ess: effective sample size of the (untruncated) importance
    weights as a fraction of the tokens, (sum w)^2 / (n sum w^2); is_masked_fraction: share of
    tokens dropped by `tis_mask`; entropy, kl and nll: means per trained token.
    """
    n = sums.get("tokens", 0.0)
    if n <= 0:
        return {}
    out = {"trained_tokens": n}
    for key, name in (("entropy_sum", "entropy"), ("nll_sum", "nll"), ("kl_sum", "kl"), ("gap_sum", "logprob_gap")):
        if key in sums:
            out[name] = sums[key] / n
    if "clipped" in sums:
        out["clip_fraction"] = sums["clipped"] / n
        out["pg_loss"] = sums["pg_sum"] / n
    if "is_w_sum" in sums:
        out["is_ess"] = sums["is_w_sum"] ** 2 / (n * sums["is_w_sq_sum"]) if sums["is_w_sq_sum"] > 0 else 0.0
    if "is_masked" in sums:
        out["is_masked_fraction"] = sums["is_masked"] / n
    return out
