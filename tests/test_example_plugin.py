"""The example plugin distribution examples/acme-patchgym, as its users meet it, and docs/plugins.md.

CI installs the example into the test virtualenv (`.ci/run`); these tests then run what a user
of it runs: `patchgym plugins`, `patchgym tasks validate` on its task set, its own test suite
(patchgym's sandbox conformance suite against its sandbox backend, among others) and a short
`patchgym run` naming its task set, sandbox backend and inference backend. Outside CI they skip
when the example is not installed (`pip install ./examples/acme-patchgym`).

The last tests make a broken plugin and check that the errors docs/plugins.md shows are the
ones the user sees.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from patchgym.testing.sandbox import SandboxConformance
from tests.conftest import require_train_extra

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "acme-patchgym"
GUIDE = ROOT / "docs" / "plugins.md"
ACME_NAMES = ["task set:acme-ledger", "sandbox backend:acme-team", "inference backend:acme-scripted"]


@pytest.fixture(scope="module", autouse=True)
def acme_installed() -> None:
    if importlib.util.find_spec("acme_patchgym") is not None:
        return
    message = f"the example plugin is not installed: pip install {EXAMPLE}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (.ci/run installs it)")
    pytest.skip(message)


def patchgym(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `patchgym` command in a fresh process, as a user runs it."""
    plain = {k: v for k, v in os.environ.items() if k not in ("PATCHGYM_PLUGINS", "PATCHGYM_DISABLE_PLUGINS")}
    return subprocess.run(
        [sys.executable, "-m", "patchgym.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**plain, "COLUMNS": "200", **(env or {})},
        timeout=900,
    )


def test_plugins_command_lists_the_example(tmp_path: Path) -> None:
    listed = patchgym("plugins", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    acme = {r["name"]: r for r in report["plugins"]}["acme"]
    assert acme["status"] == "loaded" and acme["error"] is None, acme
    assert acme["registered"] == ACME_NAMES
    assert re.search(r"acme[-_]patchgym 0\.1\.0", acme["source"]), acme["source"]
    assert report["conflicts"] == []
    table = patchgym("plugins", cwd=tmp_path)
    assert table.returncode == 0 and "acme-ledger" in table.stdout and "acme-scripted" in table.stdout


def test_tasks_validate_on_the_example_sandbox(tmp_path: Path) -> None:
    checked = patchgym(
        "tasks", "validate", "acme-ledger", "-o", "count=3", "-o", "seed=7", "--sandbox", "acme-team", "--json",
        cwd=tmp_path,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads(checked.stdout)
    assert report["valid"] is True
    rows = report["tasks"]
    assert [r["task_id"] for r in rows] == [f"acme-ledger-7-{i:03d}" for i in range(3)]
    assert all(r["gold_reward"] == 1.0 and r["empty_reward"] == 0.0 for r in rows), rows


def test_example_test_suite_passes() -> None:
    """The example's own tests: the sandbox, task-set and inference suites of patchgym.testing on its parts."""
    require_train_extra()  # its scripted engine loads a tokenizer
    suite = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=EXAMPLE,
        timeout=1200,
    )
    assert suite.returncode == 0, suite.stdout[-6000:] + suite.stderr[-2000:]
    passed = set(re.findall(r"::(\w+::test_\w+)(?:\[[^\]]*\])? PASSED", suite.stdout))
    contract = {f"TestAcmeTeamSandbox::{name}" for name in dir(SandboxConformance) if name.startswith("test_")}
    assert len(contract) >= 15 and contract <= passed, sorted(contract - passed)
    assert "TestScriptedEngine::test_pause_holds_new_generations_until_resume" in passed
    assert not re.search(r"\b(SKIPPED|FAILED|ERROR)\b", suite.stdout), suite.stdout[-4000:]


def test_short_run_with_the_three_example_plugins(tmp_path: Path) -> None:
    require_train_extra()
    config = yaml.safe_load((EXAMPLE / "acme-run.yaml").read_text())
    assert (config["tasks"]["train"]["name"], config["sandbox"]["name"], config["inference"]["name"]) == (
        "acme-ledger",
        "acme-team",
        "acme-scripted",
    )
    config["run_dir"] = str(tmp_path / "run")
    (tmp_path / "acme.yaml").write_text(yaml.safe_dump(config))
    ran = patchgym("run", "acme.yaml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    evals = {e["stage"]: e for e in events if e["kind"] == "eval"}
    assert set(evals) == {"base", "grpo"}
    assert all(e["infra_errors"] == 0 and e["tasks"] == 4 for e in evals.values()), evals
    assert evals["base"]["pass_at_1"] > 0 and evals["grpo"]["pass_at_1"] > 0, evals
    steps = [e for e in events if e["kind"] == "step"]
    assert len(steps) == 1 and steps[0]["trajectories"] == 8
    trajectories = [e for e in events if e["kind"] == "trajectory"]
    assert trajectories and all(t["turns"] == 3 and t["termination"] == "submitted" for t in trajectories)
    assert any(t["reward"] == 1.0 for t in trajectories)
