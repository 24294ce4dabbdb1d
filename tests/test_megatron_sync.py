"""The Megatron trainer's streamed weight sync, run for real on CPU: four ranks as TP2/DP2 with EP4
(the expert-parallel group spans both data-parallel replicas, as the reference's TP4/EP8/DP2 does)
send the tiny Qwen3-MoE to a receiving engine process through `WeightSync`, twice.

What the engine holds after each sync must equal, bit for bit, the HF weights of that moment (the
initial checkpoint, then the trainer's export after a GRPO step); the second sync reuses the group
the first formed; the sender's extra memory stays within three buckets. Before every rank joined
the sync's gathers, the ranks of the second replica skipped the expert all-gather the first
replica's ranks waited in: the first sync hung until the collective timeout (here the worker's
`COLLECTIVE_TIMEOUT_S`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from tests.tiny_models import tiny_qwen3, tiny_qwen3_moe  # noqa: E402
from tests.torchrun_launch import torchrun_json  # noqa: E402

pytestmark = pytest.mark.timeout(1200)  # one torchrun launch of four ranks on a busy machine

WORKER = Path(__file__).with_name("megatron_sync_worker.py")


def test_staged_sync_with_experts_across_data_parallel_replicas_equals_the_hf_weights(tmp_path: Path) -> None:
    model = tiny_qwen3_moe(tmp_path / "model")
    # a quarter of the model: the largest unit of this model, one expert weight from all 4 EP ranks, fits
    result = sync_twice(model, tmp_path / "out", 4, tp=2, ep=4, fraction=1 / 4)
    layout = {k: result["settings"][k] for k in ("tp", "ep", "etp", "dp", "world_size")}
    assert layout == {"tp": 2, "ep": 4, "etp": 1, "dp": 2, "world_size": 4}
    layer = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert not torch.equal(result["v1"][layer], result["v2"][layer])


def test_staged_sync_of_two_pipeline_stages_with_tied_embeddings(tmp_path: Path) -> None:
    """Two groups, one per stage, both reused; the last stage's copy of the tied embedding is not sent."""
    model = tiny_qwen3(tmp_path / "model", tie=True)
    result = sync_twice(model, tmp_path / "out", 2, pp=2, fraction=1 / 8)
    assert result["settings"]["pp"] == 2
    one, two, _ = result["reports"]
    assert one["groups"] == two["groups"] == 2 and len(one["senders"]) == 2


def sync_twice(model: Path, out: Path, nproc: int, *, tp: int = 1, ep: int = 1, pp: int = 1, fraction: float) -> dict:
    """Two syncs (a GRPO step between them) into a receiving engine: each must hold the HF weights of its
    moment, bit for bit, the second reusing the first's groups; the sender within three buckets."""
    from safetensors.torch import load_file

    initial = load_file(model / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    bucket = int(model_bytes * fraction)
    result = torchrun_json(WORKER, out, nproc, model, out, tp, ep, 1, bucket, pp)
    assert result["settings"]["sync_bucket_bytes"] == bucket

    first, second = load_file(out / "v1.safetensors"), load_file(out / "v2.safetensors")
    exported = load_file(out / "hf" / "model.safetensors")
    assert set(first) == set(second) == set(exported) == set(initial)
    assert [k for k in initial if not torch.equal(first[k], initial[k])] == []
    assert [k for k in exported if not torch.equal(second[k], exported[k])] == []
    assert sum(not torch.equal(first[k], second[k]) for k in first) > len(first) // 2  # the step moved them

    one, two, engine = result["reports"]
    assert one["groups_formed"] and not two["groups_formed"] and engine["joins"] == len(one["senders"])
    assert one["masters"] == two["masters"]
    for report in (one, two):
        assert report["bytes"] == model_bytes and report["bucket_bytes"] == bucket
        assert sum(sender["bytes"] for sender in report["senders"]) == model_bytes
        assert sum(sender["buckets"] for sender in report["senders"]) >= 1 / fraction
        for sender in report["senders"]:
            assert 0 < sender["bucket_bytes"] <= bucket
            assert sender["sender_extra_peak_bytes"] <= 3 * bucket, sender
    return {**result, "v1": first, "v2": second}
