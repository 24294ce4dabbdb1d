"""`FreshSandboxGrader`: grade only the agent's diff, in a fresh sandbox, and never stop a run.

Wraps a task's grader and delegates `grade` to it (like a Gymnasium `Wrapper`). In "fresh" mode
(the default) it starts a new sandbox from the task (`start_task_sandbox`), downloads the
pristine tree from it and the agent's tree from the sandbox the agent used, compares the bytes
on the host (`tree_diff`: no git of the agent's sandbox is involved), and copies the changed
non-test files into the fresh sandbox, where the wrapped grader runs. No process, file outside
the repository or shell state of the agent carries over. The diff is scanned by the tamper
check (`tamper`: parsed code and parsed runner configuration) first; with
`tamper_policy="zero"` a finding is reward 0. Before anything is copied out, both trees are
measured in their sandboxes (`tree_limits`): an agent's tree beyond the pristine one by more than
`max_diff_files` entries or `max_diff_bytes` bytes is reward 0 with nothing downloaded. Grading
as a whole is bounded by `grading_timeout_s` (`grading_timeout`).

"in_place" mode grades the agent's own sandbox, as the wrapped grader alone would: weaker (the
agent may have changed the interpreter, its shell start-up files or left processes behind), kept
for speed and for task formats with no repository diff. Its diff still passes the tamper check
(a fresh sandbox is started only to read the pristine tree). Graders whose verdict rests on the
whole sandbox (`grades_container_state`, e.g. Harbor's) are always graded in place.

No grading error stops a run: any exception other than an `InfraError` is reward 0 with the
reason `grading_error`. A sandbox lost during grading is graded again in another fresh sandbox
(up to `regrade_attempts` times), then reward 0: the code under test killing its own container
never escapes a zero. The agent's own sandbox gone before its tree is read stays an
infrastructure fault (`SandboxLostError`), unless its backend tells that it ended from inside
(`SandboxLostError.from_inside`): then it is reward 0 with the reason `sandbox_killed_by_agent`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import posixpath
import shlex
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from patchgym.core.errors import AGENT_KILLED_SANDBOX, InfraError, SandboxLostError
from patchgym.core.grading import zero_grade
from patchgym.core.sandbox import Sandbox, SandboxBackend
from patchgym.core.tamper import tamper_findings
from patchgym.core.tasks import Grade, Grader, Task, start_task_sandbox
from patchgym.core.tree_diff import FileChange, TreeTooLarge, remove_tree, tree_changes, tree_paths
from patchgym.core.tree_limits import TreeLimitExceeded, check_tree, measure_tree

GRADING_LABEL = {"role": "grading"}
"""Label of the fresh sandboxes graders start (beside the task's own labels)."""

GradingMode = Literal["fresh", "in_place"]
TamperPolicy = Literal["zero", "flag", "off"]


class _Verdict(Exception):
    """Ends grading early with this grade."""

    def __init__(self, grade: Grade) -> None:
        super().__init__(grade.details.get("reason", ""))
        self.grade = grade


@dataclass(frozen=True)
class FreshSandboxGrader(Grader):
    """Grades `task` with its grader in a fresh sandbox of `backend`; see the module docstring."""

    inner: Grader
    backend: SandboxBackend
    task: Task
    mode: GradingMode = "fresh"
    tamper_policy: TamperPolicy = "zero"
    regrade_attempts: int = 1
    max_diff_bytes: int = 50_000_000
    max_diff_files: int = 10_000
    grading_timeout_s: float = 3600.0

    @property
    def grades_container_state(self) -> bool:  # type: ignore[override]
        return self.inner.grades_container_state

    def is_test_path(self, path: str) -> bool:
        return self.inner.is_test_path(path)

    async def grade(self, sandbox: Sandbox) -> Grade:
        started = time.perf_counter()
        mode = "in_place" if self.mode == "in_place" or self.inner.grades_container_state else "fresh"
        details: dict[str, Any] = {"mode": mode}
        try:
            grading = (
                self._grade_in_place(sandbox, details) if mode == "in_place" else self._grade_fresh(sandbox, details)
            )
            grade = await asyncio.wait_for(grading, self.grading_timeout_s)
        except TimeoutError:
            message = f"grading took longer than grading_timeout_s ({self.grading_timeout_s:g} s)"
            grade = zero_grade("grading_timeout", message=message)
        except _Verdict as verdict:
            grade = verdict.grade
        except SandboxLostError as exc:
            if not exc.from_inside:
                raise
            grade = zero_grade(AGENT_KILLED_SANDBOX, message=str(exc)[:500])  # the agent's sandbox ended itself
        except InfraError:
            raise
        except Exception as exc:  # a grading error is this episode's zero, never a stopped run
            grade = zero_grade("grading_error", message=f"{type(exc).__name__}: {exc}")
        details["total_s"] = round(time.perf_counter() - started, 3)
        return Grade(grade.reward, grade.resolved, grade.tests, {**grade.details, "grading": details})

    def _in_place_grader(self) -> Grader:
        """The inner grader, told this episode's tamper policy where it runs its own checks (Harbor's)."""
        if dataclasses.is_dataclass(self.inner) and any(
            f.name == "tamper_policy" for f in dataclasses.fields(self.inner)
        ):
            return dataclasses.replace(self.inner, tamper_policy=self.tamper_policy)  # type: ignore[type-var]
        return self.inner

    async def _grade_in_place(self, sandbox: Sandbox, details: dict[str, Any]) -> Grade:
        """The wrapped grader on the agent's own sandbox, after the tamper check of its changes
        against a fresh sandbox's pristine tree."""
        if self.tamper_policy != "off" and not self.inner.grades_container_state:
            async with await start_task_sandbox(self.backend, self._grading_task()) as fresh:
                await self._changes(sandbox, fresh, details)
        return await self._in_place_grader().grade(sandbox)

    async def _grade_fresh(self, agent_sandbox: Sandbox, details: dict[str, Any]) -> Grade:
        changes: list[FileChange] | None = None
        for attempt in range(self.regrade_attempts + 1):
            details["attempts"] = attempt + 1
            started = time.perf_counter()
            fresh = await start_task_sandbox(self.backend, self._grading_task())
            details.setdefault("fresh_start_s", round(time.perf_counter() - started, 3))
            async with fresh:
                if changes is None:
                    started = time.perf_counter()
                    changes = await self._changes(agent_sandbox, fresh, details)
                    details["diff_s"] = round(time.perf_counter() - started, 3)
                await self._apply(fresh, changes)
                try:
                    return await self.inner.grade(fresh)
                except SandboxLostError as exc:
                    details.setdefault("lost", []).append(str(exc)[:500])
        return zero_grade(
            "sandbox_lost_during_grading",
            message=f"the grading sandbox was lost {self.regrade_attempts + 1} times: the code under test stops it",
        )

    def _grading_task(self) -> Task:
        labels = {**self.task.sandbox.labels, **GRADING_LABEL}
        return dataclasses.replace(self.task, sandbox=dataclasses.replace(self.task.sandbox, labels=labels))

    async def _changes(self, agent_sandbox: Sandbox, fresh: Sandbox, details: dict[str, Any]) -> list[FileChange]:
        """The agent's non-test changes, after the limits (checked in the sandboxes before the copy,
        and on the copy) and the tamper check."""
        await self._check_tree(agent_sandbox, fresh, details)
        with tempfile.TemporaryDirectory(prefix="patchgym-diff-") as scratch:
            pristine, agent = Path(scratch) / "pristine", Path(scratch) / "agent"
            try:
                downloads = await asyncio.gather(
                    fresh.download_dir(fresh.workdir, pristine),
                    self._download_agent(agent_sandbox, agent),
                    return_exceptions=True,  # both finish before the folder goes
                )
                for outcome in downloads:
                    if isinstance(outcome, BaseException):
                        raise outcome
                compare = partial(tree_changes, max_extra_bytes=self.max_diff_bytes)
                try:
                    changes = await asyncio.to_thread(compare, pristine, agent, self.inner.is_test_path)
                except TreeTooLarge as exc:  # grew after it was measured (a process left running)
                    message = f"{exc} (max_diff_bytes {self.max_diff_bytes})"
                    raise _Verdict(zero_grade("diff_too_large", message=message)) from None
                pristine_paths = await asyncio.to_thread(tree_paths, pristine)
            finally:
                await asyncio.to_thread(remove_tree, Path(scratch))
        size = sum(len(change.new or b"") for change in changes)
        details.update(diff_files=len(changes), diff_bytes=size)
        if size > self.max_diff_bytes:
            raise _Verdict(
                zero_grade("diff_too_large", message=f"{size} bytes changed (max_diff_bytes {self.max_diff_bytes})")
            )
        if len(changes) > self.max_diff_files:
            message = f"{len(changes)} files changed (max_diff_files {self.max_diff_files})"
            raise _Verdict(zero_grade("too_many_files", message=message))
        if self.tamper_policy != "off":
            findings = [finding.as_dict() for finding in tamper_findings(changes, pristine=pristine_paths)]
            details["tamper"] = findings
            if findings and self.tamper_policy == "zero":
                raise _Verdict(zero_grade("tamper_suspected", {"tamper": findings}, message=findings[0]["what"]))
        return changes

    async def _check_tree(self, agent_sandbox: Sandbox, fresh: Sandbox, details: dict[str, Any]) -> None:
        """Measure both trees where they lie (`tree_limits`); a tree beyond the limits is reward 0
        before anything is copied out."""
        started = time.perf_counter()
        try:
            agent, pristine = await asyncio.gather(
                measure_tree(agent_sandbox, timeout_s=self.grading_timeout_s),
                measure_tree(fresh, timeout_s=self.grading_timeout_s),
            )
            details["measure_s"] = round(time.perf_counter() - started, 3)
            if agent is not None:
                details.update(tree_entries=agent.entries, tree_bytes=agent.bytes)
            check_tree(agent, pristine, max_files=self.max_diff_files, max_bytes=self.max_diff_bytes)
        except TreeLimitExceeded as exc:
            raise _Verdict(zero_grade(exc.reason, message=str(exc))) from None

    async def _download_agent(self, agent_sandbox: Sandbox, folder: Path) -> None:
        try:
            await agent_sandbox.download_dir(agent_sandbox.workdir, folder)
        except InfraError:
            raise
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"[:500]
            raise _Verdict(zero_grade("agent_tree_unreadable", message=message)) from None

    @staticmethod
    async def _apply(fresh: Sandbox, changes: list[FileChange]) -> None:
        """Delete what the agent deleted (and paths that changed kind), then write the files
        (`write_files`: one archive on Docker, holding files only, so no directory's owner or mode
        changes), then make links and set executable bits."""
        doomed = [change.path for change in changes if change.deleted or change.old is None or change.new_link]
        if doomed:
            await _run(fresh, f"rm -rf -- {_quoted(doomed)}")
        await fresh.write_files({change.path: change.new for change in changes if change.new is not None})
        script = [
            f"mkdir -p -- {shlex.quote(posixpath.dirname(c.path) or '.')} "
            f"&& ln -s -- {shlex.quote(c.new_link)} {shlex.quote(c.path)}"
            for c in changes
            if c.new_link is not None
        ]
        executables = [change.path for change in changes if change.new is not None and change.executable]
        script += [f"chmod +x -- {_quoted(executables)}"] if executables else []
        if script:
            await _run(fresh, " && ".join(script))


async def _run(sandbox: Sandbox, command: str) -> None:
    done = await sandbox.exec(command, timeout_s=120)
    if not done.ok:
        raise RuntimeError(f"cannot apply the agent's changes: {done.output[-500:]}")


def _quoted(paths: list[str]) -> str:
    return " ".join(shlex.quote(path) for path in paths)
