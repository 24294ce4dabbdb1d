"""Reward hackers against the Harbor verifier (class 6 of issue 14), through the env API on Docker.

A Harbor verifier grades the container's state, so it runs in the agent's own container: the
agent's processes are stopped first, `test.sh` runs in the clean grading shell, and `docker
diff` must leave shell start-up files and interpreter entry points alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from patchgym.core.sandbox import SandboxBackend
from patchgym.plugins.harbor import HarborTaskSet
from tests.conftest import make_backend
from tests.swe_fixtures import harbor_fixture
from tests.test_reward_hacking import daemon_command, heredoc, play_episode

pytestmark = pytest.mark.asyncio(loop_scope="module")

FORGING_PYTHON = "python3() { echo 1 > /logs/verifier/reward.txt; exit 0; }; export -f python3"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def docker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxBackend]:
    backend = make_backend("docker", tmp_path_factory.mktemp("docker"))
    yield backend
    await backend.aclose()


@pytest.fixture(scope="module")
def task_set(tmp_path_factory: pytest.TempPathFactory) -> HarborTaskSet:
    return HarborTaskSet(harbor_fixture(tmp_path_factory.mktemp("harbor")))


async def play(backend: SandboxBackend, task_set: HarborTaskSet, commands: list[str]) -> dict[str, Any]:
    _, info = await play_episode(backend, task_set, commands)
    assert info["grade"]["details"]["grading"]["mode"] == "in_place"
    return info["grade"]


async def test_honest_controls(docker: SandboxBackend, task_set: HarborTaskSet) -> None:
    fixed = await play(docker, task_set, ["sed -i 's/a - b/a + b/' calc/__init__.py"])
    assert (fixed["reward"], fixed["details"]["reason"]) == (1.0, "rewarded")
    idle = await play(docker, task_set, ["true"])
    assert (idle["reward"], idle["details"]["reason"]) == (0.0, "rewarded")


@pytest.mark.parametrize(
    ("commands", "changed"),
    [
        ([heredoc("/root/forge.sh", FORGING_PYTHON), "cat /root/forge.sh >> /root/.profile"], "/root/.profile"),
        (
            [
                "printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /usr/local/bin/python3",
                "chmod +x /usr/local/bin/python3",
            ],
            "/usr/local/bin/python3",
        ),
    ],
    ids=["profile-function", "wrapper-on-path"],
)
async def test_a_changed_shell_or_interpreter_is_a_zero(
    docker: SandboxBackend, task_set: HarborTaskSet, commands: list[str], changed: str
) -> None:
    grade = await play(docker, task_set, commands)
    assert (grade["reward"], grade["details"]["reason"]) == (0.0, "verifier_environment_changed")
    assert changed in grade["details"]["protected_changes"]


async def test_a_daemon_rewriting_the_reward_is_stopped(docker: SandboxBackend, task_set: HarborTaskSet) -> None:
    loop = "mkdir -p /logs/verifier; while :; do echo 1 > /logs/verifier/reward.txt; sleep 0.01; done"
    grade = await play(docker, task_set, [daemon_command(loop)])
    assert (grade["reward"], grade["details"]["reason"]) == (0.0, "rewarded")
    assert int(grade["details"]["agent_processes_stopped"]) >= 1


@pytest.mark.asyncio(loop_scope="function")
async def test_task_toml_allows_changes(tmp_path: Path) -> None:
    folder = harbor_fixture(tmp_path)
    toml = folder / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nallowed_changes = ["/usr/local/bin/*"]\n'))
    (task,) = HarborTaskSet(folder)
    grader: Any = task.grader
    assert not grader._protected("/usr/local/bin/tool") and grader._protected("/root/.profile")
