"""`WeightSync`'s staged groups: formed once and reused, formed anew (a new name) when the engines'
ranks change or after a failed sync; ports come from the trainer's stage leaders, which bind them;
the bucket is the smaller of the trainer's `sync_bucket_bytes` and the engine's `weight_bucket_bytes`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from patchgym.launch.sync import WeightSync

pytest.importorskip("torch")


class Trainer:
    """A two-stage trainer's sync side: its stage leaders bind ports 7000 + n in order of asking."""

    def __init__(self, sync_bucket_bytes: int = 64) -> None:
        self.sync_bucket_bytes = sync_bucket_bytes
        self.opened: list[list[dict[str, Any]]] = []
        self.sent: list[tuple[list[str], list[list[list[str]]]]] = []

    def settings(self) -> dict[str, Any]:
        return {"device": "cpu", "sync_bucket_bytes": self.sync_bucket_bytes}

    async def weight_stages(self) -> list[list[tuple[str, str, list[int]]]]:
        return [[("a", "float32", [8]), ("b", "float32", [8])], [("c", "float32", [16])]]

    async def open_weight_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert all(g["master_port"] == 0 for g in groups)  # the leaders pick and hold the ports
        self.opened.append(groups)
        return [{**g, "master_port": 7000 + len(self.opened) * 10 + s} for s, g in enumerate(groups)]

    async def broadcast_weights(self, groups: list[dict[str, Any]], buckets: list[list[list[str]]]) -> list[dict]:
        self.sent.append(([g["group_name"] for g in groups], buckets))
        return [{"stage": s, "sender_extra_peak_bytes": 1} for s in range(len(groups))]


class Engine:
    out_of_process = True

    def __init__(self) -> None:
        self.ranks = [1, 1]
        self.weight_bucket_bytes = 1 << 20
        self.fail_next = False
        self.received: list[Any] = []

    async def engine_ranks(self) -> list[int]:
        return self.ranks

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, weights: Any, *, version: int) -> None:
        await weights.send()
        self.received.append(weights)
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("the engine went away")


async def test_groups_are_reused_until_the_engines_change_or_a_sync_fails(tmp_path: Path) -> None:
    trainer, engine = Trainer(), Engine()
    sync = WeightSync(trainer, engine, mode="distributed", run_dir=tmp_path)
    first, second = await sync(1), await sync(2)
    assert first.groups_formed and not second.groups_formed and len(trainer.opened) == 1
    assert first.masters == second.masters == ["127.0.0.1:7010", "127.0.0.1:7011"]
    assert trainer.sent[0][0] == trainer.sent[1][0] == ["patchgym_weights_g1_stage0", "patchgym_weights_g1_stage1"]
    assert all(g["world_size"] == 3 for g in trainer.opened[0])
    assert first.bucket_bytes == 64 and trainer.sent[0][1] == [[["a", "b"]], [["c"]]]
    assert first.senders == [{"stage": 0, "sender_extra_peak_bytes": 1}, {"stage": 1, "sender_extra_peak_bytes": 1}]

    engine.ranks = [1, 1, 2]  # an engine more: a new group, under a new name
    third = await sync(3)
    assert third.groups_formed and third.masters == ["127.0.0.1:7020", "127.0.0.1:7021"]
    assert trainer.sent[-1][0] == ["patchgym_weights_g2_stage0", "patchgym_weights_g2_stage1"]
    assert all(g["world_size"] == 5 for g in trainer.opened[1])

    engine.fail_next = True
    with pytest.raises(ConnectionError):
        await sync(4)
    fifth = await sync(5)
    assert fifth.groups_formed and trainer.sent[-1][0][0] == "patchgym_weights_g3_stage0"


async def test_the_bucket_is_the_smaller_of_the_trainers_and_the_engines(tmp_path: Path) -> None:
    trainer, engine = Trainer(sync_bucket_bytes=1 << 30), Engine()
    engine.weight_bucket_bytes = 32
    report = await WeightSync(trainer, engine, mode="distributed", run_dir=tmp_path)(1)
    assert report.bucket_bytes == 32 and trainer.sent[0][1] == [[["a"], ["b"]], [["c"]]]
