"""The generated `easy` task family used by the quickstart."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.errors import ConfigError
from patchgym.core.tasks import start_task_sandbox
from patchgym.core.validation import oracle_command, validate_task
from patchgym.plugins.easy import easy_task_set


def test_tasks_are_valid_and_the_one_line_solution_solves_them(tmp_path: Path) -> None:
    tasks = list(easy_task_set(12, 0, "eval", str(tmp_path)))
    backend = LocalSandboxBackend()

    async def solved_by_solution(task) -> float:  # type: ignore[no-untyped-def]
        async with await start_task_sandbox(backend, task) as sandbox:
            assert task.oracle and task.oracle.startswith("sed -i")
            ran = await sandbox.exec(oracle_command(task), timeout_s=30)
            assert ran.ok, ran.output
            return (await task.grader.grade(sandbox)).reward

    async def main() -> None:
        validations = await asyncio.gather(*(validate_task(backend, t) for t in tasks))
        assert all(v.valid for v in validations), [v.problems for v in validations if not v.valid]
        assert await asyncio.gather(*(solved_by_solution(t) for t in tasks)) == [1.0] * len(tasks)
        await backend.aclose()

    asyncio.run(main())


def test_issue_text_spells_out_the_fix(tmp_path: Path) -> None:
    for task in easy_task_set(8, 5, "train", str(tmp_path)):
        bad, good = re.findall(r"`([^`]*)`", task.instruction)[-2:]
        assert f"-    return {bad}\n" in (task.gold_patch or "")
        assert f"+    return {good}\n" in (task.gold_patch or "")


def test_bad_options_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="split must be one of train, eval"):
        easy_task_set(split="test", cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="count must be >= 1"):
        easy_task_set(count=0, cache_dir=str(tmp_path))
