"""Grading by running a task's tests inside the sandbox, hardened against reward hacking.

`ShellGrader` is the base of graders that run commands in the sandbox: its public `grade`
times the work, turns a `GradeFailure` (or a sandbox too broken to grade) into reward 0 with
the reason, and builds the `Grade`; subclasses implement `_grade`. Commands run in the clean
shell of `patchgym.core.grading_shell` (no profile, rc file or inherited variable; the
interpreter by absolute path).

`TestCommandGrader` first restores the task's test files from bytes it holds (an edited or
deleted test file comes back, an added one goes away) and removes every `conftest.py` and
`pytest.ini` the task did not ship. The test command writes a JUnit XML report into the
grader's own directory, so lines printed by the code under test cannot forge a result; the
report must be a regular file of bounded size and must agree with the command's exit code.
An expected failure counts only when the runner's own result type says so. Resolved = every
FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes (SWE-bench's rule).

What this does not defend against on its own: an agent that changed the interpreter, the test
runner or left processes behind in the sandbox it used. `FreshSandboxGrader`
(patchgym.core.fresh_grading) grades only the agent's diff in a fresh sandbox, and its tamper
check flags code under test that patches the runner in-process.
"""

from __future__ import annotations

import abc
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from patchgym.core.grading_shell import GradingRoom, GradingSetupError
from patchgym.core.sandbox import ExecResult, Sandbox
from patchgym.core.tasks import Grade, Grader, TestStatus
from patchgym.core.test_reports import LOG_PARSERS, ReportError, parse_junit_xml
from patchgym.core.verdict.session import recorder_mode, supervised_run

UNITTEST_RUNNER = Path(__file__).with_name("unittest_junit.py")
"""Standalone script that runs a unittest suite and writes JUnit XML (see its docstring)."""
UNITTEST_RUNNER_SOURCE = UNITTEST_RUNNER.read_bytes()
"""Its bytes, read once at import: every grading copies these, so a command that rewrites
patchgym's files (possible on `isolation="none"`) cannot change what later gradings run."""

UNITTEST_COMMAND = "{python} -s -E {runner} --report {report} --start tests --top ."
"""Test command for plain-unittest projects whose tests live in `tests/` (`{python}`: the
sandbox's python3 by absolute path)."""

PROTECTED_FILE_NAMES = ("conftest.py", "pytest.ini")
"""Files that change how tests run: any the task did not ship are deleted before grading."""


def _listing(names: Sequence[str], limit: int = 20) -> list[str]:
    return list(names[:limit]) + ([f"... and {len(names) - limit} more"] if len(names) > limit else [])


def resolve(
    tests: Mapping[str, TestStatus], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]
) -> tuple[bool, dict[str, Any]]:
    """SWE-bench's rule: resolved iff every F2P and every P2P test passes (missing = failing)."""
    summary: dict[str, Any] = {}
    resolved = True
    for label, names in (("fail_to_pass", fail_to_pass), ("pass_to_pass", pass_to_pass)):
        failing = [name for name in names if not (name in tests and tests[name].passing)]
        missing = [name for name in failing if name not in tests]
        resolved = resolved and not failing
        summary[label] = {
            "passed": len(names) - len(failing),
            "total": len(names),
            "failing": _listing(failing),
            "missing": _listing(missing),
        }
    return resolved, summary


def zero_grade(
    reason: str,
    details: Mapping[str, Any] | None = None,
    *,
    message: str = "",
    tests: Mapping[str, TestStatus] | None = None,
) -> Grade:
    """Reward 0 with `reason` (and `message`, when it says more) in the details."""
    merged = {**(details or {}), "reason": reason}
    if message:
        merged["message"] = message
    return Grade(reward=0.0, resolved=False, tests=dict(tests or {}), details=merged)


class GradeFailure(Exception):
    """Raised inside `ShellGrader._grade`: the verdict is reward 0 for `reason`."""

    def __init__(self, reason: str, message: str = "", tests: Mapping[str, TestStatus] | None = None) -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message
        self.tests = dict(tests or {})


class ShellGrader(Grader):
    """Base of graders that run commands in the sandbox; subclasses implement `_grade`.

    `grade` times the work and builds the `Grade` (with `grade_duration_s`); a `GradeFailure`,
    or a sandbox where no grading directory can be made, is reward 0 with its reason. Faults
    of the infrastructure still raise `InfraError` from the sandbox.
    """

    async def grade(self, sandbox: Sandbox) -> Grade:
        started = time.perf_counter()
        details: dict[str, Any] = {}
        try:
            reward, tests = await self._grade(sandbox, details)
        except GradingSetupError as exc:
            grade = zero_grade("grading_setup_failed", {**details, "log_tail": exc.output[-2000:]}, message=str(exc))
        except GradeFailure as failure:
            grade = zero_grade(failure.reason, details, message=failure.message, tests=failure.tests)
        else:
            details.setdefault("reason", "resolved" if reward >= 1.0 else "tests_failed")
            grade = Grade(reward=reward, resolved=reward >= 1.0, tests=dict(tests), details=details)
        return Grade(
            grade.reward,
            grade.resolved,
            grade.tests,
            {**grade.details, "grade_duration_s": round(time.perf_counter() - started, 3)},
        )

    @abc.abstractmethod
    async def _grade(self, sandbox: Sandbox, details: dict[str, Any]) -> tuple[float, Mapping[str, TestStatus]]:
        """(reward, test statuses); record what the verdict rests on in `details`."""


