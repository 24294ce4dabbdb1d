"""External agent scaffolds: any agent that calls an OpenAI-compatible endpoint, in patchgym's episodes.

A scaffold (`agent.scaffold`: a short name such as `mini-swe-agent`, or `module:attr` of any
class) gets one `ScaffoldEpisode` per episode: the recording endpoint's base URL, the episode's
own API key and the model name for its OpenAI client, the task's prompt, and `execute` to run a
command in the episode's sandbox (through the environment, so its caps, timeouts and submission
rule hold). It runs its own loop; its model calls are recorded as exact tokens
(envs/recording.py). When it returns, the episode ends: submitted if a command submitted (the
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` convention) or the scaffold called `submit`, otherwise
at the cap it hit or as `scaffold_exit`, and is graded by the environment's rules.

Faults are never trained on as reward 0: an engine fault, a scaffold that raised for another
reason than a token cap, and a scaffold that made no model call through the endpoint (it was
not pointed at it) end the episode with `infra_error`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from patchgym.core.chat import TokenChat
from patchgym.core.errors import ConfigError, InfraError
from patchgym.core.tasks import Task
from patchgym.core.trajectory import Trajectory
from patchgym.envs.recording import EpisodeRecorder
from patchgym.envs.swe import AsyncSWEEnv

SCAFFOLDS = {"mini-swe-agent": "patchgym.plugins.mini_swe_agent:MiniSweAgent"}
"""Built-in scaffolds by name; any other is given as `module:attr`."""


class ScaffoldError(InfraError):
    """The scaffold failed or never used the endpoint: the episode has no trainable outcome."""

    kind = "scaffold"


class EpisodeOver(Exception):
    """`execute` after the episode ended (a cap, or a submitting command): the scaffold must stop."""


@dataclass
class ScaffoldEpisode:
    """What a scaffold gets for one episode (see the module docstring)."""

    base_url: str
    api_key: str
    model_name: str
    task: Task
    prompt: str
    """The task's prompt (the environment's instance template applied to the issue)."""
    workdir: str
    env: AsyncSWEEnv
    submitted: bool = False

    async def execute(self, command: str) -> dict[str, Any]:
        """Run `command` in the sandbox: `{"output", "returncode", "timed_out", "submitted", "done"}`.
        Raises `EpisodeOver` once the episode has ended."""
        if self.env.trajectory is None or self.env.trajectory.termination is not None:
            raise EpisodeOver(f"the episode ended ({self.done_reason})")
        _, _, terminated, truncated, _ = await self.env.execute(command)
        turn = self.env.trajectory.turns[-1]
        self.submitted = terminated
        return {
            "output": _output(turn.observation),
            "observation": turn.observation,
            "returncode": turn.exit_code if turn.exit_code is not None else -1,
            "timed_out": turn.timed_out,
            "submitted": terminated,
            "done": terminated or truncated,
        }

    async def submit(self) -> None:
        """End the episode as submitted (a scaffold with its own submit action)."""
        if self.env.trajectory is not None and self.env.trajectory.termination is None:
            await self.env.submit()
            self.submitted = True

    @property
    def done_reason(self) -> str | None:
        return self.env.trajectory.termination if self.env.trajectory else None


def _output(observation: str) -> str:
    """The command output inside the environment's rendered observation."""
    start, end = observation.find("<output>\n"), observation.rfind("</output>")
    return observation[start + len("<output>\n") : end] if start >= 0 and end > start else observation


@runtime_checkable
class Scaffold(Protocol):
    """An agent scaffold: runs one episode, its model calls going to `episode.base_url` with `episode.api_key`."""

    async def run(self, episode: ScaffoldEpisode) -> None: ...


def load_scaffold(name: str, options: Mapping[str, Any]) -> Scaffold:
    """The scaffold `name` (a built-in name or `module:attr`) built with `options`."""
    target = SCAFFOLDS.get(name, name)
    if ":" not in target:
        raise ConfigError(f"unknown agent scaffold {name!r}: use {', '.join(SCAFFOLDS)}, or module:attr of a class")
    module, attr = target.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load agent scaffold {name!r} ({target}): {exc}") from exc
    try:
        return factory(**options)
    except TypeError as exc:
        raise ConfigError(f"invalid options for agent scaffold {name!r}: {exc}") from exc


async def run_scaffold(
    env: AsyncSWEEnv,
    scaffold: Scaffold,
    recorder: EpisodeRecorder,
    base_url: str,
    api_key: str,
    task: Task | str,
    *,
    engine_fault: Any = None,
) -> Trajectory:
    """One episode of `scaffold` on `task` with its calls recorded by `recorder` (the key's).

    `engine_fault` is called after the scaffold returns and gives the engine fault the endpoint saw, if any.
    """
    _, info = await env.reset(options={"task": task})
    assert env.trajectory is not None and env.task is not None
    if info["infra_error"]:
        return env.trajectory
    workdir = env.sandbox.workdir if env.sandbox else env.task.sandbox.workdir
    episode = ScaffoldEpisode(
        base_url, api_key, recorder.model_name, env.task, info["messages"][-1]["content"], workdir, env
    )
    failure: BaseException | None = None
    try:
        await scaffold.run(episode)
    except EpisodeOver:
        pass
    except Exception as exc:  # the scaffold's own fault, unless a token cap stopped it
        failure = exc
    fault = engine_fault() if engine_fault is not None else None
    if env.trajectory.termination is None:
        if fault is not None:
            await env.fail(fault)
        elif not recorder.chats:
            await env.fail(
                ScaffoldError(
                    "the scaffold made no model call through the recording endpoint, so there is nothing to train "
                    f"on: point its OpenAI client at {base_url} with the episode's api_key"
                    + (f" (it raised {type(failure).__name__}: {failure})" if failure else "")
                )
            )
        elif failure is not None and recorder.cap is None:
            await env.fail(ScaffoldError(f"the scaffold raised {type(failure).__name__}: {failure}"))
        else:
            await env.truncate(recorder.cap or "scaffold_exit")
    return finalise(env.trajectory, recorder)


def _tokens(chat: TokenChat) -> dict[str, Any]:
    versions = [-1] * len(chat.token_ids)
    for span in chat.turns:
        versions[span.start : span.end] = [span.policy_version] * (span.end - span.start)
    return {
        "token_ids": list(chat.token_ids),
        "loss_mask": list(chat.loss_mask),
        "engine_logprobs": list(chat.logprobs),
        "policy_versions": versions,
    }


def finalise(trajectory: Trajectory, recorder: EpisodeRecorder) -> Trajectory:
    """The recorded chats into the trajectory: the last as its tokens, the earlier ones as `segments`."""
    trajectory.recording = recorder.stats()
    trajectory.timings["llm_s"] = recorder.llm_s
    if not recorder.chats:
        return trajectory
    *earlier, last = (_tokens(chat) for chat in recorder.chats)
    for key, value in last.items():
        setattr(trajectory, key, value)
    trajectory.segments = earlier
    return trajectory
