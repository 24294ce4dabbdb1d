"""The training batch: trajectories as token sequences, packed into micro-batches by a token budget.

A `Sample` is one trajectory flattened to tokens. Per-token fields are aligned with
`token_ids`: entry `i` describes token `i` as a prediction from tokens `< i`, so entry 0 is
never trained. `loss_mask[i] = 1` marks tokens the policy produced (assistant tokens);
prompt and observation tokens are 0. `engine_logprobs[i]` is the engine's log-prob of token
`i` when it sampled it (0.0 where the engine did not sample).

`pack` places samples end to end in rows of at most `token_budget` tokens (first-fit
decreasing); position ids restart at 0 at every sample start, which is how a trainer keeps
attention from crossing samples. `pad` builds the padded layout (one sample per row) for
comparison. Neither needs torch; `MicroBatch.tensors()` imports it when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from patchgym.core.errors import ConfigError


@dataclass
class Sample:
    """One trajectory as tokens, with what the loss needs per token."""

    token_ids: list[int]
    loss_mask: list[int]
    advantage: float = 0.0
    engine_logprobs: list[float] | None = None
    policy_versions: list[int] | None = None
    """The engine's policy version per token (None where unknown)."""
    group_id: str | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 2:
            raise ConfigError(f"a sample needs at least 2 tokens (got {n}): nothing to predict")
        for name in ("loss_mask", "engine_logprobs", "policy_versions"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ConfigError(f"sample {name} has {len(value)} entries for {n} tokens; give one per token")
        if self.loss_mask[0]:
            raise ConfigError("loss_mask[0] must be 0: the first token has no context to be predicted from")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(1 for m in self.loss_mask if m)


@dataclass
class MicroBatch:
    """Rows of tokens; in a packed micro-batch a row holds several samples end to end.

    `spans[k] = (row, start, length)` says where sample `k` (its index in the batch) lives.
    Padding has `loss_mask` 0 and `sample_index` -1.
    """

    input_ids: list[list[int]]
    position_ids: list[list[int]]
    loss_mask: list[list[int]]
    advantages: list[list[float]]
    engine_logprobs: list[list[float]]
    sample_index: list[list[int]]
    spans: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    packed: bool = True

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.input_ids), len(self.input_ids[0]) if self.input_ids else 0

    @property
    def real_tokens(self) -> int:
        return sum(length for _, _, length in self.spans.values())

    def tensors(self, device: Any = "cpu") -> dict[str, Any]:
        """The fields as torch tensors: ids and masks as int64, advantages/log-probs as float32."""
        import torch

        ints = ("input_ids", "position_ids", "loss_mask", "sample_index")
        out = {name: torch.tensor(getattr(self, name), dtype=torch.long, device=device) for name in ints}
        for name in ("advantages", "engine_logprobs"):
            out[name] = torch.tensor(getattr(self, name), dtype=torch.float32, device=device)
        out["attention_mask"] = (out["sample_index"] >= 0).long()
        return out


class _RowBuilder:
    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.rows: list[dict[str, list[Any]]] = []
        self.spans: dict[int, tuple[int, int, int]] = {}

    def new_row(self) -> int:
        self.rows.append({k: [] for k in ("ids", "pos", "mask", "adv", "logp", "idx")})
        return len(self.rows) - 1

    def add(self, row: int, index: int, sample: Sample) -> None:
        r, n = self.rows[row], len(sample)
        self.spans[index] = (row, len(r["ids"]), n)
        r["ids"] += sample.token_ids
        r["pos"] += range(n)
        r["mask"] += [1 if m else 0 for m in sample.loss_mask]
        r["adv"] += [float(sample.advantage)] * n
        r["logp"] += sample.engine_logprobs if sample.engine_logprobs is not None else [0.0] * n
        r["idx"] += [index] * n

    def build(self, width: int | None, packed: bool) -> MicroBatch:
        width = width or max(len(r["ids"]) for r in self.rows)
        fill = {"ids": self.pad_id, "pos": 0, "mask": 0, "adv": 0.0, "logp": 0.0, "idx": -1}
        for r in self.rows:
            extra = width - len(r["ids"])
            for key, value in fill.items():
                r[key] += [value] * extra
        get = lambda key: [r[key] for r in self.rows]  # noqa: E731
        return MicroBatch(get("ids"), get("pos"), get("mask"), get("adv"), get("logp"), get("idx"), self.spans, packed)


