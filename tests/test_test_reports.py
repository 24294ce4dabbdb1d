"""Test-result parsers and the resolution rule, checked against real runner output."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patchgym.core.grading import UNITTEST_RUNNER, resolve
from patchgym.core.tasks import TestStatus
from patchgym.core.test_reports import ReportError, parse_junit_xml, parse_pytest_log, parse_unittest_log

P, F, E, S, X = TestStatus.PASSED, TestStatus.FAILED, TestStatus.ERROR, TestStatus.SKIPPED, TestStatus.XFAIL

PYTEST_PROJECT = {
    "tests/__init__.py": "",
    "tests/test_mod.py": """
        import pytest

        def test_ok(): pass
        def test_fail(): assert False
        @pytest.mark.skip(reason="no")
        def test_skip(): pass
        @pytest.mark.xfail
        def test_xfail(): assert False
        @pytest.mark.parametrize("n", [1, 2])
        def test_param(n): assert n == 1
        class TestGroup:
            def test_in_class(self): pass
            class TestInner:
                def test_nested(self): pass
        @pytest.fixture
        def broken(): raise RuntimeError("fixture")
        def test_error(broken): pass
    """,
}

UNITTEST_PROJECT = {
    "tests/__init__.py": "",
    "tests/test_mod.py": """
        import unittest

        class Case(unittest.TestCase):
            def test_ok(self): pass
            def test_fail(self): self.assertEqual(1, 2)
            def test_error(self): raise RuntimeError("boom")
            @unittest.skip("no")
            def test_skip(self): pass
            @unittest.expectedFailure
            def test_xfail(self): self.assertEqual(1, 2)
            @unittest.expectedFailure
            def test_xpass(self): pass
            def test_documented(self):
                \"\"\"A docstring shows on its own line in -v output.\"\"\"
    """,
}

UNITTEST_EXPECTED = {
    "tests.test_mod.Case.test_ok": P,
    "tests.test_mod.Case.test_fail": F,
    "tests.test_mod.Case.test_error": E,
    "tests.test_mod.Case.test_skip": S,
    "tests.test_mod.Case.test_xfail": X,
    "tests.test_mod.Case.test_xpass": F,
    "tests.test_mod.Case.test_documented": P,
}


def write_project(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_junit_from_real_pytest_gives_pytest_node_ids(tmp_path: Path) -> None:
    project = write_project(tmp_path / "proj", PYTEST_PROJECT)
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={report}",
            "-rA",
            "tests",
        ],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    statuses = parse_junit_xml(report.read_bytes())
    assert statuses == {
        "tests/test_mod.py::test_ok": P,
        "tests/test_mod.py::test_fail": F,
        "tests/test_mod.py::test_skip": S,
        "tests/test_mod.py::test_xfail": X,
        "tests/test_mod.py::test_param[1]": P,
        "tests/test_mod.py::test_param[2]": F,
        "tests/test_mod.py::TestGroup::test_in_class": P,
        "tests/test_mod.py::TestGroup::TestInner::test_nested": P,
        "tests/test_mod.py::test_error": E,
    }
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "tests"],
        cwd=project,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert {line for line in collected if "::" in line} == set(statuses)
    log_statuses = parse_pytest_log(run.stdout)
    assert log_statuses["tests/test_mod.py::test_ok"] == P
    assert log_statuses["tests/test_mod.py::test_param[2]"] == F
    assert log_statuses["tests/test_mod.py::test_xfail"] == X


def test_bundled_unittest_runner_writes_junit(tmp_path: Path) -> None:
    project = write_project(tmp_path / "proj", UNITTEST_PROJECT)
    report = tmp_path / "out" / "report.xml"
    report.parent.mkdir()
    run = subprocess.run(
        ["python3", "-s", "-E", str(UNITTEST_RUNNER), "--report", str(report)],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1, run.stderr
    assert parse_junit_xml(report.read_bytes()) == UNITTEST_EXPECTED
    assert parse_unittest_log(run.stderr) == UNITTEST_EXPECTED


def test_bundled_runner_exit_code_zero_when_all_pass(tmp_path: Path) -> None:
    project = write_project(
        tmp_path / "proj",
        {
            "tests/__init__.py": "",
            "tests/test_a.py": "import unittest\nclass A(unittest.TestCase):\n    def test_a(self): pass\n",
        },
    )
    run = subprocess.run(
        ["python3", str(UNITTEST_RUNNER), "--report", str(tmp_path / "r.xml")], cwd=project, capture_output=True
    )
    assert run.returncode == 0
    assert parse_junit_xml((tmp_path / "r.xml").read_bytes()) == {"tests.test_a.A.test_a": P}


def test_import_error_in_a_test_module_is_an_error_not_silence(tmp_path: Path) -> None:
    project = write_project(tmp_path / "proj", {"tests/__init__.py": "", "tests/test_a.py": "import no_such_module\n"})
    run = subprocess.run(
        ["python3", str(UNITTEST_RUNNER), "--report", str(tmp_path / "r.xml")], cwd=project, capture_output=True
    )
    assert run.returncode == 1
    assert list(parse_junit_xml((tmp_path / "r.xml").read_bytes()).values()) == [E]


def test_junit_worst_outcome_wins_for_repeated_ids() -> None:
    xml = """<testsuites><testsuite>
      <testcase classname="a.B" name="t"/>
      <testcase classname="a.B" name="t"><failure message="x"/></testcase>
      <testcase classname="a.B" name="t"/>
    </testsuite></testsuites>"""
    assert parse_junit_xml(xml) == {"a.B.t": F}


def test_unparseable_junit_is_a_report_error() -> None:
    with pytest.raises(ReportError, match="not valid JUnit XML"):
        parse_junit_xml(b"PASSED tests/test_x.py::test_a")


def test_pytest_log_ignores_skip_reasons_and_maps_xpass() -> None:
    log = "SKIPPED [1] tests/test_x.py:3: no reason\nXPASS tests/test_x.py::test_b\nERROR tests/test_x.py::test_c - x\n"
    assert parse_pytest_log(log) == {"tests/test_x.py::test_b": P, "tests/test_x.py::test_c": E}


def test_resolve_follows_swebench_rules() -> None:
    tests = {"f1": P, "f2": X, "p1": P, "p2": S}
    assert resolve(tests, ["f1", "f2"], ["p1"])[0]
    resolved, summary = resolve(tests, ["f1", "gone"], ["p1", "p2"])
    assert not resolved
    assert summary["fail_to_pass"] == {"passed": 1, "total": 2, "failing": ["gone"], "missing": ["gone"]}
    assert summary["pass_to_pass"]["failing"] == ["p2"]
    assert resolve({}, [], [])[0]
