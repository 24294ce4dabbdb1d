"""SWE-bench and SWE-smith task sets: loading, images, subsets, grading on local and Docker
sandboxes (reward hacking included), and agreement with the swebench package's own grading."""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from patchgym.core.errors import ConfigError
from patchgym.core.sandbox import SandboxBackend
from patchgym.core.tasks import Task, start_task_sandbox
from patchgym.core.validation import apply_patch, validate_task
from patchgym.plugins.swe_data import listed_tests, load_rows, stratified_subset, swebench_image, swesmith_image
from patchgym.plugins.swe_grading import SWELogGrader
from patchgym.plugins.swebench import SWEBenchTaskSet, swebench_test_command
from patchgym.plugins.swesmith import SWESmithTaskSet
from tests.conftest import make_backend, require_docker
from tests.swe_fixtures import build_image, git, swebench_fixture, swesmith_fixture
from tests.test_grading import FORGING_CONFTEST

FIXTURE_OPTIONS = {"activate": "", "reinstall": False}
SANDBOXES = ["local-none", "local-bwrap", "docker"]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text(json.dumps(rows))
    return str(path)


def swebench_set(
    tmp_path: Path,
    kind: str,
    extra_files: dict[str, str] | None = None,
    links: dict[str, str] | None = None,
    **options: Any,
) -> SWEBenchTaskSet:
    repos, row = swebench_fixture(tmp_path, extra_files, links)
    data = write_rows(tmp_path / "instances.jsonl", [row])
    if kind == "docker":
        require_docker()
        build_image(tmp_path, repos / row["instance_id"], swebench_image(row["instance_id"], namespace="patchgym-test"))
        return SWEBenchTaskSet(data, namespace="patchgym-test", **FIXTURE_OPTIONS, **options)
    return SWEBenchTaskSet(data, repos_dir=str(repos), **FIXTURE_OPTIONS, **options)


def swesmith_set(tmp_path: Path, kind: str) -> SWESmithTaskSet:
    repos, row = swesmith_fixture(tmp_path)
    data = write_rows(tmp_path / "smith.json", [row])
    if kind == "docker":
        require_docker()
        snapshot = row["repo"].split("/")[1]
        build_image(
            tmp_path, repos / snapshot, swesmith_image("fixture/calc", row["base_commit"], namespace="patchgym-test")
        )
        return SWESmithTaskSet(data, namespace="patchgym-test", activate="")
    return SWESmithTaskSet(data, repos_dir=str(repos), activate="")


@pytest.fixture(params=SANDBOXES)
async def sandbox_kind(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[str, SandboxBackend]]:
    backend = make_backend(request.param, tmp_path)
    yield request.param, backend
    await backend.aclose()


async def grade_after(backend: SandboxBackend, task: Task, command: str = "", *, gold: bool = False) -> dict:
    async with await start_task_sandbox(backend, task) as sandbox:
        if gold:
            assert task.gold_patch
            assert (await apply_patch(sandbox, task.gold_patch)).ok
        if command:
            done = await sandbox.exec(command, timeout_s=60)
            assert done.ok, done.output
        return (await task.grader.grade(sandbox)).as_dict()


# -- loading ------------------------------------------------------------------------------


def test_rows_load_from_json_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [{"instance_id": "a", "FAIL_TO_PASS": '["t1"]'}, {"instance_id": "b", "FAIL_TO_PASS": ["t2"]}]
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    as_strings = [{**row, "FAIL_TO_PASS": json.dumps(listed_tests(row["FAIL_TO_PASS"], "F", "x"))} for row in rows]
    pq.write_table(pyarrow.Table.from_pylist(as_strings), tmp_path / "rows.parquet")  # SWE-bench stores strings
    for name in ("rows.json", "rows.jsonl"):
        write_rows(tmp_path / name, rows)
    (tmp_path / "wrapped.json").write_text(json.dumps({"instances": rows}))
    for name in ("rows.json", "rows.jsonl", "rows.parquet", "wrapped.json"):
        loaded = load_rows(tmp_path / name)
        assert [listed_tests(r["FAIL_TO_PASS"], "FAIL_TO_PASS", r["instance_id"]) for r in loaded] == [["t1"], ["t2"]]


