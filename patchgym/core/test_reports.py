"""Parse test results into `{test id: TestStatus}`.

The JUnit XML parser is the trustworthy one: the grader has the test runner write the XML to
a place the agent cannot reach, so printed lines cannot forge it. The log parsers (pytest
`-rA` summaries, unittest `-v` output) exist for task sets that only have logs. Every parser
keeps the worst status of a test reported twice, so a forged line printed after the real one
cannot override it. An expected failure comes only from the runner's own result type
(`pytest.xfail`, or the bundled unittest runner's `xfail`), never from a message the code
under test chose.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from patchgym.core.tasks import TestStatus

_JUNIT_OUTCOMES = {
    "failure": TestStatus.FAILED,
    "error": TestStatus.ERROR,
    "skipped": TestStatus.SKIPPED,
}


XFAIL_TYPES = ("pytest.xfail", "xfail")
"""JUnit `type`s of a `<skipped>` that mean an expected failure (pytest's, the bundled runner's)."""
PYTEST_XPASS_MESSAGE = "xfail-marked test passes unexpectedly"
"""pytest's JUnit message for a non-strict XPASS (a `<skipped>` without a type): a pass."""

_SEVERITY = {
    TestStatus.PASSED: 0,
    TestStatus.XFAIL: 1,
    TestStatus.SKIPPED: 2,
    TestStatus.FAILED: 3,
    TestStatus.ERROR: 4,
}


class ReportError(ValueError):
    """A test report that cannot be parsed."""


def worst(first: TestStatus | None, second: TestStatus) -> TestStatus:
    """The worse of two statuses of one test (`first` None: `second`)."""
    if first is None or _SEVERITY[second] > _SEVERITY[first]:
        return second
    return first


def record(statuses: dict[str, TestStatus], test_id: str, status: TestStatus) -> None:
    """Add a status; a test seen twice keeps its worst."""
    statuses[test_id] = worst(statuses.get(test_id), status)


def junit_test_id(classname: str, name: str, file: str | None) -> str:
    """A stable id for one JUnit test case.

    With a `file` attribute (pytest's xunit1 family) this is the pytest node id
    (`tests/test_x.py::TestA::test_b`); otherwise `classname.name`, which is unittest's id.
    """
    if not file:
        return f"{classname}.{name}" if classname else name
    module = file.removesuffix(".py").replace("/", ".")
    inner = classname.removeprefix(module).lstrip(".")
    return "::".join([file, *(inner.split(".") if inner else []), name])


def parse_junit_xml(data: bytes | str) -> dict[str, TestStatus]:
    """Statuses of every `<testcase>` in a JUnit XML document (worst outcome wins)."""
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise ReportError(f"test report is not valid JUnit XML: {exc}") from exc
    statuses: dict[str, TestStatus] = {}
    for case in root.iter("testcase"):
        test_id = junit_test_id(case.get("classname", ""), case.get("name", ""), case.get("file"))
        status = TestStatus.PASSED
        for child in case:
            outcome = _JUNIT_OUTCOMES.get(child.tag)
            if outcome is TestStatus.SKIPPED and child.get("type") in XFAIL_TYPES:
                outcome = TestStatus.XFAIL
            elif outcome is TestStatus.SKIPPED and child.get("type") is None:
                # only a <skipped> can be pytest's XPASS: a failure or error with that message stays one
                outcome = TestStatus.PASSED if child.get("message") == PYTEST_XPASS_MESSAGE else outcome
            if outcome is not None:
                status = worst(status, outcome)
        record(statuses, test_id, status)
    return statuses


_PYTEST_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)")


def parse_pytest_log(log: str) -> dict[str, TestStatus]:
    """Statuses from pytest's short test summary (`pytest -rA`): `PASSED tests/x.py::test_a`."""
    statuses: dict[str, TestStatus] = {}
    for line in log.splitlines():
        match = _PYTEST_LINE.match(line.strip())
        if not match:
            continue
        word, test_id = match.groups()
        if word == "SKIPPED" and test_id.startswith("["):
            continue  # "SKIPPED [1] file.py:3: reason" names no test
        record(statuses, test_id, TestStatus.PASSED if word == "XPASS" else TestStatus(word))
    return statuses


_UNITTEST_LINE = re.compile(
    r"^(\w+) \(([\w.]+)\)(?:\n.*?)? \.\.\. (ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)$", re.M
)
_UNITTEST_OUTCOMES = {
    "ok": TestStatus.PASSED,
    "FAIL": TestStatus.FAILED,
    "ERROR": TestStatus.ERROR,
    "expected failure": TestStatus.XFAIL,
    "unexpected success": TestStatus.FAILED,
}


def parse_unittest_log(log: str) -> dict[str, TestStatus]:
    """Statuses from `python -m unittest -v` output: `test_a (pkg.mod.Case.test_a) ... ok`."""
    statuses: dict[str, TestStatus] = {}
    for method, where, outcome in _UNITTEST_LINE.findall(log):
        test_id = where if where.endswith(f".{method}") else f"{where}.{method}"
        record(statuses, test_id, _UNITTEST_OUTCOMES.get(outcome, TestStatus.SKIPPED))
    return statuses


LOG_PARSERS = {"pytest": parse_pytest_log, "unittest": parse_unittest_log}
