"""The SWE environment: an agent fixes an issue with bash commands in a sandbox.

The agent acts with one fenced ```bash block per message (`actions: bash_blocks`, the default)
or one native tool call in its chat template's format (`actions: tool_calls`: bash, file view,
create, str_replace and submit; see core/tools.py); `info["tools"]` carries the tools' schemas.

`AsyncSWEEnv` is the core (Gymnasium's reset/step shapes, `async`); `SWEEnv` is the
synchronous `gymnasium.Env` facade registered as "patchgym/SWE-v0". Observations and actions
are the text of chat messages: `reset` returns the task prompt (the system prompt is in
`info["system_prompt"]`), each `step` takes an assistant message and returns the next user
message. `terminated` means the agent submitted; `truncated` means a cap was hit or the
infrastructure failed. The final state is graded either way (`unsubmitted: graded`, the
default) or only when the agent submitted (`unsubmitted: zero`: a cap earns reward 0 ungraded),
never after an infrastructure fault, which is reported in `info["infra_error"]` and must never
be trained on as reward 0. `turn_cost` is subtracted from the reward for each turn taken.
"""

from __future__ import annotations

import asyncio
import string
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any, Literal, TypeVar

import gymnasium as gym
from gymnasium import spaces
from gymnasium.utils import seeding
from pydantic import BaseModel, ConfigDict, Field, field_validator

from patchgym.core.actions import BashBlockParser, submitted_by_output
from patchgym.core.config import validate
from patchgym.core.errors import AGENT_KILLED_SANDBOX, ConfigError, InfraError, SandboxLostError
from patchgym.core.fresh_grading import FreshSandboxGrader, GradingMode, TamperPolicy
from patchgym.core.grading import zero_grade
from patchgym.core.output import head_tail
from patchgym.core.plugins import registry
from patchgym.core.sandbox import ExecResult, Sandbox, SandboxBackend
from patchgym.core.tasks import Task, TaskSet, start_task_sandbox
from patchgym.core.tools import TOOL_NAMES, ToolCallParser, tool_schemas
from patchgym.core.trajectory import Trajectory, Turn

T = TypeVar("T")

DEFAULT_SYSTEM_PROMPT = """\
You are a software engineer working in a bash shell on a code repository. Fix the issue you \
are given by running commands and editing files.

Every reply must contain a short thought and exactly one command in a fenced block:

```bash
<one bash command>
```

Each command runs in a fresh shell in the repository (cd does not persist). Do not edit the \
tests. When you are done, submit with:

```bash
echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT
```"""

DEFAULT_TOOLS_SYSTEM_PROMPT = """\
You are a software engineer working on a code repository. Fix the issue you are given by \
calling the tools: one tool call per reply, after a short thought. Each bash command runs in a \
fresh shell in the repository (cd does not persist). Do not edit the tests. When you are done, \
call submit."""

DEFAULT_INSTANCE_TEMPLATE = """\
The repository is at {workdir}. Fix this issue:

{instruction}"""