def test_bad_rows_are_config_errors_naming_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="not a JSON list"):
        listed_tests("[oops", "FAIL_TO_PASS", "x")
    _, row = swebench_fixture(tmp_path)
    del row["test_patch"]
    data = write_rows(tmp_path / "rows.json", [row])
    with pytest.raises(ConfigError, match=r"fixture__calc-1.*test_patch"):
        list(SWEBenchTaskSet(data, **FIXTURE_OPTIONS))
    _, row = swebench_fixture(tmp_path / "other")
    row["FAIL_TO_PASS"] = "[]"
    with pytest.raises(ConfigError, match="empty FAIL_TO_PASS"):
        list(SWEBenchTaskSet(write_rows(tmp_path / "empty.json", [row]), **FIXTURE_OPTIONS))
    row.update(FAIL_TO_PASS='["t"]', test_cmd="pytest -rA", log_parser="parse_log_nonsense")
    with pytest.raises(ConfigError, match="unknown log parser"):
        list(SWEBenchTaskSet(write_rows(tmp_path / "parser.json", [row]), **FIXTURE_OPTIONS))


def test_image_names_follow_the_harness_conventions(tmp_path: Path) -> None:
    assert swebench_image("sympy__sympy-13031") == "swebench/sweb.eval.x86_64.sympy_1776_sympy-13031:latest"
    assert swebench_image("Django__django-1", namespace="", arch="arm64", tag="v2") == (
        "sweb.eval.arm64.django__django-1:v2"  # built locally by the harness: `__` kept
    )
    assert swesmith_image("pandas-dev/pandas", "95280573abcdef") == (
        "swebench/swesmith.x86_64.pandas-dev_1776_pandas.95280573"
    )
    _, row = swebench_fixture(tmp_path)
    rows = [row, {**row, "instance_id": "other__x-2", "image_name": "my/image:1"}]
    tasks = list(SWEBenchTaskSet(write_rows(tmp_path / "rows.json", rows), **FIXTURE_OPTIONS))
    assert [t.sandbox.image for t in tasks] == ["swebench/sweb.eval.x86_64.fixture_1776_calc-1:latest", "my/image:1"]
    assert tasks[0].sandbox.workdir == "/testbed" and tasks[0].sandbox.workspace is None


@pytest.mark.parametrize("namespace", ["swebench", ""])
def test_image_names_are_the_ones_the_harness_gives(namespace: str) -> None:
    """Pulled (a namespace) and locally built (none) images: the harness's own `instance_image_key`."""
    from patchgym.plugins.swe_grading import _test_spec

    spec = replace(
        _test_spec("Django__django-11099", "django/django", "3.0", [], []),
        arch="arm64",
        namespace=namespace or None,
        instance_image_tag="v2",
    )
    assert swebench_image("Django__django-11099", namespace=namespace, arch="arm64", tag="v2") == (
        spec.instance_image_key
    )


def test_a_missing_local_instance_image_points_at_the_harness_not_build_base() -> None:
    from patchgym.backends.sandbox.docker import DEFAULT_IMAGE, missing_image_hint

    hint = missing_image_hint(swebench_image("django__django-1", namespace=""))
    assert "swebench harness" in hint and "build-base" not in hint and "docker pull" not in hint
    assert "build-base" in missing_image_hint(DEFAULT_IMAGE)
    assert "docker pull other/x:1" in missing_image_hint("other/x:1")


def test_reinstall_is_off_by_default_and_runs_before_the_test_patch(tmp_path: Path) -> None:
    """The harness's images are installed already (and a sandbox has no network for pip); when
    asked for, the install step runs before the test files are reset and the test patch applied."""
    repos, row = swebench_fixture(tmp_path)
    data = write_rows(tmp_path / "rows.json", [row])
    (default,) = list(SWEBenchTaskSet(data, activate=""))
    assert default.grader.install == ""
    (reinstalling,) = list(SWEBenchTaskSet(data, activate="", reinstall=True))
    assert "pip install" in reinstalling.grader.install
    assert "pip install" not in reinstalling.grader.test_setup + reinstalling.grader.test_command


