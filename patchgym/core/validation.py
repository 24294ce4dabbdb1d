"""Task validation: the gold patch (or oracle) must earn reward 1 and the empty patch reward 0,
each graded as training grades it (`FreshSandboxGrader`: a fresh sandbox, the tamper check)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from patchgym.core.errors import InfraError
from patchgym.core.fresh_grading import FreshSandboxGrader
from patchgym.core.sandbox import ExecResult, Sandbox, SandboxBackend
from patchgym.core.tasks import Grade, Task, start_task_sandbox

PATCH_DELIMITER = "PATCHGYM_PATCH_EOF"


def apply_patch_command(patch: str) -> str:
    """A bash command that applies `patch` in the current directory (git apply, else patch -p1)."""
    if PATCH_DELIMITER in patch:
        raise ValueError(f"a patch may not contain the line {PATCH_DELIMITER}")
    body = patch if patch.endswith("\n") else patch + "\n"
    return (
        f"patch_file=$(mktemp) && cat > \"$patch_file\" <<'{PATCH_DELIMITER}'\n{body}{PATCH_DELIMITER}\n"
        'git apply --verbose "$patch_file" 2>/dev/null || patch -p1 --forward --batch < "$patch_file"'
    )


async def apply_patch(sandbox: Sandbox, patch: str, *, timeout_s: float = 120.0) -> ExecResult:
    """Apply a unified diff in the sandbox's workdir."""
    return await sandbox.exec(apply_patch_command(patch), timeout_s=timeout_s)


def oracle_command(task: Task) -> str:
    """The bash command an oracle agent runs: the task's oracle script, else applying its gold patch."""
    if task.oracle:
        return task.oracle.strip()
    if task.gold_patch:
        return apply_patch_command(task.gold_patch)
    raise ValueError(f"task {task.id!r} has neither an oracle nor a gold patch")


def oracle_turns(task: Task) -> list[str]:
    """The oracle agent's commands, one per turn: the task's `oracle_turns`, else its one oracle command."""
    return list(task.oracle_turns) or [oracle_command(task)]


@dataclass
class TaskValidation:
    """Whether a task behaves: gold patch → reward 1, empty patch → reward 0."""

    task_id: str
    gold: Grade | None = None
    empty: Grade | None = None
    problems: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def valid(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "valid": self.valid,
            "gold_reward": None if self.gold is None else self.gold.reward,
            "empty_reward": None if self.empty is None else self.empty.reward,
            "problems": self.problems,
            "duration_s": round(self.duration_s, 3),
        }


async def _grade_with(backend: SandboxBackend, task: Task, gold: bool) -> Grade:
    async with await start_task_sandbox(backend, task) as sandbox:
        if gold and task.gold_patch:
            applied = await apply_patch(sandbox, task.gold_patch)
            if not applied.ok:
                raise ValueError(f"gold patch does not apply: {applied.output.strip()[-1000:]}")
        if gold and task.oracle:
            ran = await sandbox.exec(task.oracle, timeout_s=task.oracle_timeout_s)
            if not ran.ok:
                state = "timed out" if ran.timed_out else f"exit {ran.exit_code}"
                raise ValueError(f"oracle failed ({state}): {ran.output.strip()[-1000:]}")
        # graded as training grades it: a fresh sandbox and the tamper check (gold must pass both)
        return await FreshSandboxGrader(task.grader, backend, task).grade(sandbox)


async def validate_task(backend: SandboxBackend, task: Task) -> TaskValidation:
    """Grade the gold patch and the empty patch, each in a fresh sandbox, concurrently."""
    started = time.perf_counter()
    report = TaskValidation(task.id)
    has_gold = bool(task.gold_patch or task.oracle)
    if not has_gold:
        report.problems.append("task has no gold patch or oracle: nothing shows it can be solved")
    outcomes = await asyncio.gather(
        _grade_with(backend, task, True) if has_gold else asyncio.sleep(0),
        _grade_with(backend, task, False),
        return_exceptions=True,
    )
    for label, outcome, want in (("gold", outcomes[0], 1.0), ("empty", outcomes[1], 0.0)):
        if isinstance(outcome, InfraError):
            report.problems.append(f"{label} patch: infrastructure error ({outcome.kind}): {outcome}")
        elif isinstance(outcome, BaseException):
            report.problems.append(f"{label} patch: {outcome}")
        elif isinstance(outcome, Grade):
            setattr(report, label, outcome)
            if outcome.reward != want:
                reason = outcome.details.get("reason", "")
                report.problems.append(f"{label} patch got reward {outcome.reward}, expected {want} ({reason})")
    report.duration_s = time.perf_counter() - started
    return report
