"""Packing and padding of training samples (no torch needed)."""

from __future__ import annotations

import random

import pytest

from patchgym.core.batch import Sample, TrainBatch, pack, pad
from patchgym.core.errors import ConfigError


def make(n: int, start: int = 1, adv: float = 0.5) -> Sample:
    return Sample(
        token_ids=list(range(start, start + n)),
        loss_mask=[0] + [1] * (n - 1),
        advantage=adv,
        engine_logprobs=[-0.1 * i for i in range(n)],
    )


def test_pack_fits_budget_and_keeps_every_token_once() -> None:
    rng = random.Random(0)
    samples = [make(rng.randint(2, 40), start=100 * i, adv=i) for i in range(25)]
    mbs = pack(samples, 64)
    seen = {}
    for mb in mbs:
        rows, width = mb.shape
        assert rows == 1 and width <= 64
        for index, (row, start, length) in mb.spans.items():
            assert index not in seen
            seen[index] = True
            s = samples[index]
            assert mb.input_ids[row][start : start + length] == s.token_ids
            assert mb.position_ids[row][start : start + length] == list(range(length))
            assert mb.loss_mask[row][start : start + length] == s.loss_mask
            assert mb.advantages[row][start : start + length] == [float(s.advantage)] * length
            assert mb.engine_logprobs[row][start : start + length] == s.engine_logprobs
            assert mb.sample_index[row][start : start + length] == [index] * length
        padding = [i for i, k in enumerate(mb.sample_index[0]) if k < 0]
        assert all(mb.loss_mask[0][i] == 0 for i in padding)
    assert sorted(seen) == list(range(25))
    # first-fit decreasing needs no more rows than a simple lower bound allows plus slack
    assert len(mbs) <= -(-sum(len(s) for s in samples) // 64) + 2


def test_pad_one_sample_per_row_within_budget() -> None:
    samples = [make(n) for n in (5, 30, 7, 2, 16)]
    mbs = pad(samples, 64)
    for mb in mbs:
        rows, width = mb.shape
        assert rows * width <= 64
        assert width == max(length for _, _, length in mb.spans.values())
    assert sorted(i for mb in mbs for i in mb.spans) == list(range(5))
    # padded layout wastes tokens that the packed layout does not
    padded = sum(mb.shape[0] * mb.shape[1] for mb in mbs)
    packed = sum(mb.shape[0] * mb.shape[1] for mb in pack(samples, 64))
    assert packed < padded


def test_bad_samples_are_refused_with_a_reason() -> None:
    with pytest.raises(ConfigError, match="loss_mask\\[0\\]"):
        Sample([1, 2, 3], [1, 1, 1])
    with pytest.raises(ConfigError, match="one per token"):
        Sample([1, 2, 3], [0, 1])
    with pytest.raises(ConfigError, match="token budget 8"):
        pack([make(9)], 8)
    with pytest.raises(ConfigError, match="at least one sample"):
        TrainBatch([])


def test_train_batch_counts() -> None:
    batch = TrainBatch([make(4), Sample([1, 2], [0, 0])], micro_batch_tokens=16)
    assert batch.trained_tokens == 3 and batch.trained_samples == 1 and batch.total_tokens == 6
    assert len(batch.micro_batches()) == 1


def test_pad_with_fixed_rows() -> None:
    samples = [make(n) for n in (5, 30, 7, 2, 16)]
    mbs = pad(samples, 64, rows=2)
    assert [mb.shape for mb in mbs] == [(2, 30), (2, 7), (1, 16)]
    with pytest.raises(ConfigError, match="rows"):
        pad(samples, 64, rows=0)