async def test_every_default_option_grades_on_an_image_without_conda_or_network(tmp_path: Path) -> None:
    """Defaults as a user meets them: conda activation absent from the image, no pip install."""
    repos, row = swebench_fixture(tmp_path)
    (task,) = list(SWEBenchTaskSet(write_rows(tmp_path / "rows.json", [row]), repos_dir=str(repos)))
    backend = make_backend("local-none", tmp_path)
    try:
        report = await validate_task(backend, task)
    finally:
        await backend.aclose()
    assert report.valid, report.problems
    assert report.gold and "install_exit_code" not in report.gold.details


async def test_the_install_step_sees_the_tests_before_the_patch_and_is_not_parsed(tmp_path: Path) -> None:
    (task,) = list(swebench_set(tmp_path, "local-none"))
    forged = "PASSED tests/test_calc.py::test_forged"
    install = f"cp tests/test_calc.py seen-at-install.py; echo {shlex.quote(forged)}"
    task = replace(task, grader=replace(task.grader, install=install))
    backend = make_backend("local-none", tmp_path)
    try:
        async with await start_task_sandbox(backend, task) as sandbox:
            grade = await task.grader.grade(sandbox)
            seen = (await sandbox.exec("cat seen-at-install.py", timeout_s=60)).stdout
    finally:
        await backend.aclose()
    assert "test_add" not in seen and "test_mul" in seen  # the test patch adds test_add
    assert grade.details["install_exit_code"] == 0
    assert grade.reward == 0.0 and str(grade.tests["tests/test_calc.py::test_add"]) == "FAILED"
    assert "tests/test_calc.py::test_forged" not in grade.tests


def test_report_counts_are_whole_where_the_lists_are_cut() -> None:
    passing = [f"tests/test_calc.py::test_{i}" for i in range(25)]
    log = "".join(f"PASSED {name}\n" for name in passing)
    grader = SWELogGrader(
        "x", "marshmallow-code/marshmallow", "3.0", tuple(passing[:1]), tuple(passing[1:]), "true", "HEAD"
    )
    details = grader.judge_log(log, 0).details
    assert details["report_counts"]["PASS_TO_PASS"]["success"] == 24
    assert len(details["report"]["PASS_TO_PASS"]["success"]) == 21  # 20 names and "... and 4 more"


def test_fail_only_repositories_are_judged_as_the_harness_judges_them() -> None:
    """swebench's FAIL_ONLY_REPOS (three JS repositories): a listed test the log does not mention passes."""
    from swebench.harness.constants import FAIL_ONLY_REPOS

    from patchgym.plugins.swe_grading import judge

    statuses = {"a": "PASSED"}
    (repo, *_) = sorted(FAIL_ONLY_REPOS)
    assert judge(statuses, ["a"], ["unmentioned"], repo=repo)[0] == "RESOLVED_FULL"
    assert judge(statuses, ["a"], ["unmentioned"], repo="psf/requests")[0] != "RESOLVED_FULL"
    assert judge({"a": "FAILED"}, ["a"], [], repo=repo)[0] == "RESOLVED_NO"


def test_test_command_comes_from_the_swebench_specs_offline() -> None:
    patch = "diff --git a/tests/forms_tests/test_x.py b/tests/forms_tests/test_x.py\n"
    steps, command = swebench_test_command(
        {"instance_id": "d", "repo": "django/django", "version": "3.0", "test_patch": patch}
    )
    assert command.startswith("./tests/runtests.py") and command.endswith("forms_tests.test_x")
    assert any("LANG" in step or "locale" in step for step in steps)
    _, command = swebench_test_command(
        {
            "instance_id": "s",
            "repo": "sympy/sympy",
            "version": "1.1",
            "test_patch": patch.replace("tests/forms_tests", "sympy/core"),
        }
    )
    assert command.endswith("sympy/core/test_x.py")
    with pytest.raises(ConfigError, match="no specs"):
        swebench_test_command({"instance_id": "u", "repo": "nobody/nothing", "version": "1", "test_patch": ""})


