"""The event log, its sinks, and `patchgym report`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import matplotlib.axes
import pytest
from typer.testing import CliRunner

from patchgym.core.metrics import EventLog, read_events


def fake_run(run_dir: Path, steps: int = 6) -> None:
    rng = random.Random(0)
    log = EventLog(run_dir)
    log.emit("run", event="start", config={"model": "tiny"})
    log.emit("eval", stage="base", step=0, pass_at_1=0.1, tasks=10)
    for step in range(1, steps + 1):
        for i in range(8):
            reason = rng.choice(["submitted", "max_turns", "format_errors"])
            log.emit(
                "trajectory",
                step=step,
                task_id=f"t{i}",
                turns=rng.randint(2, 80),
                termination=reason,
                reward=float(reason == "submitted"),
                infra_error={"kind": "sandbox_lost"} if i == 7 and step == 2 else None,
                timings={"sandbox_start_s": 0.1, "commands_s": 2.0, "llm_s": 5.0, "grade_s": 0.3, "total_s": 7.4},
            )
        log.emit(
            "step",
            step=step,
            reward_mean=0.1 * step,
            reward_std=0.05,
            timings={"actor_update_s": 3.0, "rollout_wait_s": 1.0, "logprob_recompute_s": 0.5, "weight_sync_s": 0.2},
            limits={"concurrency": 8},
        )
    log.emit("eval", stage="grpo", step=steps, pass_at_1=0.3, tasks=10)
    log.close()


def test_events_round_trip_and_torn_last_line(tmp_path: Path) -> None:
    fake_run(tmp_path)
    assert len(read_events(tmp_path, "step")) == 6
    assert read_events(tmp_path, "eval")[-1]["pass_at_1"] == 0.3
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"kind": "step", "st')  # killed mid-write
    assert len(read_events(tmp_path, "step")) == 6
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    lines.insert(1, "garbage")
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="events.jsonl:2"):
        read_events(tmp_path)
    with pytest.raises(FileNotFoundError, match="run directory"):
        read_events(tmp_path / "nope")


def test_tensorboard_sink_writes_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from patchgym.core.metrics import TensorBoardSink

    log = EventLog(tmp_path, sinks=[TensorBoardSink(tmp_path / "tb")])
    for step in range(3):
        log.emit("step", step=step, reward_mean=step / 10, timings={"actor_update_s": 1.5})
    log.close()
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    rewards = [round(e.value, 5) for e in accumulator.Scalars("step/reward_mean")]
    assert rewards == [0.0, 0.1, 0.2]
    assert accumulator.Scalars("step/timings/actor_update_s")[0].value == 1.5


def test_wandb_sink_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from patchgym.core.metrics import WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    log = EventLog(tmp_path, sinks=[WandbSink(tmp_path, project="patchgym-test", mode="offline")])
    log.emit("step", step=1, reward_mean=0.5)
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_report_writes_plots_and_summary(tmp_path: Path) -> None:
    from patchgym.cli import app

    fake_run(tmp_path)
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "report"
    for name in ("reward.png", "step_time.png", "lengths.png", "sandbox.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, name
    summary = (out / "summary.md").read_text()
    assert "| training steps | 6 |" in summary
    assert "pass@1 (grpo) | 30.0% over 10 tasks" in summary
    assert "sandbox_lost 1" in summary
    assert "training 71%" in summary  # of 3 + 1 + 0.2 s: the old, always-0 log-prob recompute is left out
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])["kind"] == "run"


def test_report_on_a_missing_run_is_a_clear_error(tmp_path: Path) -> None:
    from patchgym.cli import app

    result = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "run directory" in result.output


def test_report_checks_the_group_accounting_and_compares_step_splits(tmp_path: Path) -> None:
    from patchgym.cli import app

    runs = []
    for name, pending in (("balanced", 2), ("broken", 3)):
        run = tmp_path / name
        log = EventLog(run)
        discarded = {"groups_stale": 1, "groups_cancelled_stale": 2}
        timings = {"actor_update_s": 2.0, "rollout_wait_s": 1.0, "weight_sync_s": 0.5, "orchestration_s": 0.5}
        totals = {"drawn": 9, "trained": 4, "discarded": discarded, "pending": pending, "episodes_discarded": 10}
        log.emit("step", step=1, timings=timings, episodes_discarded=10, accounting=totals)
        log.close()
        runs.append(run)
    result = CliRunner().invoke(app, ["report", *map(str, runs)])
    assert result.exit_code == 0, result.output
    balanced = (runs[0] / "report" / "summary.md").read_text()
    assert "| groups drawn | 9 = trained 4 + set aside 3 + pending 2 (holds) |" in balanced
    assert "cancelled_stale 2, stale 1" in balanced and "10 in all" in balanced
    assert "BROKEN: 10 accounted for" in (runs[1] / "report" / "summary.md").read_text()
    output = " ".join(result.output.split())
    assert f"| part | {runs[0]} | {runs[1]} |" in output and "| generation | 1.00 s (25%) | 1.00 s (25%) |" in output


def test_report_compares_how_episodes_ended_and_scored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two settings side by side: submit rate, turn-cap share and reward over the first and last
    steps, and pass@1 per stage (a stage one run lacks is a dash); their endings plotted together."""
    from patchgym.cli import app

    runs = []
    for name, submit in (("graded", 0.2), ("zero", 0.6)):
        run = tmp_path / name
        log = EventLog(run)
        log.emit("eval", stage="base", step=0, pass_at_1=0.0, tasks=4)
        for step in range(1, 13):  # the first 10 and the last 10 steps overlap in 8
            rate = submit + 0.03 * step
            log.emit("step", step=step, submit_rate=rate, turn_cap_share=1 - rate, reward_mean=rate / 4)
        if name == "zero":
            log.emit("eval", stage="grpo", step=12, pass_at_1=0.5, tasks=4)
        log.close()
        runs.append(run)
    plotted: list[tuple[str, list[float]]] = []
    plot = matplotlib.axes.Axes.plot

    def recording_plot(ax: Any, x: Any, y: Any, **kwargs: Any) -> Any:
        plotted.append((kwargs.get("label", ""), list(y)))
        return plot(ax, x, y, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    result = CliRunner().invoke(app, ["report", *map(str, runs)])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert f"| figure | {runs[0]} | {runs[1]} |" in output
    # the compared plot, after each run's own: both runs' submit rates, then both turn-cap shares
    assert (runs[0] / "report" / "endings_compared.png").stat().st_size > 0
    rates = {name: [submit + 0.03 * step for step in range(1, 13)] for name, submit in (("graded", 0.2), ("zero", 0.6))}
    assert plotted[-4:] == [
        (str(runs[0]), rates["graded"]),
        (str(runs[1]), rates["zero"]),
        (str(runs[0]), [1 - r for r in rates["graded"]]),
        (str(runs[1]), [1 - r for r in rates["zero"]]),
    ]
    # graded: steps 1-10 give 0.2 + 0.03 * 5.5 = 0.365, steps 3-12 give 0.2 + 0.03 * 7.5 = 0.425
    assert "| submitted, first 10 steps | 36.5% | 76.5% |" in output
    assert "| submitted, last 10 steps | 42.5% | 82.5% |" in output
    assert "| at the turn cap, last 10 steps | 57.5% | 17.5% |" in output
    assert "| reward, first 10 steps | 0.091 | 0.191 |" in output
    assert "| pass@1 (base) | 0.0% | 0.0% |" in output and "| pass@1 (grpo) | - | 50.0% |" in output
