"""What a run tells its watcher: pass@1 per evaluation, reward and pass rate on the bars, the
zero-reward warning, the resume hint after Ctrl-C, and a bad config refused before torch is imported."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from patchgym.core.metrics import read_events
from patchgym.core.trajectory import Trajectory
from patchgym.pipeline.feedback import (
    LIKELY_CAUSES,
    RunningScore,
    ZeroRewardWatch,
    eval_line,
    pass_rate,
    resume_hint,
    stats_text,
)
from patchgym.pipeline.progress import stage_progress
from tests.pipeline_support import merged, run_config


def episode(reward: float, resolved: bool, infra: bool = False) -> Trajectory:
    return Trajectory(task_id="t", reward=reward, grade={"resolved": resolved}, infra_error="lost" if infra else None)


def test_eval_line_names_pass_at_1_and_k() -> None:
    result = {"pass_at_1": 0.625, "pass_at_k": 0.9, "k": 4, "tasks": 48, "submit_rate": 0.97, "turn_cap_share": 0.03}
    assert eval_line("sft", result) == (
        "eval (sft): pass@1 62.5%, pass@4 90.0%, 48 tasks, submitted 97.0%, at the turn cap 3.0%"
    )
    assert eval_line("base", {"pass_at_1": 0, "pass_at_k": 0, "k": 1, "tasks": 2, "infra_errors": 1}).endswith(
        "infra errors 1"
    )


def test_running_score_and_pass_rate_skip_infra_errors() -> None:
    score = RunningScore()
    assert score.fields() == {}
    score.add(episode(1.0, True))
    score.add(episode(0.0, False, infra=True))  # not scored
    assert score.add(episode(0.0, False)) == {"reward": 0.5, "pass_rate": 0.5}
    assert pass_rate([episode(1.0, True), episode(0.0, False), episode(0.0, False)]) == pytest.approx(1 / 3)
    assert pass_rate([episode(0.0, False, infra=True)]) is None
    assert stats_text({"reward": 0.5312, "pass_rate": 0.41}) == "reward 0.531, pass 41%"
    assert stats_text({}) == ""


def test_the_terminal_bar_shows_eta_reward_and_pass_rate() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    progress = stage_progress(console, 30.0)
    with progress:
        bar = progress.add_task("grpo", total=10, unit="step")
        progress.update(bar, advance=3, reward=0.25, pass_rate=0.5)
        progress.refresh()
    shown = out.getvalue()
    assert "grpo" in shown and "3/10" in shown and "ETA" in shown
    assert "reward 0.250, pass 50%" in shown


def test_zero_reward_watch_warns_once_after_n_steps_in_a_row() -> None:
    watch = ZeroRewardWatch(3)
    stats = {"submit_rate": 0.1, "turn_cap_share": 0.9, "commands_mean": 2.5}
    assert [watch.observe(r, stats) for r in (0.0, 0.0, 0.5, 0.0, 0.0)] == [None] * 5  # a non-zero step resets
    message = watch.observe(0.0, stats)
    assert message is not None and "reward 0 for 3 steps in a row" in message
    assert "submitted 10%, at the turn cap 90%, 2.50 commands per episode" in message
    assert all(cause in message for cause in LIKELY_CAUSES) and "grpo.zero_reward_warn_steps" in message
    assert watch.observe(0.0, stats) is None  # once
    assert all(ZeroRewardWatch(None).observe(0.0, {}) is None for _ in range(50))


def test_resume_hint_quotes_the_run_dir() -> None:
    assert resume_hint("runs/my run") == "stopped; continue this run with: patchgym run --resume 'runs/my run'"


def write(tmp_path: Path, changes: dict[str, Any], steps: int = 1, sft: bool = True) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(merged(run_config(tmp_path, steps=steps, sft=sft), changes)))
    return path


@pytest.mark.usefixtures("train_extra")
def test_ctrl_c_prints_the_resume_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from patchgym.cli import app
    from patchgym.pipeline.run import Pipeline

    async def interrupted(self: Pipeline, *, resume: bool = False) -> dict[str, Any]:
        raise KeyboardInterrupt  # what asyncio.run raises after Ctrl-C cancelled the run

    monkeypatch.setattr(Pipeline, "run", interrupted)
    result = CliRunner().invoke(app, ["run", str(write(tmp_path, {}))])
    assert result.exit_code == 130
    assert f"continue this run with: patchgym run --resume {tmp_path / 'run'}" in " ".join(result.output.split())


@pytest.mark.usefixtures("train_extra")
def test_a_run_whose_rewards_stay_zero_warns_with_likely_causes(tmp_path: Path) -> None:
    """The random tiny policy without SFT never solves a task: every GRPO step earns 0."""
    from patchgym.cli import app

    changes = {"grpo": {"zero_reward_warn_steps": 2}, "eval": {"limit": 1}}
    result = CliRunner().invoke(app, ["run", str(write(tmp_path, changes, steps=2, sft=False))])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "warning: every GRPO episode has earned reward 0 for 2 steps in a row" in output
    assert "Likely causes:" in output and "eval (base): pass@1 0.0%" in output
    (event,) = read_events(tmp_path / "run", "warning")
    assert event["stage"] == "grpo" and event["step"] == 2


GOOD = {"tasks": {"train": {"name": "easy"}, "eval": {"name": "easy"}}}
BAD = {"tasks": {"train": {"name": "easy"}, "eval": {"name": "easy", "options": {"cont": 2}}}}


def test_a_bad_config_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """`patchgym run bad.yaml` in a fresh interpreter: refused, with torch and transformers never imported."""
    bad_model = {**GOOD, "model": {"path": "./no/such/folder"}}
    bad_sandbox = {**GOOD, "sandbox": {"name": "local", "options": {"isolaton": "none"}}}
    for bad in ({"grpo": {"stepz": 3}, **GOOD}, BAD, bad_model, bad_sandbox):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        script = (
            "import sys\nfrom patchgym import cli\nsys.argv = ['patchgym', 'run', sys.argv[1]]\n"
            "try:\n    cli.app()\nexcept SystemExit as exc:\n"
            "    print('exit', exc.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
        )
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
        assert done.stdout.splitlines()[-1] == "exit 2 False False", done.stdout + done.stderr
        assert "error:" in done.stdout
