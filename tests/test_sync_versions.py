"""The version check after a weight sync, across several engines: every engine must report the
version just sent; one lagging engine is an error naming every engine's version."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from patchgym.backends.trainer.common import TrainerWeights
from patchgym.launch.sync import WeightSync, WeightSyncError


class Trainer:
    async def weights(self, export_to: Path | None = None) -> TrainerWeights:
        return TrainerWeights(version=0, state_dict={"w": torch.ones(2)})


class Engines:
    """Several engines behind one client; `lag` engines keep the version they had."""

    def __init__(self, count: int, lag: set[int]) -> None:
        self.held = [0] * count
        self.lag = lag
        self.calls: list[str] = []

    async def pause(self) -> None:
        self.calls.append("pause")

    async def resume(self) -> None:
        self.calls.append("resume")

    async def update_weights(self, weights: Any, *, version: int) -> None:
        self.held = [held if i in self.lag else version for i, held in enumerate(self.held)]

    async def weight_versions(self) -> list[int]:
        return list(self.held)


@pytest.mark.parametrize("lagging", [{0}, {2}, {1, 2}])
async def test_any_engine_that_does_not_hold_the_sent_version_fails_the_sync(tmp_path: Path, lagging: set[int]) -> None:
    engines = Engines(3, lagging)
    sync = WeightSync(Trainer(), engines, mode="tensor", run_dir=tmp_path)
    expected = str([0 if i in lagging else 4 for i in range(3)])
    with pytest.raises(
        WeightSyncError, match=re.escape(f"after sending version 4 the engines report versions {expected}")
    ):
        await sync(4)
    assert engines.calls == ["pause", "resume"]  # generation goes on either way


async def test_engines_that_all_hold_the_version_pass_and_are_reported(tmp_path: Path) -> None:
    report = await WeightSync(Trainer(), Engines(3, set()), mode="tensor", run_dir=tmp_path)(4)
    assert (report.version, report.engine_versions, report.mode) == (4, [4, 4, 4], "tensor")