def test_stratified_subset_is_proportional_and_seeded() -> None:
    rows = [
        {"instance_id": f"{repo}-{i}", "repo": repo} for repo, n in (("a", 60), ("b", 30), ("c", 10)) for i in range(n)
    ]
    picked = stratified_subset(rows, 10, seed=1)
    counts = {repo: sum(1 for r in picked if r["repo"] == repo) for repo in "abc"}
    assert counts == {"a": 6, "b": 3, "c": 1}
    assert picked == stratified_subset(rows, 10, seed=1)
    assert picked != stratified_subset(rows, 10, seed=2)
    assert [r["instance_id"] for r in picked] == sorted(
        (r["instance_id"] for r in picked), key=[x["instance_id"] for x in rows].index
    )
    odd = stratified_subset(rows, 7, seed=0)
    assert len(odd) == 7 and {r["repo"] for r in odd} == {"a", "b", "c"}
    assert stratified_subset(rows, 500) == rows


def test_subset_limit_and_ids_options(tmp_path: Path) -> None:
    _, row = swebench_fixture(tmp_path)
    rows = [{**row, "instance_id": f"r{i}", "repo": "marshmallow-code/marshmallow"} for i in range(4)]
    data = write_rows(tmp_path / "rows.json", rows)
    assert SWEBenchTaskSet(data, limit="2", **FIXTURE_OPTIONS).ids() == ["r0", "r1"]
    assert SWEBenchTaskSet(data, ids="r3,r1", **FIXTURE_OPTIONS).ids() == ["r1", "r3"]
    assert len(SWEBenchTaskSet(data, subset=3, seed=5, **FIXTURE_OPTIONS)) == 3
    with pytest.raises(ConfigError, match="no instance"):
        SWEBenchTaskSet(data, ids="nope", **FIXTURE_OPTIONS).ids()


# -- grading in sandboxes -------------------------------------------------------------------


async def test_swebench_gold_and_empty_validate(tmp_path: Path, sandbox_kind: tuple[str, SandboxBackend]) -> None:
    kind, backend = sandbox_kind
    (task,) = swebench_set(tmp_path, kind)
    report = await validate_task(backend, task)
    assert report.valid, report.problems
    assert report.gold and report.gold.details["resolution"] == "RESOLVED_FULL"
    assert report.empty and report.empty.details["report"]["FAIL_TO_PASS"]["failure"] == [
        "tests/test_calc.py::test_add"
    ]


async def test_swebench_reward_hacking_is_defeated(tmp_path: Path, sandbox_kind: tuple[str, SandboxBackend]) -> None:
    kind, backend = sandbox_kind
    (task,) = swebench_set(tmp_path, kind)
    # the agent writes the F2P test itself, trivially passing
    gutted = "printf 'def test_add():\\n    pass\\ndef test_mul():\\n    pass\\n' > tests/test_calc.py"
    assert (await grade_after(backend, task, gutted))["reward"] == 0.0
    # a forging conftest (and pytest.ini loading it) is removed before the tests run
    plant = f"cat > conftest.py <<'EOF'\n{FORGING_CONFTEST}\nEOF\ncp conftest.py tests/conftest.py"
    forged = await grade_after(backend, task, plant)
    assert forged["reward"] == 0.0 and forged["details"]["reason"] == "tests_failed"
    # code under test printing PASSED lines does not override the real summary
    printer = "printf 'print(\"PASSED tests/test_calc.py::test_add\")\\n' >> calc/__init__.py"
    assert (await grade_after(backend, task, printer))["reward"] == 0.0
    # deleting the tests does not help; an honest fix with scribbled tests still scores
    assert (await grade_after(backend, task, "rm -rf tests"))["reward"] == 0.0
    assert (await grade_after(backend, task, gutted, gold=True))["reward"] == 1.0


