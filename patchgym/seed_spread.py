"""Several runs of one config with different seeds: each figure as a range with its spread.

`spread_table(run_dirs)` gives held-out pass@1 per evaluation stage and the training reward
(mean of the first and of the last `window` GRPO steps) over the runs: the mean, the standard
deviation and the range [min, max], with how many runs reached each figure (a run still going,
or stopped, counts only where it got to). `spread_plot(run_dirs, out)` draws the training reward
per step, smoothed: each run, and the mean with a band from the lowest to the highest run.
`patchgym report RUN_A RUN_B RUN_C ...` prints the table and draws the plot.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from patchgym.core.metrics import read_events
from patchgym.report import SMOOTHING_STEPS, _plt, smoothed

STAGES = ("base", "sft", "grpo")


def spread(values: Sequence[float], percent: bool = True) -> str:
    """`62.5% ± 8.1 (54.2–70.8%, 3 runs)`: mean ± sample std, range and count; `-` without values."""
    if not values:
        return "-"
    scale, unit = (100.0, "%") if percent else (1.0, "")
    mean = statistics.fmean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    low, high = min(values) * scale, max(values) * scale
    digits = 1 if percent else 3
    runs = f"{len(values)} run" + ("s" if len(values) != 1 else "")
    return f"{mean:.{digits}f}{unit} ± {std:.{digits}f} ({low:.{digits}f}–{high:.{digits}f}{unit}, {runs})"


def stage_scores(run_dirs: Sequence[str | Path]) -> dict[str, list[float]]:
    """Held-out pass@1 of each evaluation stage, one value per run that reached it."""
    scores: dict[str, list[float]] = {}
    for run_dir in run_dirs:
        last = {e.get("stage", "eval"): e["pass_at_1"] for e in read_events(run_dir, "eval")}
        for stage, value in last.items():
            scores.setdefault(stage, []).append(value)
    ordered = [s for s in STAGES if s in scores] + [s for s in scores if s not in STAGES]
    return {stage: scores[stage] for stage in ordered}


def spread_table(run_dirs: Sequence[str | Path], window: int = 10) -> str:
    """The markdown table of the module docstring."""
    lines = [
        f"# Spread over {len(run_dirs)} runs",
        "",
        "| figure | mean ± std (range, runs) |",
        "|---|---|",
    ]
    for stage, values in stage_scores(run_dirs).items():
        lines.append(f"| held-out pass@1 after {stage} | {spread(values)} |")
    steps = [read_events(d, "step") for d in run_dirs]
    for part, pick in (("first", slice(None, window)), ("last", slice(-window, None))):
        means = [statistics.fmean(s["reward_mean"] for s in run[pick]) for run in steps if run]
        lines.append(f"| training reward, {part} {window} GRPO steps | {spread(means, percent=False)} |")
    reached = [run[-1]["step"] if run else 0 for run in steps]
    lines.append(f"| GRPO steps reached | {', '.join(str(n) for n in reached)} |")
    return "\n".join(lines) + "\n"


def spread_plot(run_dirs: Sequence[str | Path], out: Path, window: int = SMOOTHING_STEPS) -> Path:
    """The training reward of several runs per step (each smoothed): every run as a thin line as far as it
    got, and the mean and min–max band over the steps every run reached, into `out/reward_spread.png`."""
    plt = _plt()
    curves = [smoothed([s["reward_mean"] for s in read_events(d, "step")], window) for d in run_dirs]
    common = min((len(c) for c in curves), default=0)
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for n, curve in enumerate(c for c in curves if c):  # every run as far as it got, thin
        ax.plot(range(1, len(curve) + 1), curve, color="0.5", linewidth=0.8, label="each run" if n == 0 else None)
    if common:  # mean and range only where every run has a value: a run that stopped shifts nothing
        columns = [[c[i] for c in curves] for i in range(common)]
        x = list(range(1, common + 1))
        ax.fill_between(x, [min(v) for v in columns], [max(v) for v in columns], alpha=0.25, label="range over runs")
        ax.plot(x, [statistics.fmean(v) for v in columns], linewidth=2, label=f"mean over {len(curves)} runs")
    if any(curves):
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    ax.set(
        xlabel="GRPO step",
        ylabel=f"training reward (mean of {window} steps)",
        title=f"Training reward over {len(curves)} runs",
        ylim=(-0.05, 1.05),
    )
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "reward_spread.png", dpi=110)
    plt.close(fig)
    return out / "reward_spread.png"
