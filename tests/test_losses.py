"""Losses checked against worked examples computed with plain Python loops."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from patchgym.core.batch import Sample, TrainBatch  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from patchgym.core.losses import (  # noqa: E402
    GRPOLoss,
    Normaliser,
    SFTLoss,
    add_sums,
    check_batch,
    group_advantages,
    has_gradient,
    micro_batch_loss,
    summarize,
    token_logprobs,
)


def test_group_advantages_by_hand() -> None:
    # rewards 1, 0, 0, 1 -> mean 0.5, population std 0.5
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # an infra-error member (None) is left out of the statistics and gets no advantage
    adv = group_advantages([1.0, None, 0.0, 0.0], eps=0.0)
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)
    assert adv[1] is None
    assert adv[0] == pytest.approx((1 - mean) / std) and adv[2] == pytest.approx(-mean / std)
    # Dr.GRPO: centred only
    assert group_advantages([1.0, None, 0.0, 0.0], normalize_std=False) == pytest.approx([2 / 3, None, -1 / 3, -1 / 3])
    # all equal: zero advantage, no division by zero
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([None, None]) == [None, None]


def test_token_logprobs_match_manual_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 5)
    ids = torch.tensor([[0, 3, 1, 4]])
    logp, ent = token_logprobs(logits, ids)
    assert logp[0, 0] == 0
    for i in range(1, 4):
        row = logits[0, i - 1].tolist()
        z = math.log(sum(math.exp(x) for x in row))
        assert float(logp[0, i]) == pytest.approx(row[ids[0, i]] - z, abs=1e-5)
        probs = [math.exp(x - z) for x in row]
        assert float(ent[0, i]) == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-5)


def two_sample_batch(packing: bool = True) -> tuple[TrainBatch, None]:
    # sample 0: 4 tokens, trained on 3; sample 1: 3 tokens, trained on the last one
    s0 = Sample([5, 6, 7, 8], [0, 1, 1, 1], advantage=1.0, engine_logprobs=[0.0, -1.0, -0.5, -2.0])
    s1 = Sample([9, 10, 11], [0, 0, 1], advantage=-1.0, engine_logprobs=[0.0, 0.0, -0.3])
    return TrainBatch([s0, s1], micro_batch_tokens=16, packing=packing), None


def run(loss, batch: TrainBatch, logps: dict[int, list[float]], *, shift: dict[int, list[float]] | None = None):
    """Loss and metrics with trainer log-probs `logps` (per sample) and old = logps - shift."""
    (mb,) = batch.micro_batches()
    t = mb.tensors()
    lp = torch.zeros(t["input_ids"].shape)
    old = torch.zeros(t["input_ids"].shape)
    for k, (row, start, n) in mb.spans.items():
        lp[row, start : start + n] = torch.tensor(logps[k])
        old[row, start : start + n] = torch.tensor(logps[k]) - torch.tensor((shift or {}).get(k, [0.0] * n))
    lp.requires_grad_(True)
    value, sums = micro_batch_loss(loss, lp, t, Normaliser.of(batch), old_logprobs=old)
    return value, summarize(add_sums({}, sums)), lp, mb


LOGPS = {0: [0.0, -1.2, -0.4, -2.0], 1: [0.0, -0.7, -0.5]}


def test_sft_token_and_sequence_mean() -> None:
    batch, _ = two_sample_batch()
    value, metrics, _, _ = run(SFTLoss(), batch, LOGPS)
    assert value.item() == pytest.approx((1.2 + 0.4 + 2.0 + 0.5) / 4)
    assert metrics["nll"] == pytest.approx(4.1 / 4)
    value, _, _, _ = run(SFTLoss("seq_mean"), batch, LOGPS)
    assert value.item() == pytest.approx(((1.2 + 0.4 + 2.0) / 3 + 0.5 / 1) / 2)


def test_sft_padded_equals_packed() -> None:
    packed, _ = two_sample_batch(True)
    padded, _ = two_sample_batch(False)
    assert run(SFTLoss(), packed, LOGPS)[0].item() == pytest.approx(run(SFTLoss(), padded, LOGPS)[0].item())


def grpo_by_hand(loss: GRPOLoss, batch: TrainBatch, shift: dict[int, list[float]]) -> tuple[float, float, float, int]:
    """Token-mean GRPO loss, clip count, ESS, masked count with plain loops."""
    total, clipped, n, ws, masked = 0.0, 0, 0, [], 0
    for k, s in enumerate(batch.samples):
        for i, m in enumerate(s.loss_mask):
            if not m:
                continue
            n += 1
            lp, old = LOGPS[k][i], LOGPS[k][i] - shift.get(k, [0.0] * len(s))[i]
            ratio = math.exp(lp - old)
            a = s.advantage
            lo, hi = 1 - loss.clip_low, 1 + loss.clip_high
            c = min(max(ratio, lo), hi)
            pg = -min(ratio * a, c * a)
            clipped += (a > 0 and ratio > hi) or (a < 0 and ratio < lo)
            w_raw = math.exp(old - s.engine_logprobs[i])
            ws.append(w_raw)
            w = 1.0 if loss.tis_cap is None else min(w_raw, loss.tis_cap)
            keep = 1.0
            if loss.tis_mask and not (loss.tis_mask[0] <= w_raw <= loss.tis_mask[1]):
                keep, masked = 0.0, masked + 1
            total += pg * w * keep
    ess = sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))
    return total / n, clipped, ess, masked


@pytest.mark.parametrize(
    "loss",
    [
        GRPOLoss(),
        GRPOLoss(clip_low=0.1, clip_high=0.1, tis_cap=1.05),
        GRPOLoss(tis_cap=None, tis_mask=(0.5, 1.5)),
        GRPOLoss(tis_cap=3.0, tis_mask=(0.9, 1.1)),
    ],
)
def test_grpo_matches_hand_computation(loss: GRPOLoss) -> None:
    batch, _ = two_sample_batch()
    # trainer moved away from `old` on some tokens: ratios exp(0.3), exp(-0.5), exp(0.1), exp(-0.4)
    shift = {0: [0.0, 0.3, -0.5, 0.1], 1: [0.0, 0.0, -0.4]}
    value, metrics, lp, _ = run(loss, batch, LOGPS, shift=shift)
    expected, clipped, ess, masked = grpo_by_hand(loss, batch, shift)
    assert value.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(clipped / 4)
    assert metrics["is_ess"] == pytest.approx(ess, rel=1e-5)
    assert metrics.get("is_masked_fraction", 0.0) == pytest.approx(masked / 4)
    gap = [abs(LOGPS[0][i] - shift[0][i] - batch.samples[0].engine_logprobs[i]) for i in (1, 2, 3)]
    gap.append(abs(LOGPS[1][2] - shift[1][2] - batch.samples[1].engine_logprobs[2]))
    assert metrics["logprob_gap"] == pytest.approx(sum(gap) / 4, rel=1e-5)
    value.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.abs().sum() > 0


def test_grpo_on_policy_gradient_is_advantage_weighted_nll() -> None:
    # ratio == 1 and no IS: d loss / d logp = -A / n_tokens on every trained token
    batch, _ = two_sample_batch()
    value, metrics, lp, mb = run(GRPOLoss(tis_cap=None), batch, LOGPS)
    value.backward()
    row, start, _ = mb.spans[0]
    assert lp.grad[row, start + 1 : start + 4].tolist() == pytest.approx([-0.25, -0.25, -0.25])
    row, start, _ = mb.spans[1]
    assert lp.grad[row, start + 2].item() == pytest.approx(0.25)
    assert lp.grad[row, start + 1].item() == 0
    assert metrics["clip_fraction"] == 0


def test_grpo_kl_term_and_errors() -> None:
    batch, _ = two_sample_batch()
    (mb,) = batch.micro_batches()
    t = mb.tensors()
    lp = torch.zeros(t["input_ids"].shape)
    ref = torch.full_like(lp, -0.2)
    with pytest.raises(ConfigError, match="reference"):
        micro_batch_loss(GRPOLoss(kl_coef=0.1, tis_cap=None), lp, t, Normaliser.of(batch))
    value, sums = micro_batch_loss(GRPOLoss(kl_coef=0.1, tis_cap=None), lp, t, Normaliser.of(batch), ref_logprobs=ref)
    k3 = math.exp(-0.2) + 0.2 - 1
    # on policy (lp == old) pg = -A per token: (3 * -1 + 1 * 1) / 4 = -0.5
    assert value.item() == pytest.approx(-0.5 + 0.1 * k3, rel=1e-5)
    assert summarize(sums)["kl"] == pytest.approx(k3, rel=1e-5)
    with pytest.raises(ConfigError, match="clip_low"):
        GRPOLoss(clip_low=1.5)
    with pytest.raises(ConfigError, match="engine_logprobs"):
        check_batch(GRPOLoss(), TrainBatch([Sample([1, 2], [0, 1])]))


def test_has_gradient() -> None:
    prompt_only = Sample([1, 2, 3], [0, 0, 0], advantage=1.0)
    zero = Sample([1, 2, 3], [0, 1, 1], advantage=0.0)
    signed = Sample([1, 2, 3], [0, 1, 1], advantage=-0.5)
    assert not has_gradient(GRPOLoss(), TrainBatch([zero, zero, prompt_only]))  # all solved or all failed
    assert has_gradient(GRPOLoss(), TrainBatch([zero, signed]))
    assert has_gradient(GRPOLoss(kl_coef=0.1), TrainBatch([zero]))  # the KL term still pulls
    assert not has_gradient(GRPOLoss(kl_coef=0.1), TrainBatch([prompt_only]))
    assert has_gradient(SFTLoss(), TrainBatch([zero])) and not has_gradient(SFTLoss(), TrainBatch([prompt_only]))
