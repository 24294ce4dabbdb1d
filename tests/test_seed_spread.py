"""Figures over seeds: the spread table and the reward band of `patchgym report` with three or more runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from patchgym.core.metrics import EventLog
from patchgym.seed_spread import spread, spread_plot, spread_table, stage_scores


def fake_seed(run_dir: Path, sft: float, grpo: float | None, rewards: list[float]) -> Path:
    log = EventLog(run_dir)
    log.emit("eval", stage="base", step=0, pass_at_1=0.0, tasks=4)
    log.emit("eval", stage="sft", step=0, pass_at_1=sft, tasks=4)
    for step, reward in enumerate(rewards, 1):
        log.emit("step", step=step, reward_mean=reward, reward_std=0.1, timings={})
    if grpo is not None:
        log.emit("eval", stage="grpo", step=len(rewards), pass_at_1=grpo, tasks=4)
    log.close()
    return run_dir


@pytest.fixture
def seeds(tmp_path: Path) -> list[Path]:
    return [
        fake_seed(tmp_path / "s0", 0.5, 0.75, [0.5] * 20),
        fake_seed(tmp_path / "s1", 0.75, 1.0, [1.0] * 20),
        fake_seed(tmp_path / "s2", 1.0, None, [0.0] * 5),  # stopped early: no final evaluation
    ]


def test_spread_is_mean_std_and_range() -> None:
    assert spread([0.5, 0.75, 1.0]) == "75.0% ± 25.0 (50.0–100.0%, 3 runs)"
    assert spread([0.25], percent=False) == "0.250 ± 0.000 (0.250–0.250, 1 run)"
    assert spread([]) == "-"


def test_table_counts_only_the_runs_that_reached_a_figure(seeds: list[Path]) -> None:
    assert stage_scores(seeds) == {"base": [0.0, 0.0, 0.0], "sft": [0.5, 0.75, 1.0], "grpo": [0.75, 1.0]}
    table = spread_table(seeds, window=5)
    assert "| held-out pass@1 after sft | 75.0% ± 25.0 (50.0–100.0%, 3 runs) |" in table
    assert "| held-out pass@1 after grpo | 87.5% ± 17.7 (75.0–100.0%, 2 runs) |" in table
    assert "| training reward, last 5 GRPO steps | 0.500 ± 0.500 (0.000–1.000, 3 runs) |" in table
    assert "| GRPO steps reached | 20, 20, 5 |" in table


def test_plot_band_spans_the_runs_that_reached_each_step(seeds: list[Path], tmp_path: Path, monkeypatch) -> None:
    from patchgym import report

    kept = []
    plt = report._plt()

    class Keep:
        def __getattr__(self, name: str):
            return getattr(plt, name)

        def close(self, fig) -> None:
            kept.append(fig)

    monkeypatch.setattr("patchgym.seed_spread._plt", lambda: Keep())
    path = spread_plot(seeds, tmp_path / "out", window=1)
    assert path.read_bytes().startswith(b"\x89PNG")
    ax = kept[0].axes[0]
    *runs, mean = ax.lines
    assert [len(line.get_ydata()) for line in runs] == [20, 20, 5]  # each run as far as it got
    assert list(mean.get_ydata()) == pytest.approx([0.5] * 5)  # the mean only where all three have a value


def test_report_with_three_runs_prints_the_spread(seeds: list[Path]) -> None:
    from patchgym.cli import app

    result = CliRunner().invoke(app, ["report", *map(str, seeds)])
    assert result.exit_code == 0, result.output
    assert "Spread over 3 runs" in result.output and (seeds[0] / "report" / "reward_spread.png").exists()
