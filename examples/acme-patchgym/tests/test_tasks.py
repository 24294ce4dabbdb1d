"""The acme-ledger task set: well formed, gold patch -> 1 and empty patch -> 0, and a grader that
judges only the written total."""

from __future__ import annotations

from pathlib import Path

import pytest
from patchgym.core.errors import ConfigError
from patchgym.core.plugins import registry
from patchgym.core.tasks import start_task_sandbox
from patchgym.testing.tasks import assert_task_set_valid, task_set_problems

from acme_patchgym.tasks import LedgerTaskSet

pytestmark = pytest.mark.asyncio


async def test_task_set_is_valid(tmp_path: Path) -> None:
    backend = registry().create("sandbox", "local", root_dir=str(tmp_path))
    try:
        results = await assert_task_set_valid(LedgerTaskSet(count=4, seed=3), backend)
    finally:
        await backend.aclose()
    assert [r.gold.reward for r in results if r.gold] == [1.0] * 4


async def test_generation_is_deterministic_and_options_are_checked() -> None:
    assert task_set_problems(LedgerTaskSet(count=3)) == []
    one, two = LedgerTaskSet(count=3, seed=5), LedgerTaskSet(count=3, seed=5)
    assert [t.setup_commands for t in one] == [t.setup_commands for t in two]
    assert [t.setup_commands for t in one] != [t.setup_commands for t in LedgerTaskSet(count=3, seed=6)]
    with pytest.raises(ConfigError, match="count >= 1"):
        LedgerTaskSet(count=0)


async def test_grader_judges_the_total_not_the_invoices(tmp_path: Path) -> None:
    task = LedgerTaskSet(count=1, lines=3, seed=1).get("acme-ledger-1-000")
    backend = registry().create("sandbox", "local", root_dir=str(tmp_path))
    try:
        async with await start_task_sandbox(backend, task) as box:
            missing = await task.grader.grade(box)
            assert missing.reward == 0.0 and "missing" in missing.details["reason"]
            await box.exec("awk '{s += $2} END {print s}' invoices.txt > total.txt", timeout_s=30)
            right = await task.grader.grade(box)
            assert right.reward == 1.0 and right.resolved and right.tests == {"total": "PASSED"}
            # Rewriting the invoices to match a made-up total earns nothing: the grader knows the total.
            await box.exec("printf 'anvil 1\\n' > invoices.txt && echo 1 > total.txt", timeout_s=30)
            forged = await task.grader.grade(box)
            assert forged.reward == 0.0 and not forged.resolved
    finally:
        await backend.aclose()
