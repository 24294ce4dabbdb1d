"""mini-swe-agent (the real package, extra `agents`) as a patchgym scaffold.

Its own `DefaultAgent` and `LitellmModel` run unchanged, in a worker thread (they are
synchronous): the model class is pointed at the recording endpoint (`openai/<model>` with
`api_base` and the episode's key), and `SandboxEnvironment`, an environment class of
mini-swe-agent's kind (`execute`, `get_template_vars`, `serialize`), runs its commands in the
episode's patchgym sandbox. Submission is mini-swe-agent's convention (a command whose output
starts with `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`), which patchgym's environment shares.

Options: `config` (a mini-swe-agent config file or built-in name, default `mini`: tool calls),
and `agent`, `model` and `environment` sections merged over it. The step limit defaults to the
environment's `max_turns`; cost tracking is off (a local model has no price).
"""

from __future__ import annotations

import asyncio
import os
import platform
from concurrent.futures import Future
from typing import Any

import yaml

from patchgym.core.errors import ConfigError
from patchgym.envs.scaffold import EpisodeOver, ScaffoldEpisode

VERSION = "2.4.6"
"""The mini-swe-agent release patchgym is tested with (pinned by the `agents` extra)."""


def _import() -> Any:
    # litellm fetches a model price list from the internet at import unless told to use its bundled copy
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import minisweagent
    except ImportError as exc:
        raise ConfigError(
            "agent scaffold mini-swe-agent needs the agents extra: pip install 'patchgym[agents]'"
        ) from exc
    return minisweagent


class SandboxEnvironment:
    """A mini-swe-agent environment whose commands run in the episode's patchgym sandbox."""

    def __init__(self, episode: ScaffoldEpisode, loop: asyncio.AbstractEventLoop, **config: Any) -> None:
        self.episode, self.loop, self.config = episode, loop, config

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run `action["command"]` (patchgym's command timeout applies); raises mini-swe-agent's
        `Submitted` or `LimitsExceeded` when the episode ends."""
        from minisweagent.exceptions import LimitsExceeded, Submitted

        future: Future[dict[str, Any]] = asyncio.run_coroutine_threadsafe(
            self.episode.execute(action.get("command", "")), self.loop
        )
        try:
            result = future.result()
        except EpisodeOver as exc:
            raise LimitsExceeded(_exit("LimitsExceeded", str(exc))) from None
        output = {"output": result["output"], "returncode": result["returncode"], "exception_info": ""}
        if result["timed_out"]:
            output["exception_info"] = "the command timed out and was killed"
        if result["submitted"]:
            raise Submitted(_exit("Submitted", ""))
        if result["done"]:
            raise LimitsExceeded(_exit("LimitsExceeded", f"the episode ended: {self.episode.done_reason}"))
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config, **platform.uname()._asdict(), "cwd": self.episode.workdir, **kwargs}

    def serialize(self) -> dict[str, Any]:
        kind = f"{type(self).__module__}.{type(self).__name__}"
        return {"info": {"config": {"environment": dict(self.config), "environment_type": kind}}}


def _exit(status: str, content: str) -> dict[str, Any]:
    return {"role": "exit", "content": content, "extra": {"exit_status": status, "submission": ""}}


class MiniSweAgent:
    """The `mini-swe-agent` scaffold (see the module docstring)."""

    def __init__(
        self,
        config: str = "mini",
        agent: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None,
        environment: dict[str, Any] | None = None,
    ) -> None:
        _import()
        from minisweagent.config import get_config_path

        try:
            base = yaml.safe_load(get_config_path(config).read_text()) or {}
        except FileNotFoundError as exc:
            raise ConfigError(f"mini-swe-agent config {config!r}: {exc}") from exc
        self.agent = {**base.get("agent", {}), **(agent or {})}
        self.model = {**base.get("model", {}), **(model or {})}
        self.environment = {**base.get("environment", {}), **(environment or {})}
        self.agent.pop("mode", None)  # the interactive agent's setting; DefaultAgent runs unattended

    async def run(self, episode: ScaffoldEpisode) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._run, episode, loop)

    def _run(self, episode: ScaffoldEpisode, loop: asyncio.AbstractEventLoop) -> None:
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.models.litellm_model import LitellmModel

        os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
        kwargs = dict(self.model.get("model_kwargs", {}))
        kwargs.update(api_base=episode.base_url, api_key=episode.api_key)
        model_config = {k: v for k, v in self.model.items() if k not in ("model_kwargs", "model_name", "model_class")}
        model = LitellmModel(
            model_name=f"openai/{episode.model_name}",
            model_kwargs=kwargs,
            cost_tracking="ignore_errors",
            **model_config,
        )
        environment = SandboxEnvironment(episode, loop, **self.environment)
        settings = {**self.agent, "cost_limit": 0.0}
        settings["step_limit"] = settings.get("step_limit") or episode.env.config.max_turns
        DefaultAgent(model, environment, **settings).run(episode.prompt)