def _check_budget(samples: Sequence[Sample], token_budget: int) -> None:
    if token_budget < 2:
        raise ConfigError(f"token_budget must be at least 2 (got {token_budget})")
    for i, sample in enumerate(samples):
        if len(sample) > token_budget:
            raise ConfigError(
                f"sample {i} has {len(sample)} tokens, more than the micro-batch token budget {token_budget}; "
                "raise micro_batch_tokens or cap trajectory length"
            )


def pack(samples: Sequence[Sample], token_budget: int, *, pad_id: int = 0) -> list[MicroBatch]:
    """Pack samples into single-row micro-batches of at most `token_budget` tokens (first-fit decreasing).

    Each micro-batch's row is padded to the longest row it holds, never beyond the budget.
    """
    _check_budget(samples, token_budget)
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    bins: list[tuple[int, list[int]]] = []  # (used tokens, sample indices)
    for i in order:
        n = len(samples[i])
        for b, (used, members) in enumerate(bins):
            if used + n <= token_budget:
                bins[b] = (used + n, [*members, i])
                break
        else:
            bins.append((n, [i]))
    out = []
    for _, members in bins:
        builder = _RowBuilder(pad_id)
        row = builder.new_row()
        for i in sorted(members):
            builder.add(row, i, samples[i])
        out.append(builder.build(None, packed=True))
    return out


def pad(samples: Sequence[Sample], token_budget: int, *, pad_id: int = 0, rows: int | None = None) -> list[MicroBatch]:
    """One sample per row, rows padded to the longest, samples in their given order.

    By default a micro-batch takes rows while rows x width stays within `token_budget`; with
    `rows`, every micro-batch takes that many samples whatever their lengths (the fixed
    micro-batch size of frameworks without packing).
    """
    _check_budget(samples, token_budget)
    if rows is not None and rows < 1:
        raise ConfigError(f"rows must be at least 1 (got {rows})")
    out: list[MicroBatch] = []
    members: list[int] = []
    for i in [*range(len(samples)), None]:
        if i is not None:
            width = max(len(samples[j]) for j in [*members, i])
            fits = len(members) < rows if rows is not None else (len(members) + 1) * width <= token_budget
            if fits:
                members.append(i)
                continue
        if members:
            builder = _RowBuilder(pad_id)
            for j in members:
                builder.add(builder.new_row(), j, samples[j])
            out.append(builder.build(None, packed=False))
        members = [i] if i is not None else []
    return out


@dataclass
class TrainBatch:
    """The samples of one optimiser step and how to split them into micro-batches."""

    samples: list[Sample]
    micro_batch_tokens: int = 8192
    packing: bool = True
    pad_id: int = 0
    rows: int | None = None
    """Without packing: a fixed number of rows per micro-batch (None: as many as the budget allows)."""
    temperature: float = 1.0
    """The temperature the engine sampled these tokens at: trainers take log-probs of logits / temperature,
    the distribution the engine's log-probs come from, so importance weights compare like with like."""

    def __post_init__(self) -> None:
        if not self.samples:
            raise ConfigError("a training batch needs at least one sample")
        if self.temperature <= 0:
            raise ConfigError(
                f"a training batch needs a sampling temperature > 0 (got {self.temperature}); "
                "greedy (temperature 0) rollouts have no distribution to train"
            )

    def micro_batches(self) -> list[MicroBatch]:
        if self.packing:
            return pack(self.samples, self.micro_batch_tokens, pad_id=self.pad_id)
        return pad(self.samples, self.micro_batch_tokens, pad_id=self.pad_id, rows=self.rows)

    @property
    def trained_tokens(self) -> int:
        return sum(s.trained_tokens for s in self.samples)

    @property
    def trained_samples(self) -> int:
        return sum(1 for s in self.samples if s.trained_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(len(s) for s in self.samples)
