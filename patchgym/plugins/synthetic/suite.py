"""Run a snapshot's tests in a sandbox and read the results (statuses and failure messages)."""

from __future__ import annotations

import shlex
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from patchgym.core.grading import UNITTEST_RUNNER, UNITTEST_RUNNER_SOURCE
from patchgym.core.sandbox import Sandbox
from patchgym.core.tasks import TestStatus
from patchgym.core.test_reports import ReportError, junit_test_id, parse_junit_xml


@dataclass(frozen=True)
class SuiteRun:
    """One run of a test suite. `problem` is set when no usable report came out."""

    tests: dict[str, TestStatus] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    problem: str | None = None
    log_tail: str = ""


def failure_messages(report: bytes) -> dict[str, str]:
    """The failure or error text of every failing test case in a JUnit XML report."""
    messages = {}
    for case in ET.fromstring(report).iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                test_id = junit_test_id(case.get("classname", ""), case.get("name", ""), case.get("file"))
                messages[test_id] = child.text or child.get("message", "")
    return messages


async def run_suite(sandbox: Sandbox, test_command: str, *, timeout_s: float) -> SuiteRun:
    """Run `test_command` (with `{runner}`/`{report}` placeholders) and parse its JUnit report."""
    made = await sandbox.exec('mktemp -d "${TMPDIR:-/tmp}/patchgym-synth.XXXXXXXXXX"', timeout_s=60)
    if not made.ok:
        return SuiteRun(problem="mktemp_failed", log_tail=made.output[-2000:])
    directory = made.stdout.strip()
    runner, report = f"{directory}/{UNITTEST_RUNNER.name}", f"{directory}/report.xml"
    if "{runner}" in test_command:
        await sandbox.write_file(runner, UNITTEST_RUNNER_SOURCE)
    command = test_command.format(runner=shlex.quote(runner), report=shlex.quote(report))
    result = await sandbox.exec(command, timeout_s=timeout_s)
    tail = result.output[-2000:]
    if result.timed_out:
        return SuiteRun(duration_s=result.duration_s, problem="timed_out", log_tail=tail)
    if result.exit_code not in (0, 1):
        return SuiteRun(duration_s=result.duration_s, problem=f"exit_code_{result.exit_code}", log_tail=tail)
    try:
        data = await sandbox.read_file(report)
        return SuiteRun(parse_junit_xml(data), failure_messages(data), result.duration_s, log_tail=tail)
    except FileNotFoundError:
        return SuiteRun(duration_s=result.duration_s, problem="no_report", log_tail=tail)
    except (ReportError, ET.ParseError):
        return SuiteRun(duration_s=result.duration_s, problem="report_unreadable", log_tail=tail)