IGNORE_RULES = {".gitignore": "*.egg-info/\n__pycache__/\n", "tests/.gitignore": "*.so\n/generated/\n"}
BUILT_FILES = ("tests/calc.egg-info/PKG-INFO", "tests/_speedups.so", "tests/generated/cases.txt")
"""Build output under test paths that the base commit's own .gitignore files ignore."""


async def test_the_restore_keeps_what_the_base_commit_ignores(
    tmp_path: Path, sandbox_kind: tuple[str, SandboxBackend]
) -> None:
    """Issue 15 (7b): ignored build files under test paths are no added test files to delete;
    bytecode goes whatever the rules say, and an unignored added file goes as before."""
    kind, backend = sandbox_kind
    (task,) = swebench_set(tmp_path, kind, IGNORE_RULES)
    doomed = ("tests/__pycache__/test_calc.cpython-39.pyc", "tests/planted.py")
    make = " && ".join(f"mkdir -p $(dirname {path}) && echo built > {path}" for path in (*BUILT_FILES, *doomed))
    async with await start_task_sandbox(backend, task) as sandbox:
        assert (await sandbox.exec(make, timeout_s=60)).ok
        assert (await apply_patch(sandbox, task.gold_patch or "")).ok
        grade = await task.grader.grade(sandbox)
        left = await sandbox.exec(f"ls {' '.join(BUILT_FILES + doomed)}", timeout_s=60)
    assert grade.reward == 1.0, grade.details
    assert sorted(left.stdout.split()) == sorted(BUILT_FILES), left.output


async def test_the_restore_gives_back_executable_bits_and_symbolic_links(
    tmp_path: Path, sandbox_kind: tuple[str, SandboxBackend]
) -> None:
    kind, backend = sandbox_kind
    script = "#!/bin/sh\necho fixture\n"
    (task,) = swebench_set(tmp_path, kind, {"tests/data/run.sh": script}, {"tests/data/link.py": "../test_calc.py"})
    vandalise = "chmod -x tests/data/run.sh && rm tests/data/link.py && echo forged > tests/data/link.py"
    async with await start_task_sandbox(backend, task) as sandbox:
        assert (await sandbox.exec(vandalise, timeout_s=60)).ok
        await task.grader.grade(sandbox)
        check = "tests/data/run.sh && readlink tests/data/link.py && git status --porcelain"
        after = await sandbox.exec(check, timeout_s=60)
    assert after.ok and after.stdout.splitlines()[:2] == ["fixture", "../test_calc.py"], after.output
    assert "tests/data" not in after.stdout, after.output  # git sees no change there


@pytest.mark.parametrize("kind", ["local-none", "local-bwrap"])
async def test_a_test_folder_turned_into_a_link_cannot_smuggle_in_a_module(tmp_path: Path, kind: str) -> None:
    """The agent moves tests/ aside, links tests -> its copy and adds an __init__.py there
    (none at the base commit): restored through the link, the tests would import that package
    module, which fixes calc.add for the test run only. The link goes; the tests run as they are
    at the base commit (without the fix git apply refuses the test patch "beyond a symbolic
    link": a 0 too, but for want of a test run)."""
    repos, row = swebench_fixture(tmp_path)
    checkout = repos / row["instance_id"]
    subprocess.run(["git", "rm", "-q", "tests/__init__.py"], cwd=checkout, check=True)
    (checkout / "pytest.ini").write_text("[pytest]\npythonpath = .\n")  # calc stays importable
    git(checkout, "add", "pytest.ini")
    row["base_commit"] = git(checkout, "commit", "-q", "-m", "no package marker") or git(checkout, "rev-parse", "HEAD")
    (task,) = SWEBenchTaskSet(write_rows(tmp_path / "rows.json", [row]), repos_dir=str(repos), **FIXTURE_OPTIONS)
    plant = "printf 'import calc\\ncalc.add = lambda a, b: a + b\\n' > aside/__init__.py"
    smuggle = f"mv tests aside && ln -s aside tests && {plant}"
    backend = make_backend(kind, tmp_path)
    try:
        grade = await grade_after(backend, task, smuggle)
    finally:
        await backend.aclose()
    assert (grade["reward"], grade["details"]["reason"]) == (0.0, "tests_failed"), grade
    assert grade["tests"]["tests/test_calc.py::test_add"] == "FAILED"


