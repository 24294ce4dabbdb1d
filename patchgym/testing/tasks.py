"""Checks for task-set authors: is every task well formed, and does grading tell right from wrong?

    problems = task_set_problems(task_set)                      # no sandbox needed
    await assert_task_set_valid(task_set, backend, limit=20)    # gold patch -> 1, empty patch -> 0

`assert_task_set_valid` is what `patchgym tasks validate` checks, as one assertion that lists
every problem of every task; it is meant for a plugin's own tests.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from patchgym.core.sandbox import SandboxBackend, SandboxSpec
from patchgym.core.tasks import Grader, Task, TaskSet
from patchgym.core.validation import TaskValidation, validate_task

__all__ = ["assert_task_set_valid", "task_problems", "task_set_problems", "validate_task_set"]


def task_problems(task: Task) -> list[str]:
    """What is wrong with one task's declaration (nothing is run; a missing gold patch is validation's)."""
    problems = []
    if not isinstance(task.id, str) or not task.id.strip():
        problems.append(f"id {task.id!r} is not a non-empty string")
    if not task.instruction.strip():
        problems.append("the instruction (the issue text the agent reads) is empty")
    if not isinstance(task.sandbox, SandboxSpec):
        problems.append(f"sandbox is a {type(task.sandbox).__name__}, not a SandboxSpec")
    elif task.sandbox.workspace is None and task.sandbox.image is None and task.sandbox.dockerfile is None:
        problems.append("the sandbox spec names no workspace, image or dockerfile")
    if not isinstance(task.grader, Grader):
        problems.append(f"grader is a {type(task.grader).__name__}, not a patchgym.core.tasks.Grader")
    return [f"task {task.id!r}: {p}" for p in problems]


def task_set_problems(task_set: TaskSet) -> list[str]:
    """What is wrong with a task set's declaration: its name, its tasks, duplicate ids, `len()`."""
    problems = []
    if not isinstance(getattr(task_set, "name", None), str) or not task_set.name:
        problems.append("the task set has no `name` (a non-empty string)")
    tasks = list(task_set)
    if not tasks:
        problems.append("the task set yields no tasks")
    if len(task_set) != len(tasks):
        problems.append(f"len() says {len(task_set)} but iterating yields {len(tasks)} tasks")
    problems += [f"task id {i!r} is used {n} times" for i, n in Counter(t.id for t in tasks).items() if n > 1]
    for task in tasks:
        problems += task_problems(task)
    return problems


async def validate_task_set(
    task_set: TaskSet, backend: SandboxBackend, *, limit: int | None = None, concurrency: int = 4
) -> list[TaskValidation]:
    """Grade each task's gold patch (must earn 1) and empty patch (must earn 0) on `backend`."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> TaskValidation:
        async with gate:
            return await validate_task(backend, task)

    return list(await asyncio.gather(*(one(task) for task in list(task_set)[:limit])))


async def assert_task_set_valid(
    task_set: TaskSet, backend: SandboxBackend, *, limit: int | None = None, concurrency: int = 4
) -> list[TaskValidation]:
    """`task_set_problems` and `validate_task_set` as one assertion naming every problem."""
    problems = task_set_problems(task_set)
    results = await validate_task_set(task_set, backend, limit=limit, concurrency=concurrency)
    problems += [f"task {r.task_id!r}: {p}" for r in results for p in r.problems]
    if problems:
        raise AssertionError(f"task set {task_set.name!r} is not valid:\n" + "\n".join(f"- {p}" for p in problems))
    return results
