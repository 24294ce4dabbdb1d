"""What a whole run reports and trains on, checked on runs whose outcomes are chosen: a scripted
policy decides per task and attempt whether an episode solves the task, gives up, works until the
turn cap, or loses its engine (an infrastructure fault). The rest is real: the pipeline, the easy
tasks, local sandboxes, the grader, the tiny model in the embedded trainer (and engine)."""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
from rich.console import Console

from patchgym.core.chat import text_generation
from patchgym.core.errors import TransportError
from patchgym.core.inference import Generation, SamplingParams
from patchgym.core.metrics import read_events
from patchgym.core.plugins import registry
from patchgym.core.validation import oracle_command
from patchgym.pipeline.config import RunConfig
from tests.pipeline_support import check_grpo_accounting, merged, run_config

pytestmark = pytest.mark.usefixtures("train_extra")

Plan = Literal["solve", "give_up", "work", "infra"]
"""solve: the oracle command, then submit; give_up: submit at once; work: a harmless command every
turn until the turn cap; infra: the engine is unreachable."""

SUBMIT = "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"
WORK = "```bash\necho still-working\n```"


class ScriptedPolicy:
    """An engine that plays `plans[task_id][n]` for the n-th episode of each task (by first turn)."""

    max_context = 1 << 20

    def __init__(self, model: str, tasks: Mapping[str, Any], plans: Mapping[str, Sequence[Plan]]) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.tasks, self.plans = tasks, plans
        self.episodes: Counter[str] = Counter()
        self.version = 0
        self._start = self.tokenizer.convert_tokens_to_ids("<|im_start|>")
        self._end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _task_of(self, prompt: str) -> Any:
        (task,) = [t for t in self.tasks.values() if t.instruction in prompt]
        return task

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        prompt = self.tokenizer.decode(input_ids)
        task = self._task_of(prompt)
        if list(input_ids).count(self._start) == 3:  # system, user, assistant header: a first turn
            plan = self.plans[task.id][self.episodes[task.id]]
            self.episodes[task.id] += 1
            text = {"solve": f"```bash\n{oracle_command(task)}\n```", "give_up": SUBMIT, "work": WORK}.get(plan)
            if text is None:
                raise TransportError("the scripted engine is unreachable")
        else:
            text = WORK if "still-working" in prompt else SUBMIT
        return text_generation(self.tokenizer, text, self._end, self.version)

    async def update_weights(self, weights: Any, *, version: int) -> None:
        self.version = version

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def easy_tasks(config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's train and eval tasks by id (the easy family is generated deterministically)."""
    sets = [registry().create("task_set", s["name"], **s["options"]) for s in config["tasks"].values()]
    return {task.id: task for task_set in sets for task in task_set}


def scripted_run(
    tmp_path: Path, model: Path, plans: Callable[[list[str]], Mapping[str, Sequence[Plan]]], changes: Mapping[str, Any]
) -> tuple[RunConfig, ScriptedPolicy]:
    """A run whose policy is a `ScriptedPolicy`; `plans` gets the task ids (train, then eval)."""
    config = run_config(tmp_path, steps=0, sft=False, changes=merged({"model": {"path": str(model)}}, changes))
    config["inference"] = {"name": "scripted"}
    tasks = easy_tasks(config)
    policy = ScriptedPolicy(str(model), tasks, plans(list(tasks)))
    registry().register("inference", "scripted", lambda model, **options: policy)
    return RunConfig.model_validate(config), policy


async def run(config: RunConfig, *, resume: bool = False) -> None:
    from patchgym.pipeline.run import Pipeline

    await Pipeline(config, console=Console(file=io.StringIO())).run(resume=resume)


async def test_evaluation_scores_what_was_graded_and_pass_at_k_needs_one_success(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    def plans(ids: list[str]) -> dict[str, list[Plan]]:
        a, b, c, d = [i for i in ids if "-eval-" in i]
        return {a: ["solve", "give_up"], b: ["give_up", "give_up"], c: ["infra", "infra"], d: ["infra", "solve"]}

    changes = {
        "tasks": {"eval": {"options": {"count": 4}}},
        "grpo": {"enabled": False},
        "eval": {"attempts": 2, "concurrency": 1},
    }
    config, policy = scripted_run(tmp_path, tiny_model_dir, plans, changes)
    await run(config)
    (result,) = read_events(config.run_dir, "eval")
    # c was never graded: no task, no zero. d's lost attempt is left out of its pass@1.
    assert result["infra_errors"] == 3 and result["tasks"] == 3 and result["k"] == 2
    assert result["pass_at_1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert result["pass_at_k"] == pytest.approx(2 / 3)  # a and d were solved at least once
    assert sum(policy.episodes.values()) == 8


async def test_step_metrics_count_turn_caps_and_the_straggling_tail(tmp_path: Path, tiny_model_dir: Path) -> None:
    def plans(ids: list[str]) -> dict[str, list[Plan]]:
        return {i: ["give_up", "work", "work"] * 10 if "-train-" in i else ["give_up"] * 4 for i in ids}

    changes = {
        "grpo": {"steps": 2, "rollout": {"mode": "sync", "group_size": 3}},
        "eval": {"limit": 1},
        "checkpoint_every": 100,
        "metrics": {"tensorboard": False},
    }
    config, _ = scripted_run(tmp_path, tiny_model_dir, plans, changes)
    await run(config)
    logged = check_grpo_accounting(Path(config.run_dir), steps=2)
    for step in read_events(config.run_dir, "step"):
        terminations = Counter(t["termination"] for t in logged[step["step"]])
        assert terminations == {"submitted": 1, "max_turns": 2}
        assert step["terminations"] == terminations
        reasons = Counter(t["grade_reason"] for t in logged[step["step"]])
        assert step["grade_reasons"] == reasons and step["canary_failures"] == 0
        assert step["turn_cap_share"] == pytest.approx(2 / 3)
        assert 0.0 <= step["tail_share_after_90pct"] <= 1.0


class CrashingTrainer:
    """The embedded trainer, except that its step number `crash_at` (from 1) raises, like a dying host."""

    def __init__(self, inner: Any, crash_at: int | None) -> None:
        self.inner, self.crash_at, self.steps = inner, crash_at, 0

    async def train_step(self, batch: Any, loss: Any) -> Mapping[str, float]:
        self.steps += 1
        if self.steps == self.crash_at:
            raise RuntimeError("the trainer's host went down")
        return await self.inner.train_step(batch, loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_run_that_died_mid_step_logs_that_step_once_after_resuming(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Step 1 is logged in full (trajectories and step event) but never checkpointed (checkpoints
    every 100 steps), then the trainer dies in step 2: the resumed run redoes steps 1 and 2, and the
    events the lost attempt wrote after the last saved state are not left behind."""
    from patchgym.backends.trainer.embedded import EmbeddedTrainer

    crash_at: list[int | None] = [2]

    def trainer(model: str, **options: Any) -> CrashingTrainer:
        return CrashingTrainer(EmbeddedTrainer(model, **options), crash_at.pop(0))

    registry().register("trainer", "crashing", trainer)
    changes = {
        "model": {"path": str(tiny_model_dir)},
        "trainer": {"name": "crashing"},
        "eval": {"limit": 1},
        "checkpoint_every": 100,
        "metrics": {"tensorboard": False},
    }
    config = RunConfig.model_validate(run_config(tmp_path, steps=3, sft=False, changes=changes))
    with pytest.raises(RuntimeError, match="host went down"):
        await run(config)
    run_dir = Path(config.run_dir)
    assert json.loads((run_dir / "state.json").read_text())["grpo_step"] == 0
    died = Counter(e["step"] for e in read_events(run_dir, "trajectory") if e["stage"] == "grpo")
    assert died[1] > 0 and read_events(run_dir, "step")  # the lost attempt had logged step 1
    crash_at.append(None)
    await run(config, resume=True)
    check_grpo_accounting(run_dir, steps=3)
    # an attempt lost to an infrastructure error under load is logged beside its retry: count trained ones
    events = read_events(run_dir, "trajectory")
    trained = Counter(e["step"] for e in events if e["stage"] == "grpo" and e["infra_error"] is None)
    assert trained == {1: 2, 2: 2, 3: 2}


async def test_the_trainer_scores_tokens_at_the_temperature_they_were_sampled_at(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """At temperature 0.6 the first step's batch was sampled by the weights being trained, so the
    trainer's log-probs of the sampled tokens match the engine's."""
    changes = {
        "model": {"path": str(tiny_model_dir)},
        "agent": {"temperature": 0.6},
        "eval": {"limit": 1},
        "checkpoint_every": 100,
        "metrics": {"tensorboard": False},
    }
    config = RunConfig.model_validate(run_config(tmp_path, steps=1, sft=False, changes=changes))
    await run(config)
    (step,) = read_events(config.run_dir, "step")
    assert step["trainer"]["logprob_gap"] < 1e-4
