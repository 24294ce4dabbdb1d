"""How each JUnit status element maps to an outcome, element by element (the real runners' output
is checked in tests/test_test_reports.py); a message never turns a failure into a pass."""

from __future__ import annotations

import pytest

from patchgym.core.tasks import TestStatus
from patchgym.core.test_reports import PYTEST_XPASS_MESSAGE, parse_junit_xml, worst

P, F, E, S, X = TestStatus.PASSED, TestStatus.FAILED, TestStatus.ERROR, TestStatus.SKIPPED, TestStatus.XFAIL


def one_case(children: str) -> TestStatus:
    case = f'<testcase classname="tests.test_a" name="test_a">{children}</testcase>'
    xml = f"<testsuites><testsuite>{case}</testsuite></testsuites>"
    (status,) = parse_junit_xml(xml).values()
    return status


@pytest.mark.parametrize(
    ("children", "expected"),
    [
        ("", P),
        ("<system-out>FAILED</system-out><properties/>", P),
        ('<failure message="assert 1 == 2"/>', F),
        ('<error message="fixture broke"/>', E),
        ('<skipped message="no"/>', S),
        ('<skipped type="pytest.skip" message="no"/>', S),
        ('<skipped type="pytest.xfail" message="reason"/>', X),
        ('<skipped type="xfail"/>', X),
        (f'<skipped message="{PYTEST_XPASS_MESSAGE}"/>', P),
        (f'<skipped type="pytest.skip" message="{PYTEST_XPASS_MESSAGE}"/>', S),
        (f'<failure message="{PYTEST_XPASS_MESSAGE}"/>', F),
        (f'<error message="{PYTEST_XPASS_MESSAGE}"/>', E),
        ('<failure type="pytest.xfail"/>', F),
        ('<error type="xfail"/>', E),
        ("<failure/><error/>", E),
        ('<skipped type="pytest.xfail"/><failure/>', F),
        ("<skipped/><error/>", E),
        ('<skipped type="pytest.xfail"/><skipped/>', S),
    ],
)
def test_each_status_element_maps_to_its_outcome(children: str, expected: TestStatus) -> None:
    assert one_case(children) == expected


def test_the_worst_of_two_outcomes_wins_in_either_order() -> None:
    order = [P, X, S, F, E]
    for i, better in enumerate(order):
        for worse in order[i:]:
            assert worst(better, worse) == worse and worst(worse, better) == worse
        assert worst(None, better) == better
