"""The grader inside a real sandbox: restoration of test files and resistance to forgery."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest

from patchgym.core.grading import TestCommandGrader
from patchgym.core.sandbox import SandboxBackend, SandboxSpec
from patchgym.core.tasks import Task, TestStatus, start_task_sandbox
from patchgym.core.test_reports import parse_junit_xml, parse_pytest_log
from patchgym.core.validation import apply_patch
from patchgym.plugins.folder import FolderTaskSet, load_task, tiny_task_set

PYTEST_COMMAND = "python3 -m pytest -p no:cacheprovider -o junit_family=xunit1 --junitxml={report} tests"

FORGING_CONFTEST = """
import pytest

def pytest_collection_finish(session):
    for item in session.items:
        print(f"PASSED {item.nodeid}")

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""


@pytest.fixture
def roman() -> Task:
    return tiny_task_set().get("roman-subtractive")


def pytest_image_context(folder: Path) -> None:
    """A Dockerfile giving the base image this interpreter's pytest (pure Python, copied offline)."""
    site = folder / "environment" / "site"
    for name in ("pytest", "pluggy", "iniconfig", "packaging", "pygments"):
        distribution = importlib.metadata.distribution(name)
        for file in distribution.files or []:
            source = Path(str(distribution.locate_file(file)))
            if file.parts[0] == ".." or "__pycache__" in file.parts or not source.is_file():
                continue
            (site / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, site / file)
    (folder / "environment" / "Dockerfile").write_text(
        "FROM patchgym/base:latest\nCOPY site/ /usr/local/lib/python3.11/dist-packages/\n"
    )


@pytest.fixture
def pytest_task(tmp_path: Path) -> Task:
    return load_task(make_pytest_task(tmp_path))


def make_pytest_task(tmp_path: Path) -> Path:
    """A task folder: `calc.add` subtracts, tests run by pytest writing JUnit XML (F2P test_add)."""
    folder = tmp_path / "tasks" / "calc-add"
    (folder / "repo" / "tests").mkdir(parents=True)
    pytest_image_context(folder)
    (folder / "repo" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (folder / "repo" / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n"
        "def test_add():\n    assert add(2, 2) == 4\n\n"
        "def test_zero():\n    assert add(0, 0) == 0\n"
    )
    (folder / "issue.md").write_text("add() subtracts\n")
    (folder / "gold.patch").write_text(
        "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
    )
    spec = {
        "id": "calc-add",
        "fail_to_pass": ["tests/test_calc.py::test_add"],
        "pass_to_pass": ["tests/test_calc.py::test_zero"],
        "test_command": PYTEST_COMMAND,
        "dockerfile": "environment/Dockerfile",
    }
    (folder / "task.json").write_text(json.dumps(spec))
    return folder


async def grade_after(backend: SandboxBackend, task: Task, command: str | None, *, gold: bool = False) -> dict:
    async with await start_task_sandbox(backend, task) as sandbox:
        if gold:
            assert task.gold_patch
            assert (await apply_patch(sandbox, task.gold_patch)).ok
        if command:
            done = await sandbox.exec(command, timeout_s=60)
            assert done.ok, done.output
        return (await task.grader.grade(sandbox)).as_dict()


async def test_gold_and_empty(backend: SandboxBackend, roman: Task, pytest_task: Task) -> None:
    for task in (roman, pytest_task):
        gold = await grade_after(backend, task, None, gold=True)
        assert gold["reward"] == 1.0 and gold["resolved"] and gold["details"]["reason"] == "resolved"
        empty = await grade_after(backend, task, None)
        assert empty["reward"] == 0.0 and not empty["resolved"] and empty["details"]["reason"] == "tests_failed"


async def test_edited_test_files_are_restored(backend: SandboxBackend, roman: Task) -> None:
    gut_tests = "for f in tests/test_*.py; do printf 'import unittest\\n' > $f; done"
    assert (await grade_after(backend, roman, gut_tests))["reward"] == 0.0
    deleted = await grade_after(backend, roman, "rm -rf tests")
    assert deleted["reward"] == 0.0 and deleted["details"]["fail_to_pass"]["missing"] == []
    # an honest fix still scores even if the agent also scribbled on the tests
    assert (await grade_after(backend, roman, gut_tests + "; echo '# note' > tests/extra.py", gold=True))[
        "reward"
    ] == 1.0


async def test_forged_conftest_does_not_earn_reward(backend: SandboxBackend, pytest_task: Task) -> None:
    plant = (
        f"cat > conftest.py <<'EOF'\n{FORGING_CONFTEST}\nEOF\n"
        "cp conftest.py tests/conftest.py && printf '[pytest]\\naddopts = -p conftest\\n' > pytest.ini"
    )
    forged = await grade_after(backend, pytest_task, plant)
    assert forged["reward"] == 0.0
    assert forged["details"]["fail_to_pass"]["failing"] == ["tests/test_calc.py::test_add"]


async def test_forgery_works_without_the_hardening(backend: SandboxBackend, pytest_task: Task) -> None:
    """Control: left in place, the conftest forges both the log and the JUnit report."""
    async with await start_task_sandbox(backend, pytest_task) as sandbox:
        await sandbox.write_file("conftest.py", FORGING_CONFTEST)
        run = await sandbox.exec(PYTEST_COMMAND.format(report="forged.xml") + " -rA", timeout_s=60)
        assert run.exit_code == 0
        assert parse_pytest_log(run.stdout)["tests/test_calc.py::test_add"] == TestStatus.PASSED
        assert (
            parse_junit_xml(await sandbox.read_file("forged.xml"))["tests/test_calc.py::test_add"] == TestStatus.PASSED
        )


def _grader(command: str, **kwargs: object) -> TestCommandGrader:
    return TestCommandGrader(test_command=command, fail_to_pass=("a.B.t",), **kwargs)  # type: ignore[arg-type]


PASSING_REPORT = (
    'echo \'<testsuites><testsuite><testcase classname="a.B" name="t"/></testsuite></testsuites>\' > {report}'
)


@pytest.mark.parametrize(
    ("command", "reason", "reward"),
    [
        (PASSING_REPORT, "resolved", 1.0),
        (PASSING_REPORT + "; exit 1", "exit_code_mismatch", 0.0),
        (PASSING_REPORT + "; exit 2", "bad_exit_code", 0.0),
        ("true", "no_report", 0.0),
        ("echo 'PASSED a.B.t' > {report}", "report_unreadable", 0.0),
        ("sleep 30", "tests_timed_out", 0.0),
    ],
)
async def test_grader_verdicts(
    backend: SandboxBackend, workspace: Path, command: str, reason: str, reward: float
) -> None:
    async with await backend.create(SandboxSpec(workspace=workspace)) as sandbox:
        grade = await _grader(command, timeout_s=1.0).grade(sandbox)
    assert (grade.details["reason"], grade.reward) == (reason, reward)


async def test_report_is_written_outside_the_workspace(backend: SandboxBackend, workspace: Path) -> None:
    async with await backend.create(SandboxSpec(workspace=workspace)) as sandbox:
        grade = await _grader(PASSING_REPORT + "; echo {report}").grade(sandbox)
        report_path = grade.details["log_tail"].strip()
        assert not report_path.startswith(sandbox.workdir)
        assert "patchgym-grade." in report_path


def test_folder_task_errors_name_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "task.json").write_text(json.dumps({"id": "bad", "fail_to_pass": [], "typo_key": 1}))
    with pytest.raises(ValueError, match=r"(?s)bad/task.json.*typo_key"):
        list(FolderTaskSet(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        FolderTaskSet(tmp_path / "nope")
