"""Grading by running a task's tests inside the sandbox, hardened against reward hacking.

Before the tests run, the grader restores the task's test files (an edited or deleted test
file comes back, an added one goes away) and removes every `conftest.py` and `pytest.ini`
the task did not ship.
The test command writes a JUnit XML report into a fresh directory made at grading time, so
lines printed by the code under test cannot forge a result, and the report must agree with the
command's exit code. Resolved = every FAIL_TO_PASS test passes and every PASS_TO_PASS test
still passes (SWE-bench's rule); reward 1.0 if resolved else 0.0.

What this does not defend against: an agent that replaces the interpreter or the test
runner itself inside the sandbox. Grading in a fresh sandbox with only the agent's diff
applied closes that gap.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from patchgym.core.sandbox import ExecResult, Sandbox
from patchgym.core.tasks import Grade, Grader, TestStatus
from patchgym.core.test_reports import LOG_PARSERS, ReportError, parse_junit_xml

UNITTEST_RUNNER = Path(__file__).with_name("unittest_junit.py")
"""Standalone script that runs a unittest suite and writes JUnit XML (see its docstring)."""

UNITTEST_COMMAND = "python3 -s -E {runner} --report {report} --start tests --top ."
"""Test command for plain-unittest projects whose tests live in `tests/`."""

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


@dataclass(frozen=True)
class TestCommandGrader(Grader):
    """Runs `test_command` in the sandbox and applies `resolve` to its results.

    `test_command` may use `{report}` (where the JUnit XML must be written) and `{runner}`
    (the bundled unittest runner). `test_paths` are reset to `original_files`, which must
    also hold every file named in `PROTECTED_FILE_NAMES` that the task ships. With
    `report_format` "pytest" or "unittest" the command's log is parsed instead (weaker:
    printed lines can forge it).
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
    allowed_exit_codes: tuple[int, ...] = (0, 1)

    async def grade(self, sandbox: Sandbox) -> Grade:
        started = time.perf_counter()
        prepared = await self._prepare(sandbox)
        if isinstance(prepared, Grade):
            return prepared
        grade_dir = prepared
        runner = f"{grade_dir}/{UNITTEST_RUNNER.name}"
        report = f"{grade_dir}/report.xml"
        if "{runner}" in self.test_command:
            await sandbox.write_file(runner, UNITTEST_RUNNER.read_bytes())
        command = self.test_command.format(report=shlex.quote(report), runner=shlex.quote(runner))
        result = await sandbox.exec(command, timeout_s=self.timeout_s, max_output_bytes=self.max_log_bytes)
        details: dict[str, Any] = {
            "exit_code": result.exit_code,
            "test_duration_s": round(result.duration_s, 3),
            "log_tail": result.output[-2000:],
        }
        grade = await self._judge(sandbox, result, report, details)
        details["grade_duration_s"] = round(time.perf_counter() - started, 3)
        return grade

    async def _judge(self, sandbox: Sandbox, result: ExecResult, report: str, details: dict[str, Any]) -> Grade:
        if result.timed_out:
            return _failed("tests_timed_out", details)
        if result.exit_code not in self.allowed_exit_codes:
            return _failed("bad_exit_code", details)
        try:
            tests = await self._read_results(sandbox, result, report)
        except FileNotFoundError:
            return _failed("no_report", details)
        except ReportError as exc:
            details["report_error"] = str(exc)
            return _failed("report_unreadable", details)
        any_failure = any(status in (TestStatus.FAILED, TestStatus.ERROR) for status in tests.values())
        if self.report_format == "junit" and any_failure != (result.exit_code != 0):
            return _failed("exit_code_mismatch", details, tests)
        resolved, summary = resolve(tests, self.fail_to_pass, self.pass_to_pass)
        details.update(summary, reason="resolved" if resolved else "tests_failed")
        return Grade(reward=1.0 if resolved else 0.0, resolved=resolved, tests=tests, details=details)

    async def _read_results(self, sandbox: Sandbox, result: ExecResult, report: str) -> dict[str, TestStatus]:
        if self.report_format == "junit":
            return parse_junit_xml(await sandbox.read_file(report))
        return LOG_PARSERS[self.report_format](result.output)

    async def _prepare(self, sandbox: Sandbox) -> str | Grade:
        """Make a fresh grading directory and restore the test files.

        Failures here are the agent's doing (a full disk, a broken shell), so they grade 0;
        a fault of the sandbox itself surfaces as an InfraError from `exec`.
        """
        made = await sandbox.exec('mktemp -d "${TMPDIR:-/tmp}/patchgym-grade.XXXXXXXXXX"', timeout_s=60)
        if not made.ok or not made.stdout.strip():
            return _failed("grading_setup_failed", {"log_tail": made.output[-2000:]})
        targets = " ".join(shlex.quote(path) for path in self.test_paths)
        removal = f"rm -rf -- {targets}; " if targets else ""
        names = " -o ".join(f"-name {name}" for name in PROTECTED_FILE_NAMES)
        cleared = await sandbox.exec(f"{removal}find . \\( {names} \\) -not -path './.git/*' -delete", timeout_s=120)
        if not cleared.ok:
            return _failed("grading_setup_failed", {"log_tail": cleared.output[-2000:]})
        for path, data in self.original_files.items():
            await sandbox.write_file(path, data)
        return made.stdout.strip()


def _failed(reason: str, details: dict[str, Any], tests: Mapping[str, TestStatus] | None = None) -> Grade:
    details["reason"] = reason
    return Grade(reward=0.0, resolved=False, tests=dict(tests or {}), details=details)
