"""The agent loop: one trajectory of a token-level policy in the SWE environment.

observation → `TokenChat` (append-only tokens; with `env.actions: tool_calls` the tools are in the
template and observations are `tool` messages) → engine → assistant text → `env.step`, until
the agent submits, a cap ends the episode, or the infrastructure fails. The caps (settings):
generated tokens per turn, tokens per trajectory, and the engine's own context cap; the
environment adds its turn, wall-clock and format-error caps. The trajectory records every
token with its loss mask, the engine's log-prob and the policy version that sampled it, and per
turn the LLM latency and command time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from patchgym.core.chat import ChatTokenizer, TokenChat
from patchgym.core.errors import InfraError
from patchgym.core.inference import InferenceEngine, SamplingParams
from patchgym.core.tasks import Task
from patchgym.core.trajectory import Trajectory
from patchgym.envs.swe import AsyncSWEEnv


class AgentConfig(BaseModel):
    """Token caps and sampling of the agent loop (defaults from the reference run)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens_per_turn: int = Field(8192, gt=0, description="tokens the policy may generate in one turn")
    max_tokens_per_trajectory: int = Field(
        65536, gt=0, description="tokens of a whole episode (prompt, turns, observations); the episode ends there"
    )
    temperature: float = Field(1.0, ge=0, description="sampling temperature of rollouts (GRPO needs > 0)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest token set of this mass")
    scaffold: str = Field(
        "builtin",
        description="who drives the episodes: patchgym's own loop, or an external scaffold calling the recording "
        "endpoint (`mini-swe-agent`, or module:attr of a class; see docs/agents.md)",
    )
    scaffold_options: dict[str, Any] = Field(default_factory=dict, description="the external scaffold's options")

    @model_validator(mode="before")
    @classmethod
    def _scaffold_by_name(cls, value: Any) -> Any:
        return {"scaffold": value} if isinstance(value, str) else value  # `agent: mini-swe-agent`


def _finalise(trajectory: Trajectory, chat: TokenChat | None) -> Trajectory:
    if chat is None:
        return trajectory
    trajectory.token_ids = list(chat.token_ids)
    trajectory.loss_mask = list(chat.loss_mask)
    trajectory.engine_logprobs = list(chat.logprobs)
    versions = [-1] * len(chat.token_ids)
    for span in chat.turns:
        versions[span.start : span.end] = [span.policy_version] * (span.end - span.start)
    trajectory.policy_versions = versions
    trajectory.timings["llm_s"] = sum(turn.llm_s for turn in trajectory.turns)
    return trajectory


async def run_agent(
    env: AsyncSWEEnv,
    engine: InferenceEngine,
    tokenizer: ChatTokenizer,
    task: Task | str | None = None,
    config: AgentConfig | None = None,
    *,
    seed: int | None = None,
) -> Trajectory:
    """Run one episode of `task` (or one the environment draws) and return its trajectory."""
    config = config or AgentConfig()
    _, info = await env.reset(seed=seed, options={"task": task} if task is not None else None)
    assert env.trajectory is not None
    if info["infra_error"]:
        return env.trajectory
    tools = info.get("tools")
    chat = TokenChat.start(tokenizer, info["messages"], tools=tools)
    role = "tool" if tools else "user"  # with native tool calls, command output is the tool's result
    while True:
        room = min(config.max_tokens_per_trajectory, engine.max_context) - len(chat)
        if room <= 0:
            cap = "max_total_tokens" if config.max_tokens_per_trajectory <= engine.max_context else "max_context"
            await env.truncate(cap)
            break
        params = SamplingParams(
            max_new_tokens=min(config.max_new_tokens_per_turn, room),
            temperature=config.temperature,
            top_p=config.top_p,
            stop_token_ids=chat.stop_token_ids,
        )
        asked = time.perf_counter()
        try:
            generation = await engine.generate(chat.token_ids, params)
        except InfraError as exc:
            await env.fail(exc)
            break
        llm_s = time.perf_counter() - asked
        if generation.finish_reason == "abort":
            await env.fail(InfraError("the engine aborted the request", retryable=True))
            break
        span_start = len(chat)
        text = chat.add_generation(generation)
        observation, _, terminated, truncated, _ = await env.step(text)
        turn = env.trajectory.turns[-1]
        turn.llm_s = llm_s
        turn.token_ids = chat.token_ids[span_start:]
        turn.logprobs = list(generation.logprobs)
        turn.policy_version = generation.weight_version
        if terminated or truncated:
            break
        if generation.finish_reason == "context":
            await env.truncate("max_context")
            break
        chat.add_observation([{"role": role, "content": observation}])
    return _finalise(env.trajectory, chat)


def describe(trajectory: Trajectory) -> dict[str, Any]:
    """The per-trajectory record for the event log."""
    return {
        "task_id": trajectory.task_id,
        "turns": len(trajectory.turns),
        "tokens": len(trajectory.token_ids),
        "generated_tokens": sum(trajectory.loss_mask),
        "termination": trajectory.termination,
        "commands": trajectory.commands,
        "reward": trajectory.reward,
        "resolved": trajectory.resolved,
        "grade_reason": trajectory.grade_reason,
        "infra_error": trajectory.infra_error,
        "timings": dict(trajectory.timings),
        "policy_versions": sorted({v for v in trajectory.policy_versions if v >= 0}),
        **({"recording": trajectory.recording} if trajectory.recording is not None else {}),
    }


def episode_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """How episodes ended, over those without an infra error: mean commands per episode, the share
    that submitted and the share the turn cap ended."""
    valid = [t for t in trajectories if t.infra_error is None]
    n = len(valid) or 1
    return {
        "commands_mean": sum(t.commands for t in valid) / n,
        "submit_rate": sum(t.termination == "submitted" for t in valid) / n,
        "turn_cap_share": sum(t.termination == "max_turns" for t in valid) / n,
    }
