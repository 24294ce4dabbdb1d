"""The generated `locate` family (the fix needs what a command shows; the oracle takes two turns), generated
families in general, the `mix` task set, and how unsubmitted episodes are scored."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.errors import ConfigError
from patchgym.core.metrics import read_events
from patchgym.core.tasks import Task, TaskSet
from patchgym.core.validation import oracle_turns, validate_task
from patchgym.envs.agent import episode_stats, run_agent
from patchgym.envs.swe import AsyncSWEEnv, EnvConfig
from patchgym.pipeline.run import SUBMIT_MESSAGE, OraclePolicy, check_oracle_fits
from patchgym.plugins.easy import easy_task_set, generate_easy_tasks
from patchgym.plugins.locate import generate_locate_tasks, locate_task_set
from patchgym.plugins.mix import mixed_task_set
from tests.pipeline_support import run_config

SED = re.compile(r"^sed -i '(\d+)s/(\d)/(\d)/' (\w+\.py)$")


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def where(task: Task) -> tuple[int, str]:
    """The line and module the oracle's edit goes to."""
    found = SED.match(task.oracle_turns[1])
    assert found, task.oracle_turns
    return int(found[1]), found[4]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[AsyncSWEEnv]:
    environment = AsyncSWEEnv(locate_task_set(24, 0, "eval", str(tmp_path)), LocalSandboxBackend(), max_turns=4)
    yield environment
    await environment.close()
    await environment.backend.aclose()


async def play(env: AsyncSWEEnv, task: Task, commands: list[str]) -> tuple[list[str], float, str]:
    """Run `commands` one per turn, then submit: the observations, the reward and the termination."""
    await env.reset(options={"task": task})
    observations = []
    for command in commands:
        observation, *_ = await env.step(f"```bash\n{command}\n```")
        observations.append(observation)
    _, reward, terminated, _, info = await env.step(SUBMIT_MESSAGE)
    assert terminated
    return observations, reward, info["termination"]


@pytest.mark.parametrize(
    ("generate", "task_set"), [(generate_easy_tasks, easy_task_set), (generate_locate_tasks, locate_task_set)]
)
def test_generated_families_are_deterministic_and_splits_are_disjoint(
    tmp_path: Path, generate: Callable[..., None], task_set: Callable[..., TaskSet]
) -> None:
    generate(tmp_path / "a", count=16, seed=3, split="train")
    generate(tmp_path / "b", count=16, seed=3, split="train")
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "b")
    train = {t.instruction + (t.gold_patch or "") for t in task_set(64, 3, "train", str(tmp_path / "c"))}
    held_out = {t.instruction + (t.gold_patch or "") for t in task_set(64, 3, "eval", str(tmp_path / "c"))}
    assert len(train) == 64 and not train & held_out


def test_the_issue_hides_where_and_only_grep_shows_it(tmp_path: Path) -> None:
    """No issue names a module or a line; the grep names one line; places vary; the wrong constant has a decoy."""
    tasks = list(locate_task_set(64, 0, "train", str(tmp_path)))
    places = set()
    for task in tasks:
        line, module = where(task)
        places.add((line, module))
        assert ".py" not in task.instruction and not re.search(r"\bline\b", task.instruction)
        name = task.oracle_turns[0].split()[2]
        repo = Path(task.sandbox.workspace or "")
        hits = [
            (p.name, i + 1, text)
            for p in sorted(repo.glob("*.py"))
            for i, text in enumerate(p.read_text().splitlines())
            if name in text
        ]
        assert [(m, n) for m, n, _ in hits] == [(module, line)], hits
        bad = SED.match(task.oracle_turns[1])[2]  # type: ignore[index]
        elsewhere = [t for p in repo.glob("*.py") for t in p.read_text().splitlines() if bad in t and name not in t]
        assert elsewhere, f"{task.id}: the wrong constant {bad} appears only in the buggy line"
    assert len({line for line, _ in places}) >= 8 and len({module for _, module in places}) >= 5


