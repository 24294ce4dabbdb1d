"""The SWE environment end to end on the tiny task set and the local sandbox."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import patchgym
from patchgym.core.errors import ConfigError
from patchgym.core.sandbox import SandboxSpec
from patchgym.core.tasks import Task, TaskSet
from patchgym.core.validation import apply_patch_command
from patchgym.envs.swe import AsyncSWEEnv
from patchgym.plugins.folder import tiny_task_set

SUBMIT = "Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"


def bash(command: str) -> str:
    return f"I will run this.\n```bash\n{command}\n```"


def gold_action(task_id: str = "roman-subtractive") -> str:
    patch = tiny_task_set().get(task_id).gold_patch
    assert patch
    return bash(apply_patch_command(patch))


@pytest.fixture
async def env() -> AsyncIterator[AsyncSWEEnv]:
    environment = AsyncSWEEnv("tiny", "local")
    yield environment
    await environment.close()


@pytest.fixture
def sync_env() -> Iterator[gymnasium.Env]:
    environment = gymnasium.make(patchgym.ENV_ID, task_set="tiny", sandbox="local")
    yield environment
    environment.close()


def test_gymnasium_env_checker_passes(sync_env: gymnasium.Env) -> None:
    check_env(sync_env.unwrapped, skip_render_check=True)


def test_sync_oracle_episode_earns_reward_1(sync_env: gymnasium.Env) -> None:
    observation, info = sync_env.reset(seed=0, options={"task": "roman-subtractive"})
    assert "from_roman" in observation and info["messages"][0]["role"] == "system"
    observation, reward, terminated, truncated, info = sync_env.step(gold_action())
    assert "<returncode>0</returncode>" in observation and reward == 0.0 and not (terminated or truncated)
    observation, reward, terminated, truncated, info = sync_env.step(SUBMIT)
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["termination"] == "submitted" and info["grade"]["resolved"]
    assert set(info["timings"]) >= {"sandbox_start_s", "commands_s", "grade_s", "total_s"}


async def test_null_episode_earns_0(env: AsyncSWEEnv) -> None:
    await env.reset(options={"task": "semver-prerelease"})
    _, reward, terminated, truncated, info = await env.step("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info["grade"]["details"]["reason"] == "tests_failed" and info["infra_error"] is None
    assert env.trajectory is not None and env.trajectory.trainable


async def test_turn_cap_truncates_and_still_grades() -> None:
    env = AsyncSWEEnv("tiny", "local", max_turns=3)
    try:
        await env.reset(options={"task": "roman-subtractive"})
        assert (await env.step(gold_action()))[2:4] == (False, False)
        assert (await env.step(bash("ls")))[2:4] == (False, False)
        _, reward, terminated, truncated, info = await env.step(bash("git diff --stat"))
        assert (terminated, truncated, info["termination"]) == (False, True, "max_turns")
        assert reward == 1.0 and info["grade"]["resolved"]
        assert info["limits"]["max_turns"] == 3
        with pytest.raises(RuntimeError, match="reset"):
            await env.step(bash("ls"))
    finally:
        await env.close()


async def test_format_errors_are_observations_then_a_cap() -> None:
    env = AsyncSWEEnv("tiny", "local", max_format_errors=2)
    try:
        await env.reset(options={"task": "intervals-touching"})
        obs, _, _, truncated, info = await env.step("no block here")
        assert "exactly one ```bash" in obs and "contained 0" in obs and not truncated
        assert (await env.step(bash("true")))[3] is False  # a good action resets the streak
        obs, _, _, truncated, _ = await env.step(bash("ls") + "\n" + bash("pwd"))
        assert "contained 2" in obs and not truncated
        assert (await env.step(bash("true")))[3] is False
        obs, _, _, truncated, _ = await env.step(bash("echo a\x00b"))  # no shell can take it: the agent's error
        assert "NUL byte" in obs and not truncated
        _, reward, terminated, truncated, info = await env.step("```python\nprint(1)\n```")
        assert (terminated, truncated, info["termination"], info["format_errors"]) == (False, True, "format_errors", 4)
        assert info["grade"] is not None and reward == 0.0
    finally:
        await env.close()


async def test_submit_by_echo_and_long_output_is_shortened() -> None:
    env = AsyncSWEEnv("tiny", "local", observation_max_chars=1000)
    try:
        await env.reset(options={"task": "slugify-max-length"})
        obs, *_ = await env.step(bash("echo START; head -c 100000 /dev/zero | tr '\\0' y; echo; echo END"))
        assert "START" in obs and "END" in obs and "characters omitted" in obs and len(obs) < 1200
        _, _, terminated, _, info = await env.step(bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"))
        assert terminated and info["termination"] == "submitted"
    finally:
        await env.close()


async def test_command_timeout_and_wall_clock_cap() -> None:
    env = AsyncSWEEnv("tiny", "local", command_timeout_s=0.5, max_wall_s=2.0)
    try:
        await env.reset(options={"task": "stats-percentile"})
        obs, _, _, truncated, _ = await env.step(bash("sleep 5"))
        assert "timed out" in obs and "<returncode>timeout</returncode>" in obs and not truncated
        for _ in range(10):
            _, _, _, truncated, info = await env.step(bash("sleep 5"))
            if truncated:
                break
        assert info["termination"] == "max_wall_time" and info["grade"] is not None
    finally:
        await env.close()


async def test_external_cap_hook_grades(env: AsyncSWEEnv) -> None:
    await env.reset(options={"task": "roman-subtractive"})
    await env.step(gold_action())
    reward, info = await env.truncate("max_total_tokens")
    assert reward == 1.0 and info["termination"] == "max_total_tokens"


class BrokenTaskSet(TaskSet):
    name = "broken"

    def __init__(self, tmp: Path) -> None:
        good = tiny_task_set().get("roman-subtractive")
        self.task = Task("ghost", "fix it", SandboxSpec(workspace=tmp / "missing"), good.grader)

    def __iter__(self) -> Iterator[Task]:
        return iter([self.task])


async def test_sandbox_that_fails_to_start_is_an_infra_error_not_a_zero(tmp_path: Path) -> None:
    env = AsyncSWEEnv(BrokenTaskSet(tmp_path), "local")
    try:
        _, info = await env.reset()
        assert info["infra_error"]["kind"] == "sandbox_start"
        _, reward, _, truncated, info = await env.step(bash("ls"))
        assert truncated and info["termination"] == "infra_error" and info["grade"] is None
        assert env.trajectory is not None and not env.trajectory.trainable and env.trajectory.reward is None
    finally:
        await env.close()


async def test_sandbox_lost_mid_episode_is_an_infra_error(env: AsyncSWEEnv) -> None:
    await env.reset(options={"task": "roman-subtractive"})
    assert env.sandbox is not None
    await env.sandbox.close()
    _, _, _, truncated, info = await env.step(bash("ls"))
    assert truncated and info["infra_error"]["kind"] == "sandbox_lost" and info["grade"] is None
    assert env.trajectory is not None and len(env.trajectory.turns) == 1  # the action taken has its turn


async def test_a_hung_exec_is_a_lost_sandbox_but_a_command_timeout_is_the_agents(tmp_path: Path) -> None:
    from patchgym.backends.sandbox.local import LocalSandboxBackend
    from tests.faults import HANG, FaultySandboxBackend, SandboxFaults

    faults = SandboxFaults()
    backend = FaultySandboxBackend(LocalSandboxBackend(root_dir=tmp_path, isolation="none"), faults)
    env = AsyncSWEEnv("tiny", backend, command_timeout_s=0.5, exec_grace_s=1.0)
    try:
        await env.reset(options={"task": "roman-subtractive"})
        obs, _, _, truncated, info = await env.step(bash("sleep 30"))  # killed by the sandbox: data
        assert "<returncode>timeout</returncode>" in obs and not truncated and info["infra_error"] is None
        _, reward, _, truncated, info = await env.step(bash(f": {HANG}"))  # the sandbox never answers
        assert faults.hung and truncated and reward == 0.0 and info["grade"] is None
        assert info["infra_error"]["kind"] == "sandbox_lost" and "within 1.5 s" in info["infra_error"]["message"]
        assert env.trajectory is not None and len(env.trajectory.turns) == 2 and env.trajectory.turns[0].timed_out
    finally:
        await env.close()
        await backend.aclose()


async def test_failing_setup_command_is_an_infra_error(tmp_path: Path) -> None:
    good = tiny_task_set().get("roman-subtractive")
    task = Task("bad-setup", "x", good.sandbox, good.grader, setup_commands=("exit 7",))
    env = AsyncSWEEnv(tiny_task_set(), "local")
    try:
        _, info = await env.reset(options={"task": task})
        assert info["infra_error"]["kind"] == "sandbox_start" and "exit 7" in info["infra_error"]["message"]
    finally:
        await env.close()


async def test_seeded_reset_is_deterministic(env: AsyncSWEEnv) -> None:
    picks = []
    for _ in range(2):
        _, info = await env.reset(seed=123)
        picks.append(info["task_id"])
    assert picks[0] == picks[1]
    _, info = await env.reset(options={"task": "wordwrap-exact-width"})
    assert info["task_id"] == "wordwrap-exact-width"
    with pytest.raises(ConfigError, match="known tasks: intervals-touching"):
        await env.reset(options={"task": "nope"})


def test_bad_settings_and_names_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="max_turnz: unknown key; did you mean 'max_turns'"):
        AsyncSWEEnv("tiny", "local", max_turnz=3)
    with pytest.raises(ConfigError, match="max_turns: Input should be greater than 0"):
        AsyncSWEEnv("tiny", "local", max_turns=0)
    with pytest.raises(ConfigError, match="unknown task set 'nope'; known: .*easy, folder, .*tiny"):
        AsyncSWEEnv("nope", "local")
    with pytest.raises(ConfigError, match="unknown sandbox backend 'dockr'; known: .*docker, e2b, harbor, local"):
        AsyncSWEEnv("tiny", "dockr")


async def test_sync_facade_works_inside_a_running_event_loop() -> None:
    env = gymnasium.make(patchgym.ENV_ID, task_set="tiny", sandbox="local")
    try:
        env.reset(options={"task": "roman-subtractive"})
        _, reward, terminated, _, _ = env.step(SUBMIT)
        assert terminated and reward == 0.0
    finally:
        env.close()