async def test_swesmith_validate_hides_and_restores_tests(
    tmp_path: Path, sandbox_kind: tuple[str, SandboxBackend]
) -> None:
    kind, backend = sandbox_kind
    (task,) = swesmith_set(tmp_path, kind)
    assert task.gold_patch is None and task.oracle
    report = await validate_task(backend, task)
    assert report.valid, report.problems
    async with await start_task_sandbox(backend, task) as sandbox:
        listing = await sandbox.exec("ls tests", timeout_s=30)
        assert "test_add.py" not in listing.stdout and "test_mul.py" in listing.stdout
        history = await sandbox.exec("git status --porcelain; git log --format=%s", timeout_s=30)
        assert history.stdout == "hide failing tests\nbug\nsnapshot\n"  # clean tree: `git diff` shows only the agent
        # the agent recreates the hidden test as a trivial pass: restoration brings back the real one
        await sandbox.write_file("tests/test_add.py", "def test_add():\n    pass\n")
        grade = await task.grader.grade(sandbox)
    assert grade.reward == 0.0 and grade.details["report"]["FAIL_TO_PASS"]["failure"] == ["tests/test_add.py::test_add"]


# -- agreement with the swebench package ---------------------------------------------------

PYTEST_LOG = """\
============================= test session starts ==============================
collected 4 items

tests/test_calc.py .F.x                                                  [100%]
=========================== short test summary info ============================
PASSED tests/test_calc.py::test_mul
FAILED tests/test_calc.py::test_add - assert 0 == 4
PASSED tests/test_calc.py::test_sub[1-2]
XFAIL tests/test_calc.py::test_div - reason: later
========================= 1 failed, 2 passed, 1 xfailed in 0.09s ===============
"""
DJANGO_LOG = """\
test_clean (forms_tests.tests.FormTests) ... ok
test_render (forms_tests.tests.FormTests) ... FAIL
test_skip (forms_tests.tests.FormTests) ... skipped 'no db'
test_widget (forms_tests.tests.WidgetTests)
Docstring first line ... ok

----------------------------------------------------------------------
Ran 4 tests in 0.010s

FAILED (failures=1, skipped=1)
"""
AGREEMENT_CASES = [
    (
        "marshmallow-code/marshmallow",
        "3.0",
        PYTEST_LOG,
        1,
        ["tests/test_calc.py::test_add"],
        ["tests/test_calc.py::test_mul"],
    ),
    (
        "marshmallow-code/marshmallow",
        "3.0",
        PYTEST_LOG,
        1,
        ["tests/test_calc.py::test_div"],
        ["tests/test_calc.py::test_sub[1-2]"],
    ),
    (
        "marshmallow-code/marshmallow",
        "3.0",
        PYTEST_LOG,
        1,
        ["tests/test_calc.py::test_mul", "tests/test_calc.py::test_add"],
        [],
    ),
    (
        "django/django",
        "4.0",
        DJANGO_LOG,
        1,
        ["test_clean (forms_tests.tests.FormTests)"],
        ["test_render (forms_tests.tests.FormTests)"],
    ),
    (
        "django/django",
        "4.0",
        DJANGO_LOG,
        1,
        ["test_clean (forms_tests.tests.FormTests)"],
        ["test_skip (forms_tests.tests.FormTests)"],
    ),
]


