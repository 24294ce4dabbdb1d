"""The grading defences one by one, without an agent: tree diff, tamper check, parsers, errors."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from patchgym.core.fresh_grading import FreshSandboxGrader
from patchgym.core.grading import TestCommandGrader
from patchgym.core.grading_shell import GradingRoom
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec
from patchgym.core.tamper import tamper_findings
from patchgym.core.tasks import Grade, Grader, Task, TestStatus
from patchgym.core.test_reports import parse_junit_xml, parse_pytest_log, parse_unittest_log
from patchgym.core.tree_diff import tree_changes
from patchgym.envs.swe import AsyncSWEEnv
from patchgym.plugins import swe_grading
from patchgym.plugins.folder import tiny_task_set
from patchgym.plugins.swe_grading import SWELogGrader
from tests.conftest import make_backend

P, F, S, X = TestStatus.PASSED, TestStatus.FAILED, TestStatus.SKIPPED, TestStatus.XFAIL


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_tree_changes_compare_bytes_and_skip_tests_git_and_bytecode(tmp_path: Path) -> None:
    base = {"pkg/a.py": "a = 1\n", "pkg/gone.py": "x\n", "tests/test_a.py": "t\n", ".git/HEAD": "ref\n"}
    pristine = write(tmp_path / "pristine", base)
    changed = write(
        tmp_path / "changed",
        {
            **base,
            "pkg/a.py": "a = 2\n",
            "pkg/new.py": "n\n",
            "tests/test_a.py": "forged\n",
            ".git/HEAD": "forged\n",
            "pkg/__pycache__/a.cpython-311.pyc": "forged",
        },
    )
    (changed / "pkg" / "gone.py").unlink()
    os.symlink("a.py", changed / "pkg" / "link.py")
    (changed / "run.sh").write_text("#!/bin/sh\n")
    (changed / "run.sh").chmod(0o755)
    changes = {c.path: c for c in tree_changes(pristine, changed, lambda path: path.startswith("tests/"))}
    assert sorted(changes) == ["pkg/a.py", "pkg/gone.py", "pkg/link.py", "pkg/new.py", "run.sh"]
    assert changes["pkg/gone.py"].deleted and changes["pkg/link.py"].new_link == "a.py"
    assert changes["run.sh"].executable and changes["pkg/a.py"].added_lines() == [(1, "a = 2")]


@pytest.mark.parametrize(
    ("path", "text", "what"),
    [
        ("pkg/a.py", "import unittest", "imports the test framework"),
        ("pkg/a.py", "from _pytest import runner", "imports the test framework"),
        ("pkg/a.py", "atexit.register(f)", "installs an exit or signal hook"),
        ("pkg/a.py", "os._exit(0)", "exits or kills the process"),
        ("pkg/a.py", "frame = sys._getframe(2)", "inspects the caller's frames"),
        ("pkg/a.py", "sys.modules['x'] = y", "patches the interpreter"),
        ("pkg/a.py", "os.setsid()", "starts processes that outlive the test"),
        ("setup.cfg", "addopts = -p forge", "changes how the tests run"),
        ("sitecustomize.py", "x = 1", "loads code at interpreter start-up"),
        ("pkg/evil.pth", "import x", "loads code at interpreter start-up"),
        ("pytest.py", "x = 1", "shadows the test framework"),
    ],
)
def test_tamper_check_flags(tmp_path: Path, path: str, text: str, what: str) -> None:
    pristine = write(tmp_path / "p", {"pkg/a.py": "a = 1\n"})
    changed = write(tmp_path / "c", {"pkg/a.py": "a = 1\n", path: f"{text}\n"})
    findings = tamper_findings(tree_changes(pristine, changed, lambda _: False))
    assert what in [finding.what for finding in findings]


def test_tamper_check_passes_an_honest_fix(tmp_path: Path) -> None:
    before = "import os\nimport sys\n\ndef add(a, b):\n    return a - b\n"
    pristine = write(tmp_path / "p", {"calc.py": before})
    changed = write(tmp_path / "c", {"calc.py": before.replace("a - b", "a + b") + "\n# exit codes: sys.exit\n"})
    assert tamper_findings(tree_changes(pristine, changed, lambda _: False)) == []


def test_expected_failure_only_from_the_runner_type() -> None:
    report = (
        "<testsuites><testsuite>"
        '<testcase classname="m.C" name="chosen"><skipped message="xfail expected failure" type=""/></testcase>'
        '<testcase classname="m.C" name="pytest_skip"><skipped message="xfail" type="pytest.skip"/></testcase>'
        '<testcase classname="m.C" name="real"><skipped message="x" type="pytest.xfail"/></testcase>'
        '<testcase classname="m.C" name="ours"><skipped message="expected failure" type="xfail"/></testcase>'
        '<testcase classname="m.C" name="xpass"><skipped message="xfail-marked test passes unexpectedly"/></testcase>'
        '<testcase classname="m.C" name="twice"/><testcase classname="m.C" name="twice"><failure/></testcase>'
        '<testcase classname="m.C" name="twice"/>'
        "</testsuite></testsuites>"
    )
    statuses = parse_junit_xml(report)
    assert statuses == {
        "m.C.chosen": S,
        "m.C.pytest_skip": S,
        "m.C.real": X,
        "m.C.ours": X,
        "m.C.xpass": P,
        "m.C.twice": F,
    }


def test_log_parsers_keep_the_worst_status() -> None:
    pytest_log = "FAILED tests/t.py::test_a - assert 0\nPASSED tests/t.py::test_a\nPASSED tests/t.py::test_b\n"
    assert parse_pytest_log(pytest_log) == {"tests/t.py::test_a": F, "tests/t.py::test_b": P}
    unittest_log = "test_a (m.C.test_a) ... FAIL\ntest_a (m.C.test_a) ... ok\n"
    assert parse_unittest_log(unittest_log) == {"m.C.test_a": F}
    swebench_log = "FAILED tests/t.py::test_a - assert 0\nPASSED tests/t.py::test_a\n"
    assert swe_grading.parse_log(swebench_log, "parse_log_pytest")["tests/t.py::test_a"] == "FAILED"


def test_swe_grader_without_swebench_does_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swe_grading, "swebench_available", lambda: False)
    grader = SWELogGrader("x-1", "o/r", "1", ("t.py::test_a",), ("t.py::test_b",), "true", "HEAD", log_parser="pytest")
    grade = grader.judge_log("PASSED t.py::test_a\nFAILED t.py::test_b\n", 1)
    assert (grade.reward, grade.details["reason"]) == (0.0, "tests_failed")
    assert grade.details["report"]["pass_to_pass"]["failing"] == ["t.py::test_b"]


@pytest.fixture
async def bwrap(tmp_path: Path) -> Any:
    backend = make_backend("local-bwrap", tmp_path)
    yield backend
    await backend.aclose()


async def test_setup_output_is_not_parsed(bwrap: SandboxBackend, workspace: Path) -> None:
    """Lines the set-up steps print (pip's among them) never reach the parser, forged or not."""
    forged = "echo 'ERROR: pip could not install'; echo 'PASSED t.py::test_a'"
    grader = SWELogGrader(
        "x-1", "o/r", "1", ("t.py::test_a",), (), "echo 'ERROR t.py::collect'; exit 2", "HEAD", log_parser="pytest"
    )
    grader = dataclasses.replace(grader, test_setup=forged)
    async with await bwrap.create(SandboxSpec(workspace=workspace)) as sandbox:
        await sandbox.exec("git init -q && git add -A && git -c user.name=a -c user.email=b commit -qm x", timeout_s=60)
        grade = await grader.grade(sandbox)
    assert grade.reward == 0.0 and "t.py::test_a" not in grade.tests


async def test_grading_shell_ignores_the_sandboxs_shell(bwrap: SandboxBackend, workspace: Path) -> None:
    async with await bwrap.create(SandboxSpec(workspace=workspace)) as sandbox:
        room = await GradingRoom.open(sandbox)
        await sandbox.exec(
            "echo 'python3() { echo forged; }; export -f python3; export LEAK=1' | tee -a ~/.bashrc ~/.bash_profile",
            timeout_s=60,
        )
        done = await room.run(
            "type -t python3; echo LEAK=${LEAK:-}; echo HOME=$HOME; echo BASH_ENV=${BASH_ENV:-}", timeout_s=60
        )
    assert done.stdout.split() == ["file", "LEAK=", f"HOME={room.root}/home", "BASH_ENV="]
    assert room.python.startswith("/")


class _Raises(Grader):
    async def grade(self, sandbox: Sandbox) -> Grade:
        raise IsADirectoryError("report.xml is a directory")


async def test_a_grading_error_is_a_zero_not_a_stopped_run(bwrap: SandboxBackend) -> None:
    base = tiny_task_set().get("roman-subtractive")
    task = Task(
        id=base.id,
        instruction=base.instruction,
        sandbox=base.sandbox,
        grader=_Raises(),
        setup_commands=base.setup_commands,
    )
    env = AsyncSWEEnv(tiny_task_set(), bwrap)
    try:
        await env.reset(options={"task": task})
        _, reward, terminated, _, info = await env.step("```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")
    finally:
        await env.close()
    assert (reward, terminated, info["infra_error"]) == (0.0, True, None)
    assert info["grade"]["details"]["reason"] == "grading_error"
    assert "IsADirectoryError" in info["grade"]["details"]["message"]


def test_fresh_grader_delegates_what_it_wraps() -> None:
    inner = TestCommandGrader(test_command="true", fail_to_pass=(), test_paths=("tests",))
    wrapper = FreshSandboxGrader(inner, backend=None, task=None)  # type: ignore[arg-type]
    assert wrapper.is_test_path("tests/test_x.py") and not wrapper.is_test_path("pkg/x.py")
    assert wrapper.is_test_path("pkg/conftest.py") and not wrapper.grades_container_state


async def test_changes_are_applied_to_a_fresh_sandbox(bwrap: SandboxBackend, tmp_path: Path) -> None:
    """Deletions, kind changes, links and executable bits carry over; the workdir keeps its mode."""
    pristine = write(tmp_path / "pristine", {"a.py": "a\n", "gone.py": "g\n", "x": "file\n", "keep/k.py": "k\n"})
    changed = write(
        tmp_path / "changed", {"a.py": "b\n", "x/inner.py": "i\n", "keep/k.py": "k\n", "run.sh": "#!/bin/sh\n"}
    )
    (changed / "run.sh").chmod(0o755)
    os.symlink("a.py", changed / "link.py")
    changes = tree_changes(pristine, changed, lambda _: False)
    async with await bwrap.create(SandboxSpec(workspace=pristine)) as sandbox:
        before = await sandbox.exec("stat -c %a .", timeout_s=60)
        await FreshSandboxGrader._apply(sandbox, changes)
        listing = await sandbox.exec(
            "stat -c %a .; cat a.py x/inner.py; test -e gone.py || echo gone; "
            "readlink link.py; test -x run.sh && echo x",
            timeout_s=60,
        )
    assert listing.stdout.split() == [before.stdout.strip(), "b", "i", "gone", "a.py", "x"]