class EnvConfig(BaseModel):
    """Settings of one SWE environment. Every cap is here and reported in `info["limits"]`."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(80, gt=0, description="steps before the episode is truncated")
    max_wall_s: float = Field(3600.0, gt=0, description="wall-clock seconds per episode, from reset")
    max_format_errors: int = Field(3, gt=0, description="consecutive malformed messages before truncation")
    command_timeout_s: float = Field(120.0, gt=0, description="seconds one command may run")
    exec_grace_s: float = Field(
        60.0, gt=0, description="seconds a sandbox may overrun a command's timeout before it counts as lost"
    )
    max_output_bytes: int = Field(1_000_000, gt=0, description="bytes of stdout/stderr captured per command")
    observation_max_chars: int = Field(10_000, gt=0, description="command output shown to the agent (head + tail)")
    action_fence: str = Field("bash", description="language tag of the fenced command block")
    actions: Literal["bash_blocks", "tool_calls"] = Field(
        "bash_blocks",
        description="how the agent acts: one fenced command block per message, or one native tool call in the "
        "model's chat-template format (needs a template with tools)",
    )
    tools: list[str] = Field(
        list(TOOL_NAMES), description=f"the tools offered with actions: tool_calls (of {', '.join(TOOL_NAMES)})"
    )
    unsubmitted: Literal["graded", "zero"] = Field(
        "graded",
        description="an episode a cap ended before the agent submitted: its final state graded, or reward 0 ungraded",
    )
    turn_cost: float = Field(0.0, ge=0, description="subtracted from the episode's reward per turn the agent took")
    grading_mode: GradingMode = Field(
        "fresh",
        description="'fresh': grade the agent's diff in a new sandbox; 'in_place': grade the agent's own "
        "sandbox (weaker: its shell, interpreter and processes are the agent's)",
    )
    tamper_policy: TamperPolicy = Field(
        "zero", description="what a tamper finding on the agent's diff costs: 'zero' reward, 'flag' only, or 'off'"
    )
    regrade_attempts: int = Field(1, ge=0, description="fresh sandboxes tried again when one is lost during grading")
    max_diff_bytes: int = Field(
        50_000_000,
        gt=0,
        description="bytes of changed files carried into the grading sandbox (the agent's tree is measured "
        "in its sandbox first: a tree grown by more than this is reward 0 before anything is copied out)",
    )
    max_diff_files: int = Field(
        10_000, gt=0, description="files the agent may change (entries its tree may add), checked the same way"
    )
    grading_timeout_s: float = Field(3600.0, gt=0, description="seconds grading one episode may take (then reward 0)")
    system_prompt: str | None = Field(
        None, description="the system message (None: the default for the `actions` format)"
    )
    instance_template: str = Field(
        DEFAULT_INSTANCE_TEMPLATE,
        description="the first user message; {instruction} is the task's issue text, {workdir} the repository",
    )

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        tool_schemas(value)
        if "submit" not in value:
            raise ValueError("tools must include submit (otherwise a tool-calling agent cannot end its episode)")
        return value

    def limits(self) -> dict[str, Any]:
        return self.model_dump(exclude={"system_prompt", "instance_template", "action_fence", "tools"})

    def system_message(self) -> str:
        if self.system_prompt is not None:
            return self.system_prompt
        return DEFAULT_TOOLS_SYSTEM_PROMPT if self.actions == "tool_calls" else DEFAULT_SYSTEM_PROMPT

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The schemas of the offered tools with `actions: tool_calls`, else None."""
        return tool_schemas(self.tools) if self.actions == "tool_calls" else None


def _resolve(kind: str, value: Any, options: Mapping[str, Any] | None) -> Any:
    if isinstance(value, str):
        return registry().create(kind, value, **(options or {}))  # type: ignore[arg-type]
    if options:
        raise ConfigError(f"{kind}_options apply only when the {kind} is given by name")
    return value


def render_command_result(result: ExecResult, max_chars: int) -> str:
    """The observation for a command: its exit code and (shortened) output."""
    if result.timed_out:
        header = f"The command timed out after {result.duration_s:.0f} s and was killed.\n"
        code = "timeout"
    else:
        header, code = "", str(result.exit_code)
    return f"{header}<returncode>{code}</returncode>\n<output>\n{head_tail(result.output, max_chars)}</output>"


