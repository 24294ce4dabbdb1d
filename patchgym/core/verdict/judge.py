"""From the supervisor's records to test statuses, and the checks that can zero a grade.

Each test's phases (pytest: setup, call, teardown; unittest: one) are combined into one status,
the worst of them. A test recorded twice in one phase is an ERROR: every expected test is run
exactly once, and a second report under its id is another test passing itself off as it. An
expected failure counts only where the pristine test file marks one (the supervisor read the
files before the runner started); anywhere else it is a failure, whatever the code under test
added at run time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from patchgym.core.tasks import TestStatus
from patchgym.core.test_reports import worst

_OUTCOMES = {
    "passed": TestStatus.PASSED,
    "xpass": TestStatus.PASSED,
    "failed": TestStatus.FAILED,
    "error": TestStatus.ERROR,
    "skipped": TestStatus.SKIPPED,
    "xfail": TestStatus.XFAIL,
}


def combine(outcomes: Iterable[tuple[str, str, str]]) -> tuple[dict[str, TestStatus], list[str]]:
    """(status of each test id, ids recorded twice in one phase)."""
    phases: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for test_id, phase, outcome in outcomes:
        phases[test_id][phase].append(outcome)
    tests: dict[str, TestStatus] = {}
    twice: list[str] = []
    for test_id, seen in phases.items():
        status: TestStatus | None = None
        for phase, results in seen.items():
            for result in results:
                found = _OUTCOMES.get(result, TestStatus.ERROR)
                if phase != "call" and found is TestStatus.PASSED:
                    continue
                status = worst(status, found)
            if len(results) > 1:
                twice.append(test_id)
                status = worst(status, TestStatus.ERROR)
        if status is None:  # set up and torn down, never called: it did not run
            status = TestStatus.ERROR if "call" not in seen else TestStatus.PASSED
        tests[test_id] = status
    return tests, twice


def test_file(test_id: str, mode: str) -> str:
    """The file (relative to the runner's root) that defines a test."""
    if "::" in test_id or mode == "pytest":
        return test_id.split("::", 1)[0]
    module = test_id.split(".")[:-2] if test_id.count(".") >= 2 else test_id.split(".")[:-1]
    return "/".join(module) + ".py"


def without_unmarked_xfails(
    tests: dict[str, TestStatus], marked_files: Iterable[str], mode: str
) -> tuple[dict[str, TestStatus], list[str]]:
    """XFAIL becomes FAILED where the pristine file marks no expected failure; returns the ids changed."""
    marked = set(marked_files)
    changed = [t for t, s in tests.items() if s is TestStatus.XFAIL and test_file(t, mode) not in marked]
    return {t: (TestStatus.FAILED if t in changed else s) for t, s in tests.items()}, changed


def as_pytest_log(tests: dict[str, TestStatus]) -> str:
    """Recorded statuses as `pytest -rA` summary lines, for a log parser that names tests its own
    way (swebench's): the text comes from the records, never from what the tests printed."""
    return "".join(f"{status} {test_id}\n" for test_id, status in tests.items())
