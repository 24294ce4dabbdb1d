"""The synthetic bug generator end to end: sources → validated SWE-smith-style tasks → task set."""

from __future__ import annotations

import json
import sysconfig
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.cli import app, load_task_set
from patchgym.core.errors import ConfigError
from patchgym.core.plugins import registry
from patchgym.core.sandbox import SandboxBackend
from patchgym.core.validation import validate_task
from patchgym.plugins.synthetic.generate import GenerateSettings, generate
from patchgym.plugins.synthetic.sources import build_snapshot, redirect_imports
from patchgym.plugins.synthetic.taskset import SyntheticTaskSet
from tests.conftest import make_backend

CALC = '''\
"""Small arithmetic helpers."""


def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def sign(x):
    if x > 0:
        return 1
    elif x < 0:
        return -1
    else:
        return 0
'''

CALC_TESTS = """\
import unittest

from calc.core import clamp, mean, sign


class ClampTest(unittest.TestCase):
    def test_inside(self):
        self.assertEqual(clamp(2, 0, 5), 2)

    def test_low(self):
        self.assertEqual(clamp(-3, 0, 5), 0)

    def test_high(self):
        self.assertEqual(clamp(9, 0, 5), 5)


class MeanTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)


class SignTest(unittest.TestCase):
    def test_signs(self):
        self.assertEqual([sign(-2), sign(0), sign(4)], [-1, 0, 1])
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "calc-project"
    (root / "calc").mkdir(parents=True)
    (root / "calc" / "__init__.py").write_text("")
    (root / "calc" / "core.py").write_text(CALC)
    (root / "tests").mkdir()
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "test_calc.py").write_text(CALC_TESTS)
    return root


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[SandboxBackend]:
    backend = make_backend("local-none", tmp_path)
    yield backend
    await backend.aclose()


def instances(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "instances.jsonl").read_text().splitlines()]


async def test_generated_tasks_are_valid_and_fail_without_the_fix(
    project: Path, local: SandboxBackend, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    report = await generate([str(project)], out, local, GenerateSettings(seed=1, max_tasks=4, concurrency=2))
    assert report.accepted == 4 and report.tried >= 4 and report.per_repo
    rows = instances(out)
    assert len(rows) == 4 and len({row["instance_id"] for row in rows}) == 4
    for row in rows:
        assert row["repo"].startswith("local__calc-project.") and row["FAIL_TO_PASS"]
        assert row["instance_id"].startswith(f"{row['repo']}.func_pm_{row['modifier']}__")
        assert not set(row["FAIL_TO_PASS"]) & set(row["PASS_TO_PASS"])
        assert row["patch"].startswith("diff --git a/calc/core.py b/calc/core.py")
        assert row["function"] in row["problem_statement"]
    task_set = load_task_set(str(out))
    assert isinstance(task_set, SyntheticTaskSet) and len(task_set) == 4
    for task in task_set:
        result = await validate_task(local, task)
        assert result.valid, result.problems
        assert result.empty is not None
        failing = result.empty.details["fail_to_pass"]
        assert failing["passed"] == 0  # every FAIL_TO_PASS test fails on the buggy repo


async def test_the_agent_sees_the_bug_committed(project: Path, local: SandboxBackend, tmp_path: Path) -> None:
    from patchgym.core.tasks import start_task_sandbox

    out = tmp_path / "out"
    await generate([str(project)], out, local, GenerateSettings(seed=0, max_tasks=1))
    task = next(iter(SyntheticTaskSet(out)))
    async with await start_task_sandbox(local, task) as sandbox:
        status = await sandbox.exec("git status --porcelain && git log --oneline | wc -l", timeout_s=30)
        assert status.stdout.split() == ["2"]
        current = (await sandbox.read_file("calc/core.py")).decode()
    assert current != CALC


async def test_generation_is_deterministic_given_the_seed(project: Path, local: SandboxBackend, tmp_path: Path) -> None:
    runs = []
    for concurrency, name in ((1, "a"), (3, "b")):
        await generate(
            [str(project)], tmp_path / name, local, GenerateSettings(seed=5, max_tasks=3, concurrency=concurrency)
        )
        runs.append((tmp_path / name / "instances.jsonl").read_text())
    assert runs[0] == runs[1]
    await generate([str(project)], tmp_path / "c", local, GenerateSettings(seed=6, max_tasks=3))
    assert [r["patch"] for r in instances(tmp_path / "c")] != [json.loads(x)["patch"] for x in runs[0].splitlines()]


async def test_hard_issue_texts_name_no_failing_test(project: Path, local: SandboxBackend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    await generate([str(project)], out, local, GenerateSettings(seed=2, max_tasks=3, hard=True))
    for row in instances(out):
        for test_id in row["FAIL_TO_PASS"]:
            for part in test_id.split(".")[1:]:
                assert part not in row["problem_statement"], (part, row["problem_statement"])
        assert "calc/core.py" in row["problem_statement"]


def test_an_sdist_becomes_a_snapshot(project: Path, tmp_path: Path) -> None:
    archive = tmp_path / "calc-1.0.tar.gz"
    (project / "docs").mkdir()
    (project / "docs" / "conf.py").write_text("project = 'calc'\n")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(project, arcname="calc-1.0")
    snapshot = build_snapshot(str(archive), tmp_path / "snaps")
    assert snapshot.repo_id == "local__calc-1.0" and snapshot.source_files == ("calc/__init__.py", "calc/core.py")
    assert snapshot.test_paths == ("tests",) and (snapshot.path / "tests" / "test_calc.py").is_file()
    assert snapshot.path.name == snapshot.repo


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "no-tests").mkdir()
    with pytest.raises(ConfigError, match="no tests/ or test/ directory"):
        build_snapshot(str(tmp_path / "no-tests"), tmp_path / "snaps")
    with pytest.raises(ConfigError, match="cannot use"):
        build_snapshot(str(tmp_path / "missing"), tmp_path / "snaps")
    with pytest.raises(ConfigError, match="does not exist"):
        build_snapshot("stdlib:no_such_module_here", tmp_path / "snaps")
    with pytest.raises(ConfigError, match="plain `import heapq`"):
        redirect_imports("from test.support import import_helper\nx = 1\n", "heapq")
    with pytest.raises(ConfigError, match="unknown bug modifiers"):
        GenerateSettings(modifiers=("nope",))


def test_redirect_imports_points_the_test_at_the_copy() -> None:
    source = "import textwrap\nfrom textwrap import wrap, fill\n    import textwrap\n"
    assert redirect_imports(source, "textwrap") == (
        "from pylib import textwrap\nfrom pylib.textwrap import wrap, fill\n    from pylib import textwrap\n"
    )


STDLIB_TESTS = Path(sysconfig.get_paths()["stdlib"]) / "test" / "test_colorsys.py"


@pytest.mark.skipif(not STDLIB_TESTS.is_file(), reason="this Python ships no standard-library tests")
async def test_stdlib_module_with_its_own_tests(tmp_path: Path, local: SandboxBackend) -> None:
    out = tmp_path / "out"
    report = await generate(["stdlib:colorsys"], out, local, GenerateSettings(seed=0, max_tasks=2))
    assert report.accepted == 2
    for row in instances(out):
        assert row["patch"].startswith("diff --git a/pylib/colorsys.py")
        assert all(t.startswith("tests.test_colorsys.") for t in row["FAIL_TO_PASS"] + row["PASS_TO_PASS"])
    for task in SyntheticTaskSet(out):
        assert (await validate_task(local, task)).valid


def test_cli_generates_lists_and_validates(project: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    made = runner.invoke(app, ["tasks", "generate", str(project), "--out", str(out), "--max-tasks", "2", "--json"])
    assert made.exit_code == 0, made.output
    assert json.loads(made.output)["accepted"] == 2
    listed = runner.invoke(app, ["tasks", "list", str(out), "--json"])
    assert listed.exit_code == 0 and len(json.loads(listed.output)) == 2
    checked = runner.invoke(app, ["tasks", "validate", str(out), "--json"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.output)["valid"] is True
    bad = runner.invoke(app, ["tasks", "generate", str(tmp_path / "nothing"), "--out", str(out)])
    assert bad.exit_code == 2 and "cannot use" in bad.output


def test_synthetic_is_a_registered_task_set(project: Path, tmp_path: Path) -> None:
    assert "synthetic" in registry().names("task_set")
    with pytest.raises(ConfigError, match="tasks generate"):
        registry().create("task_set", "synthetic", path=str(tmp_path))


async def test_generated_task_grades_on_docker(project: Path, tmp_path: Path) -> None:
    backend = make_backend("docker", tmp_path)
    local = LocalSandboxBackend(root_dir=tmp_path)
    try:
        out = tmp_path / "out"
        await generate([str(project)], out, local, GenerateSettings(max_tasks=1))
        result = await validate_task(backend, next(iter(SyntheticTaskSet(out))))
        assert result.valid, result.problems
    finally:
        await backend.aclose()
        await local.aclose()
