"""What a run tells the person watching it: a line per evaluation, live numbers on the progress
bars, a warning when GRPO's rewards stay at zero, and how to continue after Ctrl-C."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from rich.progress import ProgressColumn, Task
from rich.text import Text

from patchgym.core.trajectory import Trajectory


def eval_line(stage: str, result: Mapping[str, Any]) -> str:
    """One line for an evaluation's result, printed when it ends."""
    k = result.get("k", 1)
    parts = [
        f"pass@1 {result['pass_at_1']:.1%}",
        f"pass@{k} {result['pass_at_k']:.1%}",
        f"{result.get('tasks', 0)} tasks",
    ]
    if "submit_rate" in result:
        parts.append(f"submitted {result['submit_rate']:.1%}")
    if "turn_cap_share" in result:
        parts.append(f"at the turn cap {result['turn_cap_share']:.1%}")
    if result.get("infra_errors"):
        parts.append(f"infra errors {result['infra_errors']}")
    return f"eval ({stage}): " + ", ".join(parts)


def resume_hint(run_dir: str) -> str:
    """What to type to continue a run that was stopped."""
    return f"stopped; continue this run with: patchgym run --resume {shlex.quote(str(run_dir))}"


def pass_rate(trajectories: Sequence[Trajectory]) -> float | None:
    """The share of scored episodes that solved their task (None when none was scored)."""
    scored = [t for t in trajectories if t.trainable]
    return sum(bool(t.resolved) for t in scored) / len(scored) if scored else None


class RunningScore:
    """Mean reward and pass rate of the episodes seen so far (an evaluation's live numbers)."""

    def __init__(self) -> None:
        self.episodes = self.solved = 0
        self.reward = 0.0

    def add(self, trajectory: Trajectory) -> dict[str, float]:
        if trajectory.trainable:
            self.episodes += 1
            self.solved += bool(trajectory.resolved)
            self.reward += float(trajectory.reward)
        return self.fields()

    def fields(self) -> dict[str, float]:
        if not self.episodes:
            return {}
        return {"reward": self.reward / self.episodes, "pass_rate": self.solved / self.episodes}


def stats_text(fields: Mapping[str, Any]) -> str:
    """`reward 0.531, pass 41%` from a bar's fields (empty before there is anything to show)."""
    parts = []
    if fields.get("reward") is not None:
        parts.append(f"reward {fields['reward']:.3f}")
    if fields.get("pass_rate") is not None:
        parts.append(f"pass {fields['pass_rate']:.0%}")
    return ", ".join(parts)


class StatsColumn(ProgressColumn):
    """The bar's reward mean and pass rate on a terminal."""

    def render(self, task: Task) -> Text:
        return Text(stats_text(task.fields), style="progress.data.speed")


LIKELY_CAUSES = (
    "the policy never submits or runs out of turns: see submitted and at the turn cap above, and env.max_turns",
    "a turn or an episode is cut short: agent.max_new_tokens_per_turn, agent.max_tokens_per_trajectory, "
    "and the engine's max_context",
    "the tasks are too hard for this policy: did the SFT evaluation solve any? (pass@1 above)",
    "grading fails for every episode: `patchgym tasks validate NAME --sandbox ...` checks that each gold patch "
    "earns 1 in this sandbox",
    "the system prompt or instance template does not say how to act and submit (env.system_prompt)",
)


class ZeroRewardWatch:
    """Warns once when GRPO's mean reward has been 0 for `steps` steps in a row (None: never)."""

    def __init__(self, steps: int | None) -> None:
        self.steps = steps
        self.run = 0
        self.warned = False

    def observe(self, reward_mean: float, stats: Mapping[str, Any]) -> str | None:
        """The warning, the first time the run of zero-reward steps reaches `steps`; else None."""
        self.run = self.run + 1 if reward_mean == 0 else 0
        if self.steps is None or self.warned or self.run < self.steps:
            return None
        self.warned = True
        return zero_reward_message(self.run, stats)


def zero_reward_message(steps: int, stats: Mapping[str, Any]) -> str:
    seen = []
    for key, label in (("submit_rate", "submitted"), ("turn_cap_share", "at the turn cap")):
        if key in stats:
            seen.append(f"{label} {stats[key]:.0%}")
    if "commands_mean" in stats:
        seen.append(f"{stats['commands_mean']:.2f} commands per episode")
    last = f" (last step: {', '.join(seen)})" if seen else ""
    causes = "".join(f"\n  - {cause}" for cause in LIKELY_CAUSES)
    return (
        f"every GRPO episode has earned reward 0 for {steps} steps in a row{last}: GRPO learns nothing from "
        f"groups that all fail. Likely causes:{causes}\n(grpo.zero_reward_warn_steps sets when this warns)"
    )


def quiet_third_party_bars() -> None:
    """Turn off transformers' and huggingface_hub's own progress bars (loading and saving weights,
    downloads): patchgym's bars and lines are the run's progress."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # transformers is in the train extra
        return
    transformers_logging.disable_progress_bar()
