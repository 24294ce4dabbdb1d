"""Tokens-per-GPU batching for the Megatron trainer: a step's samples split between the data-parallel
ranks by tokens, then packed into each rank's micro-batches.

Every rank computes the same split from the same batch (no communication): samples, longest first, go
to the rank holding the fewest tokens so far (longest-processing-time first), then each rank packs its
own samples into micro-batches of at most `micro_batch_tokens` (`core.batch.pack`, first-fit
decreasing). Splitting samples rather than finished micro-batches balances at a sample's granularity:
three full micro-batches over two ranks become about one and a half each, not two and one. The
balance is reported as `dp_tokens_max_over_mean` (1.0: even; the step waits for the busiest rank).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from patchgym.core.batch import MicroBatch, TrainBatch, pack
from patchgym.core.errors import ConfigError


@dataclass(frozen=True)
class DataParallelSplit:
    """Each data-parallel rank's sample indices (into the batch) and its token count."""

    shares: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]

    @property
    def max_over_mean(self) -> float:
        """The busiest rank's tokens over the mean (1.0 when even)."""
        mean = sum(self.tokens) / len(self.tokens)
        return max(self.tokens) / mean if mean else 1.0


def split_by_tokens(lengths: list[int], dp: int) -> DataParallelSplit:
    """Samples of `lengths` tokens over `dp` ranks, longest first to the least loaded (ties: lowest rank)."""
    shares: list[list[int]] = [[] for _ in range(dp)]
    tokens = [0] * dp
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(dp), key=lambda r: (tokens[r], r))
        shares[rank].append(index)
        tokens[rank] += lengths[index]
    return DataParallelSplit(tuple(tuple(sorted(s)) for s in shares), tuple(tokens))


def check_lengths(lengths: list[int], micro_batch_tokens: int) -> None:
    """Every sample fits in one micro-batch: a packed sample is never split."""
    for index, length in enumerate(lengths):
        if length > micro_batch_tokens:
            raise ConfigError(
                f"sample {index} has {length} tokens, more than trainer.options micro_batch_tokens="
                f"{micro_batch_tokens}: raise micro_batch_tokens or lower agent.max_tokens_per_trajectory to at most it"
            )


def empty_micro_batch(pad_id: int) -> MicroBatch:
    """One padding token: a forward pass that trains nothing and yields no log-probs."""
    return MicroBatch([[pad_id]], [[0]], [[0]], [[0.0]], [[0.0]], [[-1]], {})


def _renumbered(mb: MicroBatch, indices: tuple[int, ...]) -> MicroBatch:
    """`mb` packed from `indices`' samples, its sample numbers turned back into batch indices."""
    rows = [[indices[i] if i >= 0 else -1 for i in row] for row in mb.sample_index]
    return replace(mb, sample_index=rows, spans={indices[k]: span for k, span in mb.spans.items()})


def _packed(batch: TrainBatch, micro_batch_tokens: int, indices: tuple[int, ...]) -> list[MicroBatch]:
    if not indices:
        return []
    mbs = pack([batch.samples[i] for i in indices], micro_batch_tokens, pad_id=batch.pad_id)
    return [_renumbered(mb, indices) for mb in mbs]


def rank_share(
    batch: TrainBatch, micro_batch_tokens: int, dp: int, dp_rank: int, *, equal_counts: bool = False
) -> tuple[list[MicroBatch], DataParallelSplit]:
    """Data-parallel rank `dp_rank`'s packed micro-batches of `batch`, and the split they come from.

    With `equal_counts` (expert parallelism: every rank of an all-to-all runs as many forward passes)
    a rank with fewer micro-batches than the busiest gets empty ones.
    """
    lengths = [len(s) for s in batch.samples]
    check_lengths(lengths, micro_batch_tokens)
    split = split_by_tokens(lengths, dp)
    if not equal_counts:
        return _packed(batch, micro_batch_tokens, split.shares[dp_rank]), split
    every = [_packed(batch, micro_batch_tokens, share) for share in split.shares]
    most = max(len(mbs) for mbs in every)
    mine = every[dp_rank]
    return mine + [empty_micro_batch(batch.pad_id) for _ in range(most - len(mine))], split
