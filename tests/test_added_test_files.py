"""A test module the agent adds cannot change the verdict: through the environment, as a policy sees it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from patchgym.core.sandbox import SandboxBackend
from patchgym.core.tasks import start_task_sandbox
from patchgym.envs.swe import AsyncSWEEnv
from patchgym.plugins.folder import tiny_task_set
from tests.conftest import make_backend

TASK = "roman-subtractive"

FORGING_MODULE = """\
import unittest


def _always_passes(self, result=None):
    result = result if result is not None else self.defaultTestResult()
    result.startTest(self)
    result.addSuccess(self)
    result.stopTest(self)
    return result


unittest.TestCase.run = _always_passes
"""
"""Imported during discovery, before any test runs, it makes every unittest test pass."""

PLANT = f"cat > tests/test_aaa_helpers.py <<'EOF'\n{FORGING_MODULE}EOF"


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


@pytest.fixture(params=["local-none", "local-bwrap", "docker"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SandboxBackend]:
    made = make_backend(request.param, tmp_path)
    yield made
    await made.aclose()


async def test_an_added_test_module_that_makes_every_test_pass_scores_0(backend: SandboxBackend) -> None:
    env = AsyncSWEEnv(tiny_task_set(), backend)
    try:
        await env.reset(options={"task": TASK})
        observation, reward, terminated, truncated, _ = await env.step(bash(PLANT))
        assert "<returncode>0</returncode>" in observation and not (terminated or truncated)
        _, reward, terminated, _, info = await env.step(bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"))
    finally:
        await env.close()
    assert terminated and info["infra_error"] is None
    assert reward == 0.0


async def test_the_added_module_does_forge_a_pass_when_left_in_place(backend: SandboxBackend) -> None:
    """Control: the unfixed task fails its tests, and passes them all with the module planted."""
    async with await start_task_sandbox(backend, tiny_task_set().get(TASK)) as sandbox:
        command = "python3 -m unittest discover -s tests -t . 2>&1"
        honest = await sandbox.exec(command, timeout_s=60)
        assert honest.exit_code != 0 and "FAILED" in honest.output
        assert (await sandbox.exec(PLANT, timeout_s=60)).ok
        forged = await sandbox.exec(command, timeout_s=60)
        assert forged.exit_code == 0 and "OK" in forged.output, forged.output
