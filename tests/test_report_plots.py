"""reward.png and lengths.png read right: a smoothed reward line over the faint raw one, a legend off
the data, one colour per termination reason in every lengths panel, and evaluation stages apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from patchgym import report


class KeptFigures:
    """matplotlib.pyplot, except that `close` keeps the figure for the test to read."""

    def __init__(self) -> None:
        self.plt = report._plt()
        self.figures: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plt, name)

    def close(self, fig: Any) -> None:
        self.figures.append(fig)


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> KeptFigures:
    figures = KeptFigures()
    monkeypatch.setattr(report, "_plt", lambda: figures)
    return figures


def trajectory(stage: str, termination: str, turns: int) -> dict[str, Any]:
    return {"kind": "trajectory", "stage": stage, "termination": termination, "turns": turns}


def test_smoothing_is_a_trailing_mean() -> None:
    assert report.smoothed([0.0, 1.0, 1.0, 0.0], 2) == [0.0, 0.5, 1.0, 0.5]
    assert report.smoothed([], 10) == []
    assert report.smoothed([0.2, 0.4], 10) == pytest.approx([0.2, 0.3])


def test_reward_plot_draws_raw_faint_and_smoothed_and_keeps_the_legend_off_the_data(
    tmp_path: Path, kept: KeptFigures
) -> None:
    steps = [{"step": n, "reward_mean": (n % 2) * 1.0, "reward_std": 0.1} for n in range(1, 41)]
    evals = [{"stage": "base", "step": 0, "pass_at_1": 0.0}, {"stage": "grpo", "step": 40, "pass_at_1": 0.9}]
    report._reward_plot(steps, evals, tmp_path, window=4)
    (fig,) = kept.figures
    ax = fig.axes[0]
    raw, smooth = ax.lines[:2]
    assert list(raw.get_ydata()) == [s["reward_mean"] for s in steps] and raw.get_alpha() < 0.5
    assert list(smooth.get_ydata())[3:] == pytest.approx([0.5] * 37)  # alternating 0/1 over 4 steps
    assert smooth.get_linewidth() > raw.get_linewidth()
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.get_window_extent())  # below the axes: it covers no data
    assert (tmp_path / "reward.png").exists()


def test_lengths_panels_share_reason_colours_and_keep_evaluation_stages_apart(
    tmp_path: Path, kept: KeptFigures
) -> None:
    trajectories = [
        trajectory("grpo", "submitted", 2),
        trajectory("grpo", "max_turns", 3),
        trajectory("eval-base", "format_errors", 3),  # a reason only in one panel shifts no other colour
        trajectory("eval-base", "max_turns", 3),
        trajectory("eval-sft", "submitted", 2),
        trajectory("eval-grpo", "submitted", 2),
        trajectory("eval-grpo", "submitted", 2),
    ]
    assert list(report.length_panels(trajectories)) == ["training", "eval: base", "eval: sft", "eval: grpo"]
    report._lengths_plot(trajectories, tmp_path)
    (fig,) = kept.figures
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["training (2)", "eval: base (2)", "eval: sft (1)", "eval: grpo (2)"]
    colours: dict[str, set[tuple[float, ...]]] = {}
    for ax in panels:
        for container in ax.containers:
            colours.setdefault(container.patches[0].get_label(), set()).add(tuple(container.patches[0].get_facecolor()))
    assert set(colours) == {"format_errors", "max_turns", "submitted"}
    assert all(len(seen) == 1 for seen in colours.values()), colours  # one colour per reason, every panel
    assert len({next(iter(seen)) for seen in colours.values()}) == 3  # and reasons apart
    heights = {c.patches[0].get_label(): sum(p.get_height() for p in c.patches) for c in panels[3].containers}
    assert heights["submitted"] == 2  # eval-grpo's episodes, not pooled with the other stages
    legend = fig.legends[0]
    assert [text.get_text() for text in legend.get_texts()] == ["format_errors", "max_turns", "submitted"]