def test_the_issue_names_the_function_in_the_tokens_grep_needs(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The name follows a space in the issue as in `grep -n NAME`, so the tiny model's byte-level BPE
    cuts it into the same tokens in both and the policy can copy it (a name in backquotes came out as other tokens)."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(tiny_model_dir)
    for task in locate_task_set(24, 0, "train", str(tmp_path)):
        name = oracle_turns(task)[0].split()[2]
        grep = tokenizer.encode(f"grep -n {name} *.py", add_special_tokens=False)
        issue = tokenizer.encode(task.instruction, add_special_tokens=False)
        named = tokenizer.encode(f" {name}", add_special_tokens=False)
        assert any(grep[i : i + len(named)] == named for i in range(len(grep))), name
        assert any(issue[i : i + len(named)] == named for i in range(len(issue))), (name, task.instruction)


def test_every_task_validates(tmp_path: Path) -> None:
    """Gold patch (and oracle) → reward 1, empty patch → reward 0, for each task of both splits."""
    tasks = [*locate_task_set(6, 0, "train", str(tmp_path)), *locate_task_set(6, 0, "eval", str(tmp_path))]

    async def main() -> None:
        backend = LocalSandboxBackend()
        try:
            validations = await asyncio.gather(*(validate_task(backend, t) for t in tasks))
        finally:
            await backend.aclose()
        assert all(v.valid for v in validations), [v.problems for v in validations if not v.valid]

    asyncio.run(main())


async def test_the_oracle_needs_the_observation(env: AsyncSWEEnv) -> None:
    """The oracle's grep shows the module:line its sed edits and solves the task; the same commands with
    the line (or the module) of another task, or a blind replacement in every file, earn reward 0."""
    tasks = list(env.task_set)[:4]
    for task in tasks:
        line, module = where(task)
        observations, reward, termination = await play(env, task, list(task.oracle_turns))
        assert (reward, termination) == (1.0, "submitted")
        assert f"{module}:{line}:" in observations[0]
        other_line = next(n for n, _ in map(where, env.task_set) if n != line)
        moved = task.oracle_turns[1].replace(f"'{line}s/", f"'{other_line}s/")
        assert (await play(env, task, [task.oracle_turns[0], moved]))[1] == 0.0
        other_module = next(m for _, m in map(where, env.task_set) if m != module)
        renamed = task.oracle_turns[1].replace(f" {module}", f" {other_module}")
        assert (await play(env, task, [task.oracle_turns[0], renamed]))[1] == 0.0
        blind = re.sub(r"'\d+s/", "'s/", task.oracle_turns[1]).replace(module, "*.py")
        assert (await play(env, task, [blind]))[1] == 0.0


async def test_oracle_replay_takes_a_turn_per_command(env: AsyncSWEEnv, tiny_model_dir: Path) -> None:
    """SFT's oracle replay: grep, sed, submit as three assistant turns, solved."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = next(iter(env.task_set))
    assert len(oracle_turns(task)) == 2
    policy = OraclePolicy(tokenizer, task, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert policy.longest_turn() == 51  # the submission (the sentinel is 50 tokens), then the turn's end
    trajectory = await run_agent(env, policy, tokenizer, task)
    assert [t.kind for t in trajectory.turns] == ["command", "command", "submit"]
    assert trajectory.reward == 1.0 and trajectory.termination == "submitted"
    assert f"{where(task)[1]}:{where(task)[0]}:" in trajectory.turns[0].observation


def test_an_oracle_longer_than_the_turn_cap_is_a_config_error(tmp_path: Path) -> None:
    tasks = list(locate_task_set(2, 0, "train", str(tmp_path)))
    check_oracle_fits(tasks, EnvConfig(max_turns=2))  # graded at the cap: two commands suffice
    check_oracle_fits(tasks, EnvConfig(max_turns=3, unsubmitted="zero"))
    with pytest.raises(ConfigError, match="takes 3 turns .* but env.max_turns is 2: raise env.max_turns"):
        check_oracle_fits(tasks, EnvConfig(max_turns=2, unsubmitted="zero"))


def test_mix_interleaves_families_and_rejects_shared_ids(tmp_path: Path) -> None:
    cache = str(tmp_path)
    mix = mixed_task_set(
        [
            {"name": "easy", "options": {"count": 2, "cache_dir": cache}},
            {"name": "locate", "options": {"count": 6, "cache_dir": cache}},
        ]
    )
    families = [task.id.split("-")[0] for task in mix]
    assert families == ["locate", "easy", "locate", "locate", "locate", "easy", "locate", "locate"]
    assert mix.name == "mix(easy-train,locate-train)"
    twice = [{"name": "locate", "options": {"count": 2, "cache_dir": cache}}] * 2
    with pytest.raises(ConfigError, match="more than one mixed task set: locate-train-0000"):
        list(mixed_task_set(twice))
    with pytest.raises(ConfigError, match="each set is"):
        mixed_task_set([{"name": "easy", "count": 2}])


def test_bad_options_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="locate task set split must be one of train, eval"):
        locate_task_set(split="test", cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="locate task set count must be >= 1"):
        locate_task_set(count=0, cache_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("settings", "capped", "submitted"),
    [
        ({"unsubmitted": "graded"}, (1.0, True), (1.0, True)),
        ({"unsubmitted": "zero"}, (0.0, False), (1.0, True)),
        ({"unsubmitted": "zero", "turn_cost": 0.125}, (-0.5, False), (0.625, True)),
    ],
)
async def test_unsubmitted_episodes_and_turn_costs(
    tmp_path: Path, settings: dict[str, Any], capped: tuple[float, bool], submitted: tuple[float, bool]
) -> None:
    """A fix the turn cap ends unsubmitted is graded (`graded`) or scored 0 ungraded (`zero`); each turn
    costs `turn_cost`; evaluation counts `resolved`, which no cost changes."""
    backend = LocalSandboxBackend()
    env = AsyncSWEEnv(locate_task_set(2, 0, "eval", str(tmp_path)), backend, max_turns=4, **settings)
    try:
        task = next(iter(env.task_set))
        await env.reset(options={"task": task})
        for command in [*task.oracle_turns, "git diff --stat", "ls"]:
            _, reward, terminated, truncated, info = await env.step(f"```bash\n{command}\n```")
        assert (terminated, truncated, info["termination"]) == (False, True, "max_turns")
        assert env.trajectory is not None
        assert (reward, env.trajectory.resolved) == capped
        assert ("grade_s" in info["timings"]) == (settings["unsubmitted"] == "graded")
        capped_run = env.trajectory
        _, reward, _ = await play(env, task, list(task.oracle_turns))
        assert (reward, env.trajectory.resolved) == submitted
        stats = episode_stats([capped_run, env.trajectory])
        assert stats == {"commands_mean": 3.0, "submit_rate": 0.5, "turn_cap_share": 0.5}
    finally:
        await env.close()
        await backend.aclose()


@pytest.mark.usefixtures("train_extra")
def test_a_locate_run_reports_how_episodes_end(tmp_path: Path) -> None:
    """`patchgym run` on locate: two-command oracle traces, eval and step metrics of episode endings, the plot."""
    cache = str(tmp_path / "cache")
    changes = {
        "tasks": {
            "train": {"name": "locate", "options": {"count": 4, "split": "train", "cache_dir": cache}},
            "eval": {"name": "locate", "options": {"count": 2, "split": "eval", "cache_dir": cache}},
        },
        "env": {"max_turns": 3, "unsubmitted": "zero"},
        "agent": {"max_new_tokens_per_turn": 40},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(run_config(tmp_path, steps=1, changes=changes)))
    from patchgym.cli import app

    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 0, result.output
    assert "submitted" in result.output and "at turn cap" in result.output
    run = tmp_path / "run"
    assert read_events(run, "sft_traces")[0]["kept"] == 4  # every two-command oracle replay solved its task
    warning = read_events(run, "warning")[0]  # the 51-token submission is over the 40-token turn cap
    assert "4 of 4 oracle replays have a turn longer than agent.max_new_tokens_per_turn (51 > 40" in warning["message"]
    for event in [*read_events(run, "eval"), *read_events(run, "step")]:
        assert {"commands_mean", "submit_rate", "turn_cap_share"} <= set(event)
        assert 0 <= event["submit_rate"] + event["turn_cap_share"] <= 1 and 0 <= event["commands_mean"] <= 3
    assert CliRunner().invoke(app, ["report", str(run)]).exit_code == 0
    assert (run / "report" / "endings.png").stat().st_size > 0