@dataclass(frozen=True)
class TestCommandGrader(ShellGrader):
    """Runs `test_command` in the sandbox and applies `resolve` to its results.

    `test_command` may use `{report}` (where the JUnit XML must be written), `{runner}` (the
    bundled unittest runner) and `{python}` (the interpreter, by absolute path). `test_paths`
    are reset to `original_files`, which must also hold every file named in
    `PROTECTED_FILE_NAMES` that the task ships. With `report_format` "pytest" or "unittest" the
    command's log is parsed instead (weaker: printed lines can forge it). `max_report_bytes`
    bounds the JUnit report.

    With `verdict_channel` (the default) a command that can host the grader's recorder (the
    bundled unittest runner, or pytest) runs under the supervisor of `patchgym.core.verdict`:
    the statuses come from the records, the exit code and the report are not read, and
    `canaries` adds a must-fail and a must-pass test beside the task's. Other commands keep the
    report (or log) path.
    """

    __test__ = False  # not a pytest test class

    test_command: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    test_paths: tuple[str, ...] = ()
    original_files: Mapping[str, bytes] = field(default_factory=dict)
    report_format: Literal["junit", "pytest", "unittest"] = "junit"
    timeout_s: float = 600.0
    max_log_bytes: int = 2_000_000
    max_report_bytes: int = 20_000_000
    allowed_exit_codes: tuple[int, ...] = (0, 1)
    verdict_channel: bool = True
    canaries: bool = True

    def is_test_path(self, path: str) -> bool:
        parts = PurePosixPath(path).parts
        under = any(parts[: len(PurePosixPath(p).parts)] == PurePosixPath(p).parts for p in self.test_paths)
        return under or (bool(parts) and parts[-1] in PROTECTED_FILE_NAMES)

    async def _grade(self, sandbox: Sandbox, details: dict[str, Any]) -> tuple[float, Mapping[str, TestStatus]]:
        room = await GradingRoom.open(sandbox)
        await self._restore(room)
        mode = recorder_mode(self.test_command) if self.verdict_channel else "plain"
        if mode != "plain":
            return await self._grade_supervised(room, mode, details)
        runner = (
            await room.write(UNITTEST_RUNNER.name, UNITTEST_RUNNER_SOURCE) if "{runner}" in self.test_command else ""
        )
        if "{python}" in self.test_command and not room.python:
            raise GradeFailure("no_interpreter", f"python3 is not on the sandbox's PATH ({room.path})")
        report = f"{room.root}/report.xml"
        command = self.test_command.format(
            report=shlex.quote(report), runner=shlex.quote(runner), python=shlex.quote(room.python)
        )
        result = await room.run(command, timeout_s=self.timeout_s, max_output_bytes=self.max_log_bytes, sweep=True)
        details.update(
            exit_code=result.exit_code, test_duration_s=round(result.duration_s, 3), log_tail=result.output[-2000:]
        )
        if result.timed_out:
            raise GradeFailure("tests_timed_out")
        if result.exit_code not in self.allowed_exit_codes:
            await room.run("true", timeout_s=60)  # a sandbox the tests stopped raises SandboxLostError here
            raise GradeFailure("bad_exit_code")
        tests = await self._read_results(room, result, report, details)
        any_failure = any(status in (TestStatus.FAILED, TestStatus.ERROR) for status in tests.values())
        if self.report_format == "junit" and any_failure != (result.exit_code != 0):
            raise GradeFailure("exit_code_mismatch", tests=tests)
        resolved, summary = resolve(tests, self.fail_to_pass, self.pass_to_pass)
        details.update(summary)
        return (1.0 if resolved else 0.0), tests

    async def _grade_supervised(
        self, room: GradingRoom, mode: Literal["pytest", "unittest"], details: dict[str, Any]
    ) -> tuple[float, Mapping[str, TestStatus]]:
        if not room.python:
            raise GradeFailure("no_interpreter", f"python3 is not on the sandbox's PATH ({room.path})")
        report = shlex.quote(f"{room.root}/report.xml")
        run = await supervised_run(
            room,
            self.test_command,
            mode=mode,
            expected=(*self.fail_to_pass, *self.pass_to_pass),
            timeout_s=self.timeout_s,
            max_log_bytes=self.max_log_bytes,
            canaries=self.canaries,
            format_command=lambda recorder: self.test_command.format(
                report=report, runner=shlex.quote(recorder), python=shlex.quote(room.python)
            ),
        )
        details.update(exit_code=run.exit_code, test_duration_s=round(run.duration_s, 3), log_tail=run.log[-2000:])
        details.update(run.details)
        if run.failure:
            raise GradeFailure(run.failure, run.message, tests=run.tests)
        resolved, summary = resolve(run.tests, self.fail_to_pass, self.pass_to_pass)
        details.update(summary)
        return (1.0 if resolved else 0.0), run.tests

    async def _read_results(
        self, room: GradingRoom, result: ExecResult, report: str, details: dict[str, Any]
    ) -> dict[str, TestStatus]:
        if self.report_format != "junit":
            return LOG_PARSERS[self.report_format](result.output)
        try:
            return parse_junit_xml(await room.read_report(report, max_bytes=self.max_report_bytes))
        except FileNotFoundError:
            raise GradeFailure("no_report") from None
        except ReportError as exc:
            details["report_error"] = str(exc)
            raise GradeFailure("report_unreadable", str(exc)) from None

    async def _restore(self, room: GradingRoom) -> None:
        """Reset the test files to the bytes the task holds; delete unshipped protected files."""
        targets = " ".join(shlex.quote(path) for path in self.test_paths)
        removal = f"rm -rf -- {targets}; " if targets else ""
        names = " -o ".join(f"-name {name}" for name in PROTECTED_FILE_NAMES)
        cleared = await room.run(f"{removal}find . \\( {names} \\) -not -path './.git/*' -delete", timeout_s=120)
        if not cleared.ok:
            raise GradingSetupError("cannot restore the test files", cleared.output)
        for path, data in self.original_files.items():
            await room.sandbox.write_file(path, data)