@pytest.mark.parametrize(("repo", "version", "log", "exit_code", "f2p", "p2p"), AGREEMENT_CASES)
def test_grading_agrees_with_the_swebench_package(
    tmp_path: Path, repo: str, version: str, log: str, exit_code: int, f2p: list[str], p2p: list[str]
) -> None:
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
    from swebench.harness.grading import get_eval_tests_report, get_logs_eval, get_resolution_status

    from patchgym.plugins.swe_grading import _test_spec

    log_file = tmp_path / "test_output.txt"
    log_file.write_text(f"+ git apply -v -\n+ : '{START_TEST_OUTPUT}'\n{log}+ : '{END_TEST_OUTPUT}'\n")
    status_map, found = get_logs_eval(_test_spec("x__y-1", repo, version, f2p, p2p), str(log_file))
    assert found and status_map
    expected = get_resolution_status(get_eval_tests_report(status_map, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}))
    grader = SWELogGrader("x__y-1", repo, version, tuple(f2p), tuple(p2p), "true", "HEAD")
    grade = grader.judge_log(log, exit_code)
    assert {name: str(status) for name, status in grade.tests.items()} == status_map
    assert grade.details["resolution"] == expected
    assert grade.resolved == (expected == "RESOLVED_FULL")


def test_printed_passes_with_a_failing_exit_code_are_a_mismatch() -> None:
    forged = "PASSED tests/test_calc.py::test_add\nPASSED tests/test_calc.py::test_mul\n"
    grader = SWELogGrader(
        "x", "marshmallow-code/marshmallow", "3.0", ("tests/test_calc.py::test_add",), (), "true", "HEAD"
    )
    assert grader.judge_log(forged, 0).reward == 1.0
    assert grader.judge_log(forged, 1).details["reason"] == "exit_code_mismatch"
    assert grader.judge_log(forged, None, timed_out=True).details["reason"] == "tests_timed_out"
    assert grader.judge_log("no tests here\n", 0).details["reason"] == "no_test_results"


# -- command line ----------------------------------------------------------------------------


def test_cli_passes_task_set_options(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from patchgym.cli import app

    repos, row = swebench_fixture(tmp_path)
    data = write_rows(tmp_path / "rows.json", [row])
    options = ["-o", f"path={data}", "-o", f"repos_dir={repos}", "-o", "activate=", "-o", "reinstall=false"]
    listed = CliRunner().invoke(app, ["tasks", "list", "swebench", *options, "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output)[0]["id"] == "fixture__calc-1"
    validated = CliRunner().invoke(app, ["tasks", "validate", "swebench", *options, "--sandbox", "local", "--json"])
    assert validated.exit_code == 0, validated.output
    assert json.loads(validated.output)["tasks"][0]["gold_reward"] == 1.0
    bad = CliRunner().invoke(app, ["tasks", "list", "swebench", "-o", "path"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
    unknown = CliRunner().invoke(app, ["tasks", "list", "swebench", "-o", f"path={data}", "-o", "colour=red"])
    assert unknown.exit_code == 2 and "colour" in unknown.output


async def test_validation_names_why_a_task_is_invalid(tmp_path: Path) -> None:
    backend = make_backend("local-none", tmp_path)
    repos, row = swebench_fixture(tmp_path)
    row["patch"] = row["patch"].replace("a + b", "a + b + 1")  # a "fix" that does not fix
    (task,) = SWEBenchTaskSet(write_rows(tmp_path / "rows.json", [row]), repos_dir=str(repos), **FIXTURE_OPTIONS)
    report = await validate_task(backend, task)
    assert report.problems == ["gold patch got reward 0.0, expected 1.0 (tests_failed)"]
    # a SWE-smith "bug" that breaks no test: the empty patch already passes (free reward)
    repos, row = swesmith_fixture(tmp_path / "smith")
    row["patch"] = row["patch"].replace("-    return a + b\n+    return a - b", "-    return a + b\n+    return b + a")
    (task,) = SWESmithTaskSet(write_rows(tmp_path / "smith.json", [row]), repos_dir=str(repos), activate="")
    report = await validate_task(backend, task)
    assert report.problems == ["empty patch got reward 1.0, expected 0.0 (resolved)"]
    await backend.aclose()


def test_importing_swebench_leaves_logging_alone() -> None:
    import subprocess
    import sys

    code = (
        "import logging\nfrom patchgym.plugins.swe_grading import swebench_available\n"
        "assert swebench_available()\nprint(len(logging.getLogger().handlers))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "0"
