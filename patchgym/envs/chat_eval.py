"""Text-level evaluation: a chat model (`ChatModel`) plays SWE episodes on a task set.

Each task is attempted `attempts` times, `concurrency` episodes at a time on one shared sandbox
backend. pass@1 is the mean over tasks of the mean reward over the task's valid attempts; an
episode that hit an infrastructure fault (sandbox or model service) is counted separately and
never as a failure.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from patchgym.core.chat_model import ChatModel
from patchgym.core.errors import InfraError
from patchgym.core.sandbox import SandboxBackend
from patchgym.core.tasks import TaskSet
from patchgym.core.trajectory import Trajectory
from patchgym.envs.swe import AsyncSWEEnv, EnvConfig


async def run_episode(
    model: ChatModel, task_set: TaskSet, backend: SandboxBackend, task_id: str, config: EnvConfig
) -> Trajectory:
    """One episode of `model` on `task_id`; model faults end it as an infrastructure error."""
    env = AsyncSWEEnv(task_set, backend, config=config)
    try:
        _, info = await env.reset(options={"task": task_id})
        messages: list[dict[str, str]] = list(info["messages"])
        done = info["infra_error"] is not None
        while not done:
            try:
                reply = await model.complete(messages)
            except InfraError as exc:
                assert env.trajectory is not None
                env.trajectory.termination, env.trajectory.infra_error = "infra_error", exc.as_dict()
                env.trajectory.reward = None
                break
            observation, _, terminated, truncated, _ = await env.step(reply.text)
            assert env.trajectory is not None
            if env.trajectory.turns:
                env.trajectory.turns[-1].llm_s = reply.latency_s
            messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": observation}]
            done = terminated or truncated
        assert env.trajectory is not None
        return env.trajectory
    finally:
        await env.close()


@dataclass
class EvalReport:
    """Every episode, and pass@1 over the tasks that have at least one valid attempt."""

    trajectories: list[Trajectory] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def per_task(self) -> dict[str, list[float]]:
        rewards: dict[str, list[float]] = {}
        for trajectory in self.trajectories:
            valid = rewards.setdefault(trajectory.task_id, [])
            if trajectory.trainable:
                valid.append(float(trajectory.reward or 0.0))
        return rewards

    @property
    def pass_at_1(self) -> float | None:
        means = [statistics.fmean(r) for r in self.per_task.values() if r]
        return statistics.fmean(means) if means else None

    @property
    def infra_errors(self) -> int:
        return sum(t.infra_error is not None for t in self.trajectories)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pass_at_1": self.pass_at_1,
            "episodes": len(self.trajectories),
            "infra_errors": self.infra_errors,
            "per_task": self.per_task,
            "settings": self.settings,
            "trajectories": [t.as_dict() for t in self.trajectories],
        }


async def evaluate(
    model: ChatModel,
    task_set: TaskSet,
    backend: SandboxBackend,
    *,
    attempts: int = 1,
    concurrency: int = 4,
    config: EnvConfig | Mapping[str, Any] | None = None,
    task_ids: list[str] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> EvalReport:
    """Run `attempts` episodes per task, `concurrency` at a time."""
    env_config = config if isinstance(config, EnvConfig) else EnvConfig.model_validate(dict(config or {}))
    ids = task_ids if task_ids is not None else task_set.ids()
    gate = asyncio.Semaphore(concurrency)
    report = EvalReport(
        settings={
            "attempts": attempts,
            "concurrency": concurrency,
            "env": env_config.limits(),
            "model": model.settings(),
        }
    )

    async def one(task_id: str) -> Trajectory:
        async with gate:
            trajectory = await run_episode(model, task_set, backend, task_id, env_config)
        if on_episode is not None:
            on_episode(trajectory)
        return trajectory

    report.trajectories = list(await asyncio.gather(*(one(task_id) for task_id in ids for _ in range(attempts))))
    return report
