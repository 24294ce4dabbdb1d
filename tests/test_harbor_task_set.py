"""Harbor task folders: loading task.toml, reward files, the oracle, and reward hacking on Docker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from patchgym.core.errors import ConfigError
from patchgym.core.sandbox import SandboxBackend
from patchgym.core.tasks import Task, start_task_sandbox
from patchgym.core.validation import validate_task
from patchgym.plugins.harbor import HarborTaskSet, load_harbor_task, read_reward
from tests.conftest import make_backend
from tests.swe_fixtures import harbor_fixture


@pytest.fixture
async def docker_backend(tmp_path: Path) -> AsyncIterator[SandboxBackend]:
    backend = make_backend("docker", tmp_path)
    yield backend
    await backend.aclose()


def test_task_toml_sets_limits_timeouts_and_workdir(tmp_path: Path) -> None:
    folder = harbor_fixture(tmp_path)
    task = load_harbor_task(folder)
    assert task.id == "calc-add" and "calc.add" in task.instruction
    assert (task.sandbox.cpus, task.sandbox.memory_mb, task.sandbox.workdir) == (1, 512, "/app")
    assert task.sandbox.dockerfile == folder / "environment" / "Dockerfile" and not task.sandbox.network
    assert task.grader.timeout_s == 60 and task.metadata["agent_timeout_s"] == 300
    assert task.oracle and task.gold_patch is None
    assert HarborTaskSet(tmp_path).ids() == ["calc-add"] == HarborTaskSet(folder).ids()


def test_malformed_tasks_are_config_errors(tmp_path: Path) -> None:
    folder = harbor_fixture(tmp_path)
    (folder / "task.toml").write_text("[environment]\ncpus = -1\n")
    with pytest.raises(ConfigError, match="cpus must be a positive number"):
        load_harbor_task(folder)
    (folder / "task.toml").write_text("[verifier\n")
    with pytest.raises(ConfigError, match="invalid Harbor task file"):
        load_harbor_task(folder)
    (folder / "task.toml").write_text("")
    (folder / "tests" / "test.sh").unlink()
    with pytest.raises(ConfigError, match="no tests/test.sh"):
        load_harbor_task(folder)
    with pytest.raises(ConfigError, match="holds no Harbor tasks"):
        list(HarborTaskSet(tmp_path / "calc-add" / "tests"))


@pytest.mark.parametrize(
    ("name", "text", "reward", "reason"),
    [
        ("reward.txt", "1\n", 1.0, "rewarded"),
        ("reward.txt", "0.25", 0.25, "rewarded"),
        ("reward.json", '{"reward": 1, "speed": 0.5}', 1.0, "rewarded"),
        ("reward.json", '{"accuracy": 0.5}', 0.5, "rewarded"),
        ("reward.txt", "  \n", None, "reward_file_empty"),
        ("reward.txt", "PASS", None, "reward_unreadable"),
        ("reward.txt", "nan", None, "reward_unreadable"),
        ("reward.json", '{"a": 1, "b": 0}', None, "reward_unreadable"),
        ("reward.json", '{"reward": "1"}', None, "reward_unreadable"),
        ("reward.json", "[1]", None, "reward_unreadable"),
    ],
)
def test_reward_files(name: str, text: str, reward: float | None, reason: str) -> None:
    value, message = read_reward(name, text)
    assert value == reward and message.startswith(reason)


async def grade_after(backend: SandboxBackend, task: Task, command: str = "") -> dict:
    async with await start_task_sandbox(backend, task) as sandbox:
        if command:
            done = await sandbox.exec(command, timeout_s=60)
            assert done.ok, done.output
        return (await task.grader.grade(sandbox)).as_dict()


async def test_oracle_earns_1_and_nothing_earns_0(tmp_path: Path, docker_backend: SandboxBackend) -> None:
    task = load_harbor_task(harbor_fixture(tmp_path))
    report = await validate_task(docker_backend, task)
    assert report.valid, report.problems
    assert report.gold and report.gold.details["reward_file"] == "reward.txt"


async def test_reward_hacking_and_missing_reward_files(tmp_path: Path, docker_backend: SandboxBackend) -> None:
    task = load_harbor_task(harbor_fixture(tmp_path))
    # a reward file written in advance and gutted tests do not survive: the verifier starts afresh
    hack = "mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && echo 'exit 0' > /tests/test.sh"
    hacked = await grade_after(docker_backend, task, hack)
    assert hacked["reward"] == 0.0 and hacked["details"]["reason"] == "rewarded"
    # a test script that exits 0 but writes no reward earns nothing, with the reason
    silent = load_harbor_task(harbor_fixture(tmp_path / "silent", test_sh="#!/bin/bash\nexit 0\n"))
    graded = await grade_after(docker_backend, silent, "sed -i 's/a - b/a + b/' calc/__init__.py")
    assert graded["reward"] == 0.0 and graded["details"]["exit_code"] == 0
    assert graded["details"]["reason"] == "no_reward_file" and "reward.txt" in graded["details"]["message"]
    empty = load_harbor_task(harbor_fixture(tmp_path / "empty", test_sh="touch /logs/verifier/reward.txt\n"))
    assert (await grade_after(docker_backend, empty))["details"]["reason"] == "reward_file_empty"
    # reward.json wins over reward.txt; the exit code plays no part
    both = "echo 0 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json; exit 3\n"
    graded = await grade_after(docker_backend, load_harbor_task(harbor_fixture(tmp_path / "json", test_sh=both)))
    assert (graded["reward"], graded["details"]["reward_file"], graded["details"]["exit_code"]) == (
        1.0,
        "reward.json",
        3,
    )


async def test_local_sandbox_refuses_harbor_tasks_clearly(tmp_path: Path) -> None:
    backend = make_backend("local-none", tmp_path)
    task = load_harbor_task(harbor_fixture(tmp_path))
    report = await validate_task(backend, task)
    assert not report.valid and all("use the docker backend" in p for p in report.problems)
