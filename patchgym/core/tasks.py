"""The task contract: what the agent must fix and how its work is graded."""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from patchgym.core.errors import ConfigError, SandboxStartError
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec

AGENT_USER = "65534:65534"
"""The unprivileged user (nobody:nogroup) agents of the built-in task sets run as in containers."""

DEFAULT_LIMITS: Mapping[str, float] = {"cpus": 2.0, "memory_mb": 4096, "pids": 1024}
"""Resource limits of every built-in task set's sandboxes; a task may set its own (higher or lower)."""


def sandbox_limits(cpus: float | None = None, memory_mb: int | None = None, pids: int | None = None) -> dict[str, Any]:
    """`SandboxSpec` limit arguments: the given values, `DEFAULT_LIMITS` for those not given."""
    return {
        "cpus": cpus or DEFAULT_LIMITS["cpus"],
        "memory_mb": int(memory_mb or DEFAULT_LIMITS["memory_mb"]),
        "pids": int(pids or DEFAULT_LIMITS["pids"]),
    }


class TestStatus(enum.StrEnum):
    """The outcome of one test, in SWE-bench's vocabulary."""

    __test__ = False  # not a pytest test class

    PASSED = "PASSED"
    FAILED = "FAILED"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"
    XFAIL = "XFAIL"

    @property
    def passing(self) -> bool:
        """PASSED and XFAIL count as passing, as in SWE-bench."""
        return self in (TestStatus.PASSED, TestStatus.XFAIL)


@dataclass(frozen=True)
class Grade:
    """The verdict on a sandbox's final state. `reward` is 1.0 iff `resolved`."""

    reward: float
    resolved: bool
    tests: Mapping[str, TestStatus] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "resolved": self.resolved,
            "tests": {name: str(status) for name, status in self.tests.items()},
            "details": dict(self.details),
        }


class Grader(abc.ABC):
    """Grades a sandbox after an episode. Raises `InfraError` only for infrastructure faults.

    `grades_container_state` is True for graders whose verdict rests on the whole sandbox (a
    Harbor verifier), not on the repository: they cannot be re-graded from the agent's diff.
    """

    grades_container_state: bool = False

    @abc.abstractmethod
    async def grade(self, sandbox: Sandbox) -> Grade: ...

    def is_test_path(self, path: str) -> bool:
        """Whether `path` (relative to the workdir) is a test or test-configuration file: the
        agent's changes to such files are never carried into a fresh grading sandbox."""
        return False


@dataclass(frozen=True)
class Task:
    """One problem: an issue to fix in a sandboxed repository.

    `setup_commands` run once after the sandbox starts (their failure is an infrastructure
    fault: the task, not the agent, is broken). `gold_patch` is a reference fix used to
    validate the task; `oracle` is a bash script that brings the sandbox to a reference
    solution, for task formats whose solution is a program rather than a diff (validation runs
    the gold patch, then the oracle). `oracle_turns`, when a solution takes several turns, is
    that script as an agent's commands, one per turn (oracle replays send them one by one).
    """

    id: str
    instruction: str
    sandbox: SandboxSpec
    grader: Grader
    setup_commands: tuple[str, ...] = ()
    setup_timeout_s: float = 300.0
    gold_patch: str | None = None
    oracle: str | None = None
    oracle_turns: tuple[str, ...] = ()
    oracle_timeout_s: float = 600.0
    metadata: Mapping[str, Any] = field(default_factory=dict)


class TaskSet(abc.ABC):
    """A named, ordered collection of tasks."""

    name: str

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Task]: ...

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def ids(self) -> list[str]:
        return [task.id for task in self]

    def get(self, task_id: str) -> Task:
        """The task with this id; an unknown id is a `ConfigError` listing the known ones."""
        for task in self:
            if task.id == task_id:
                return task
        known = ", ".join(self.ids()) or "(none)"
        raise ConfigError(f"task set {self.name!r} has no task {task_id!r}; known tasks: {known}")


class LoadedTaskSet(TaskSet):
    """A task set read once, on first use: subclasses implement `load()`."""

    @abc.abstractmethod
    def load(self) -> list[Task]:
        """Read every task (called once)."""

    @cached_property
    def _tasks(self) -> list[Task]:
        return self.load()

    def __iter__(self) -> Iterator[Task]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)


async def start_task_sandbox(backend: SandboxBackend, task: Task) -> Sandbox:
    """A started sandbox for `task` with its setup commands run.

    A failing setup command is an infrastructure fault (the task is broken, not the agent):
    the sandbox is closed and `SandboxStartError` raised.
    """
    sandbox = await backend.create(task.sandbox)
    try:
        for command in task.setup_commands:
            result = await sandbox.exec(command, timeout_s=task.setup_timeout_s)
            if not result.ok:
                raise SandboxStartError(
                    f"setup command of task {task.id!r} failed (exit {result.exit_code}): {command!r}\n"
                    f"{result.output[-2000:]}",
                    retryable=False,
                )
    except BaseException:
        await sandbox.close()
        raise
    return sandbox