class AsyncSWEEnv:
    """The asynchronous SWE environment (see the module docstring)."""

    def __init__(
        self,
        task_set: TaskSet | str = "tiny",
        sandbox: SandboxBackend | str = "local",
        *,
        config: EnvConfig | Mapping[str, Any] | None = None,
        task_set_options: Mapping[str, Any] | None = None,
        sandbox_options: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        base = config.model_dump() if isinstance(config, EnvConfig) else dict(config or {})
        self.config = validate(EnvConfig, {**base, **settings}, source="environment settings")
        self.task_set: TaskSet = _resolve("task_set", task_set, task_set_options)
        self.backend: SandboxBackend = _resolve("sandbox", sandbox, sandbox_options)
        self._owns_backend = isinstance(sandbox, str)
        self._parser = (
            ToolCallParser(self.config.tools)
            if self.config.actions == "tool_calls"
            else BashBlockParser(self.config.action_fence)
        )
        self._task_ids = self.task_set.ids()
        self.np_random, _ = seeding.np_random()
        self.sandbox: Sandbox | None = None
        self.task: Task | None = None
        self.trajectory: Trajectory | None = None
        self._done = True
        self._started = 0.0
        self._consecutive_format_errors = 0
        self._format_errors = 0

    # -- episode lifecycle -------------------------------------------------------------
    async def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode on `options["task"]` (an id or a Task), else a task drawn with `seed`."""
        if seed is not None:
            self.np_random, _ = seeding.np_random(seed)
        await self._close_sandbox()
        self.task = self._pick_task((options or {}).get("task"))
        self.trajectory = Trajectory(task_id=self.task.id)
        self._done = False
        self._consecutive_format_errors = self._format_errors = 0
        self._started = time.perf_counter()
        try:
            self.sandbox = await start_task_sandbox(self.backend, self.task)
        except InfraError as exc:
            self._end("infra_error", infra_error=exc)
        self.trajectory.timings["sandbox_start_s"] = time.perf_counter() - self._started
        workdir = self.sandbox.workdir if self.sandbox else self.task.sandbox.workdir
        prompt = self.config.instance_template.format(instruction=self.task.instruction, workdir=workdir)
        info = self._info()
        info["system_prompt"] = self.config.system_message()
        info["messages"] = [
            {"role": "system", "content": info["system_prompt"]},
            {"role": "user", "content": prompt},
        ]
        info["tools"] = self.config.tool_schemas()
        return prompt, info

    def _pick_task(self, choice: Task | str | None) -> Task:
        if isinstance(choice, Task):
            return choice
        if choice is None:
            choice = self._task_ids[int(self.np_random.integers(len(self._task_ids)))]
        return self.task_set.get(choice)

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run one assistant message; returns (observation, reward, terminated, truncated, info)."""
        if self.trajectory is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            if self.trajectory.termination == "infra_error" and not self.trajectory.turns:
                return await self._finish("", action, "infra_error")
            raise RuntimeError("the episode is over; call reset() to start another")
        parsed = self._parser(action)
        if parsed.kind == "format_error":
            self._format_errors += 1
            self._consecutive_format_errors += 1
            self.trajectory.turns.append(Turn(action, parsed.error, "format_error"))
            if self._consecutive_format_errors >= self.config.max_format_errors:
                return await self._finish(parsed.error, action, "format_errors")
            return await self._finish_if_capped(parsed.error, action)
        self._consecutive_format_errors = 0
        if parsed.kind == "submit":
            self.trajectory.turns.append(Turn(action, "", "submit"))
            return await self._finish("", action, "submitted")
        return await self._command(action, parsed.command, parsed.submit)

    async def execute(self, command: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run `command` as a turn (an external scaffold's action, already parsed by the scaffold), with the
        caps and submission rule of `step`; returns what `step` returns."""
        if self.trajectory is None or self._done:
            raise RuntimeError("execute() needs a running episode")
        return await self._command(command, command, False)

    async def submit(self) -> tuple[float, dict[str, Any]]:
        """End the episode as submitted (an external scaffold's own submission) and grade it."""
        if self._done:
            raise RuntimeError("the episode is already over")
        assert self.trajectory is not None
        self.trajectory.turns.append(Turn("", "", "submit"))
        _, reward, _, _, info = await self._finish("", "", "submitted")
        return reward, info

    async def _command(
        self, action: str, command: str, submit_after: bool
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        assert self.trajectory is not None
        remaining = self.config.max_wall_s - (time.perf_counter() - self._started)
        if remaining <= 0:
            self.trajectory.turns.append(Turn(action, "", "command"))  # every action taken has its turn
            return await self._finish("", action, "max_wall_time")
        try:
            result = await self._exec(command, min(self.config.command_timeout_s, remaining))
        except SandboxLostError as exc:
            self.trajectory.turns.append(Turn(action, "", "command"))
            if exc.from_inside:  # the agent's command may have ended its own sandbox: scored, not retried
                return await self._killed_by_agent(exc, action)
            self._end("infra_error", infra_error=exc)
            return await self._finish("", action, "infra_error")
        except InfraError as exc:
            self.trajectory.turns.append(Turn(action, "", "command"))
            self._end("infra_error", infra_error=exc)
            return await self._finish("", action, "infra_error")
        observation = render_command_result(result, self.config.observation_max_chars)
        submit = submit_after or submitted_by_output(result.stdout)
        self.trajectory.turns.append(
            Turn(
                action,
                observation,
                "submit" if submit else "command",
                result.exit_code,
                result.timed_out,
                result.duration_s,
            )
        )
        self.trajectory.timings["commands_s"] = self.trajectory.timings.get("commands_s", 0.0) + result.duration_s
        if submit:
            return await self._finish(observation, action, "submitted")
        return await self._finish_if_capped(observation, action)

    async def _killed_by_agent(
        self, error: SandboxLostError, action: str
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """End the episode whose sandbox ended from inside while the agent's command ran: reward 0
        with the reason `sandbox_killed_by_agent` (a retry would trade the agent's 0 for another try)."""
        assert self.trajectory is not None
        self._end(AGENT_KILLED_SANDBOX)
        grade = zero_grade(AGENT_KILLED_SANDBOX, message=str(error)[:500])
        self.trajectory.grade, self.trajectory.reward = grade.as_dict(), grade.reward
        return await self._finish("", action, AGENT_KILLED_SANDBOX)

    async def _exec(self, command: str, timeout_s: float) -> ExecResult:
        """Run the agent's command. A command that outlives `timeout_s` is killed by the sandbox and
        reported as timed out (the agent's doing); a sandbox that does not answer within
        `exec_grace_s` after that is lost (an infrastructure fault)."""
        assert self.sandbox is not None
        deadline = timeout_s + self.config.exec_grace_s
        try:
            return await asyncio.wait_for(
                self.sandbox.exec(command, timeout_s=timeout_s, max_output_bytes=self.config.max_output_bytes),
                deadline,
            )
        except TimeoutError:
            raise SandboxLostError(
                f"the sandbox did not answer within {deadline:.1f} s a command it had to stop after {timeout_s:.1f} s"
            ) from None

    async def truncate(self, reason: str) -> tuple[float, dict[str, Any]]:
        """End the episode because of a cap the caller enforces (e.g. a token budget); grades it."""
        if self._done:
            raise RuntimeError("the episode is already over")
        _, reward, _, _, info = await self._finish("", "", reason)
        return reward, info

    async def fail(self, error: InfraError) -> dict[str, Any]:
        """End the episode because of an infrastructure fault outside the sandbox (e.g. the engine).

        Nothing is graded and the trajectory carries `infra_error`: it must not be trained on.
        """
        if self._done:
            raise RuntimeError("the episode is already over")
        self._end("infra_error", infra_error=error)
        _, _, _, _, info = await self._finish("", "", "infra_error")
        return info

    async def _finish_if_capped(self, observation: str, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        assert self.trajectory is not None
        if len(self.trajectory.turns) >= self.config.max_turns:
            return await self._finish(observation, action, "max_turns")
        if time.perf_counter() - self._started >= self.config.max_wall_s:
            return await self._finish(observation, action, "max_wall_time")
        return observation, 0.0, False, False, self._info()

    async def _finish(
        self, observation: str, action: str, reason: str
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """End the episode with `reason`, score it (see `unsubmitted`, `turn_cost`), close the sandbox."""
        assert self.trajectory is not None and self.task is not None
        if not self._done:
            self._end(reason)
        if self.trajectory.infra_error is None and self.sandbox is not None and self.trajectory.grade is None:
            if self.trajectory.termination == "submitted" or self.config.unsubmitted == "graded":
                await self._grade()
            else:
                self.trajectory.reward = 0.0
        if self.trajectory.reward is not None and self.config.turn_cost:
            self.trajectory.reward -= self.config.turn_cost * len(self.trajectory.turns)
        await self._close_sandbox()
        self.trajectory.timings["total_s"] = time.perf_counter() - self._started
        terminated = self.trajectory.termination == "submitted"
        return observation, self.trajectory.reward or 0.0, terminated, not terminated, self._info()

    async def _grade(self) -> None:
        assert self.trajectory is not None and self.task is not None and self.sandbox is not None
        graded_at = time.perf_counter()
        grader = FreshSandboxGrader(
            self.task.grader,
            self.backend,
            self.task,
            mode=self.config.grading_mode,
            tamper_policy=self.config.tamper_policy,
            regrade_attempts=self.config.regrade_attempts,
            max_diff_bytes=self.config.max_diff_bytes,
            max_diff_files=self.config.max_diff_files,
            grading_timeout_s=self.config.grading_timeout_s,
        )
        try:
            grade = await grader.grade(self.sandbox)
            self.trajectory.grade = grade.as_dict()
            self.trajectory.reward = grade.reward
        except InfraError as exc:
            self._end("infra_error", infra_error=exc)
        self.trajectory.timings["grade_s"] = time.perf_counter() - graded_at

    def _end(self, reason: str, *, infra_error: InfraError | None = None) -> None:
        assert self.trajectory is not None
        self._done = True
        self.trajectory.termination = reason
        if infra_error is not None:
            self.trajectory.infra_error = infra_error.as_dict()
            self.trajectory.reward = None
            self.trajectory.grade = None

    def _info(self) -> dict[str, Any]:
        """Step info; phase timings come with the final step (they would break determinism checks)."""
        assert self.trajectory is not None
        info = {
            "task_id": self.trajectory.task_id,
            "turn": len(self.trajectory.turns),
            "format_errors": self._format_errors,
            "termination": self.trajectory.termination,
            "grade": self.trajectory.grade,
            "infra_error": self.trajectory.infra_error,
            "limits": self.config.limits(),
        }
        if self._done:
            info["timings"] = dict(self.trajectory.timings)
        return info

    async def _close_sandbox(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.close()

    async def close(self) -> None:
        """Close the current sandbox, and the backend if this environment created it."""
        await self._close_sandbox()
        if self._owns_backend:
            await self.backend.aclose()


class ChatText(spaces.Text):
    """Any string of up to `max_length` characters; samples are printable ASCII."""

    def __init__(self, max_length: int) -> None:
        super().__init__(max_length=max_length, min_length=0, charset=string.printable)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length


class _LoopThread:
    """An event loop on a daemon thread, so the sync facade works inside a running loop too."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="patchgym-env-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SWEEnv(gym.Env[str, str]):
    """Synchronous Gymnasium facade over `AsyncSWEEnv`; same arguments."""

    metadata = {"render_modes": []}

    def __init__(
        self, task_set: TaskSet | str = "tiny", sandbox: SandboxBackend | str = "local", **kwargs: Any
    ) -> None:
        self._runner = _LoopThread()
        try:
            self.env = AsyncSWEEnv(task_set, sandbox, **kwargs)
        except BaseException:
            self._runner.stop()
            raise
        self.observation_space = ChatText(max_length=1_000_000)
        self.action_space = ChatText(max_length=100_000)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        return self._runner.run(self.env.reset(seed=seed, options=options))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self._runner.run(self.env.step(action))

    def truncate(self, reason: str) -> tuple[float, dict[str, Any]]:
        return self._runner.run(self.env.truncate(reason))

    def close(self) -> None:
        if self._runner.loop.is_closed():
            return
        self._runner.run(self.env.close())
        self._runner.stop()
