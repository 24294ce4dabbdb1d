"""`patchgym report RUN_DIR`: PNG plots and a markdown summary from a run's events.jsonl.

Writes into RUN_DIR/report/: reward.png (training reward over steps, raw and smoothed, and pass@1
of each evaluation; the legend below the axes), step_time.png (stacked split of each step's time),
lengths.png (trajectory turns by termination reason: one panel for training and one per
evaluation stage, each reason one colour in every panel), sandbox.png (phase times per trajectory, log
scale), endings.png (submit rate and turn-cap share per step), and summary.md (with the group
accounting and the step-time split). `compare_step_split` and `compare_outcomes` put the step-time
split, and how episodes ended and scored, of several runs side by side; `compare_endings` plots
their endings together.

The step-time split: generation (the trainer waiting for rollouts), training (the actor update),
weight sync, and orchestration (the rest of the step's wall time). There is no separate log-prob
recompute: GRPO's importance weights compare the engine's log-probs with the trainer's, computed
in the same forward pass as the update, so that time is inside "training" (runs logged before
this split show `logprob_recompute_s`, always 0, which is ignored).
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from patchgym.core.metrics import read_events

STEP_PARTS = {
    "rollout_wait_s": "generation",
    "actor_update_s": "training",
    "weight_sync_s": "weight sync",
    "orchestration_s": "orchestration",
}
PHASES = ("sandbox_start_s", "commands_s", "llm_s", "grade_s")
SMOOTHING_STEPS = 10
"""reward.png's smoothed line: the mean of the last this many steps (the raw line is drawn faintly)."""


def smoothed(values: list[float], window: int) -> list[float]:
    """The trailing mean of `values` over `window` points (fewer at the start)."""
    out, total = [], 0.0
    for n, value in enumerate(values):
        total += value
        if n >= window:
            total -= values[n - window]
        out.append(total / min(n + 1, window))
    return out


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _reward_plot(
    steps: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path, window: int = SMOOTHING_STEPS
) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.2))
    if steps:
        x = [s["step"] for s in steps]
        mean = [s.get("reward_mean", 0.0) for s in steps]
        std = [s.get("reward_std", 0.0) for s in steps]
        ax.plot(x, mean, color="C0", alpha=0.3, linewidth=0.8, label="training reward (batch mean)")
        ax.plot(x, smoothed(mean, window), color="C0", linewidth=2, label=f"smoothed (mean of {window} steps)")
        ax.fill_between(  # rewards lie in [0, 1]: so does the band
            x,
            [max(0.0, m - d) for m, d in zip(mean, std, strict=True)],
            [min(1.0, m + d) for m, d in zip(mean, std, strict=True)],
            color="C0",
            alpha=0.1,
            label="±1 std within the batch (clipped to [0, 1])",
        )
    at_step: Counter[int] = Counter()
    for n, e in enumerate(evals):
        step = e.get("step", 0)
        label = "held-out pass@1" if n == 0 else None
        ax.scatter([step], [e["pass_at_1"]], marker="D", color="C3", zorder=3, label=label)
        offset = (4, 4 + 11 * at_step[step])  # evaluations at one step (base and SFT: 0) stacked, not overlaid
        at_step[step] += 1
        text = f"{e.get('stage', 'eval')}: {e['pass_at_1']:.1%}"
        ax.annotate(text, (step, e["pass_at_1"]), xytext=offset, textcoords="offset points", fontsize=8)
    ax.set(xlabel="step", ylabel="reward / pass@1", title="Reward and pass@1", ylim=(-0.05, 1.05))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)  # off the data
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)
    plt.close(fig)


def _step_time_plot(steps: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    bottom = [0.0] * len(steps)
    for part, label in STEP_PARTS.items():
        values = [s.get("timings", {}).get(part, 0.0) for s in steps]
        ax.bar(x, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="step", ylabel="seconds", title="Where each step's time went")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the bars, never on them
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)


def length_panels(trajectories: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """lengths.png's panels: training episodes, then each evaluation stage on its own (never pooled)."""
    panels: dict[str, list[dict[str, Any]]] = {"training": []}
    for t in trajectories:
        stage = str(t.get("stage", ""))
        panels.setdefault("training" if not stage.startswith("eval") else stage.replace("eval-", "eval: "), []).append(
            t
        )
    return panels


def reason_colours(trajectories: list[dict[str, Any]]) -> dict[str, str]:
    """One colour per termination reason, the same in every panel."""
    reasons = sorted({t.get("termination") or "none" for t in trajectories})
    return {reason: f"C{n % 10}" for n, reason in enumerate(reasons)}


def _lengths_plot(trajectories: list[dict[str, Any]], out: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    panels = length_panels(trajectories)
    colours = reason_colours(trajectories)
    turns = [int(t.get("turns", 0)) for t in trajectories] or [0]
    bins = [b - 0.5 for b in range(min(turns), max(turns) + 2)]  # one bar per turn count
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 1.5, 4.5), sharex=True, squeeze=False)
    for ax, (title, group) in zip(axes[0], panels.items(), strict=True):
        by_reason: dict[str, list[int]] = {reason: [] for reason in colours}
        for t in group:
            by_reason[t.get("termination") or "none"].append(int(t.get("turns", 0)))
        if group:
            ax.hist(
                list(by_reason.values()),
                bins=bins,
                stacked=True,
                color=[colours[r] for r in by_reason],
                label=list(by_reason),
            )
        ax.set(xlabel="turns", title=f"{title} ({len(group)})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # turns are whole numbers
    axes[0][0].set_ylabel("trajectories")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in colours.values()]
    fig.legend(handles, list(colours), title="termination", fontsize=8, loc="center right")  # beside the panels
    fig.suptitle("Trajectory length by termination reason")
    fig.tight_layout(rect=(0, 0, 1 - 1.4 / fig.get_figwidth(), 1))
    fig.savefig(out / "lengths.png", dpi=110)
    plt.close(fig)


def _sandbox_plot(trajectories: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    floor = 1e-3  # a log scale has no 0: phases under a millisecond are drawn at 1 ms
    data = [[max(floor, t.get("timings", {}).get(p, 0.0)) for t in trajectories] for p in PHASES]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if trajectories:
        ax.boxplot(data, tick_labels=[p.removesuffix("_s").replace("_", " ") for p in PHASES])
    ax.set_yscale("log")  # a few long outliers must not flatten every box
    ax.set(
        xlabel="phase of the trajectory",
        ylabel="seconds per trajectory (log scale; < 1 ms at 1 ms)",
        title="Trajectory phase times",
    )
    fig.tight_layout()
    fig.savefig(out / "sandbox.png", dpi=110)
    plt.close(fig)


def endings_plot(runs: dict[str, list[dict[str, Any]]], out: Path, name: str = "endings.png") -> Path:
    """Plot the submit rate and the turn-cap share per step of each run (label -> its step events)
    in two panels into `out/name`; returns the file."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    panels = (("submit_rate", "submitted"), ("turn_cap_share", "ended at the turn cap"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for label, steps in runs.items():
            ax.plot([s["step"] for s in steps], [s.get(key, 0.0) for s in steps], label=label)
        ax.set(xlabel="step", title=title, ylim=(-0.05, 1.05))
        ax.legend(fontsize=8, loc="best")
    axes[0].set_ylabel("share of the step's episodes")
    fig.suptitle("How training episodes ended")
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return out / name


def _summary(steps: list[dict[str, Any]], trajectories: list[dict[str, Any]], evals: list[dict[str, Any]]) -> str:
    lines = ["# Run summary", "", "| figure | value |", "|---|---|"]

    def row(name: str, value: str) -> None:
        lines.append(f"| {name} | {value} |")

    row("training steps", str(len(steps)))
    row("trajectories", str(len(trajectories)))
    if steps:
        row(
            "reward, first → last step", f"{steps[0].get('reward_mean', 0):.3f} → {steps[-1].get('reward_mean', 0):.3f}"
        )
        split = step_split(steps)
        parts = ", ".join(f"{label} {split[label] / (split['step'] or 1.0):.0%}" for label in STEP_PARTS.values())
        row("mean step time", f"{split['step']:.1f} s ({parts})")
        lines.extend(_accounting_rows(steps))
    for e in evals:
        row(f"pass@1 ({e.get('stage', 'eval')})", f"{e['pass_at_1']:.1%} over {e.get('tasks', '?')} tasks")
    if trajectories:
        reasons = Counter(t.get("termination") or "none" for t in trajectories)
        row("terminations", ", ".join(f"{k} {v}" for k, v in reasons.most_common()))
        row("share at the turn cap", f"{reasons.get('max_turns', 0) / len(trajectories):.1%}")
        infra = Counter(t["infra_error"]["kind"] for t in trajectories if t.get("infra_error"))
        row("infrastructure errors", ", ".join(f"{k} {v}" for k, v in infra.items()) or "none")
        total = [t.get("timings", {}).get("total_s", 0.0) for t in trajectories]
        row("median trajectory time", f"{statistics.median(total):.1f} s")
    return "\n".join(lines) + "\n"


def step_split(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of each part (by its label) and of the whole step."""
    means = {
        label: sum(s.get("timings", {}).get(part, 0.0) for s in steps) / max(1, len(steps))
        for part, label in STEP_PARTS.items()
    }
    return {**means, "step": sum(means.values())}


def _accounting_rows(steps: list[dict[str, Any]]) -> list[str]:
    """Where every group drawn went, from the running totals of the last step."""
    totals = steps[-1].get("accounting")
    if totals is None:
        return []
    discarded = totals["discarded"]
    balance = totals["trained"] + sum(discarded.values()) + totals["pending"]
    holds = "holds" if balance == totals["drawn"] else f"BROKEN: {balance} accounted for"
    reasons = ", ".join(f"{k.removeprefix('groups_')} {v}" for k, v in sorted(discarded.items())) or "none"
    wasted = [s.get("episodes_discarded", 0) for s in steps]
    return [
        f"| groups drawn | {totals['drawn']} = trained {totals['trained']} + set aside {sum(discarded.values())} "
        f"+ pending {totals['pending']} ({holds}) |",
        f"| groups set aside, by reason | {reasons} |",
        f"| episodes thrown away (set-aside groups) | {totals['episodes_discarded']} in all; per step median "
        f"{statistics.median(wasted):g}, max {max(wasted)} |",
    ]


def compare_step_split(run_dirs: list[str | Path]) -> str:
    """A markdown table of the step-time split of several runs, side by side (mean seconds per step)."""
    splits = [step_split(read_events(d, "step")) for d in run_dirs]
    head = ["part", *(str(d) for d in run_dirs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in [*STEP_PARTS.values(), "step"]:
        cells = [f"{split[label]:.2f} s ({split[label] / (split['step'] or 1.0):.0%})" for split in splits]
        lines.append(f"| {'whole step' if label == 'step' else label} | " + " | ".join(cells) + " |")
    return "\n".join(["# Step-time split, mean per step", "", *lines]) + "\n"


def compare_endings(run_dirs: list[str | Path], out: Path) -> Path:
    """Plot the submit rate and turn-cap share per step of several runs together into
    `out/endings_compared.png`; returns the file."""
    return endings_plot({str(d): read_events(d, "step") for d in run_dirs}, out, "endings_compared.png")


def compare_outcomes(run_dirs: list[str | Path], window: int = 10) -> str:
    """A markdown table of how several runs' training episodes ended and scored (submit rate, turn-cap
    share and reward, each a mean over the first and over the last `window` steps) and of their
    held-out pass@1 per evaluation stage, side by side."""
    runs = [(read_events(d, "step"), read_events(d, "eval")) for d in run_dirs]
    head = ["figure", *(str(d) for d in run_dirs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, shown in (
        ("submit_rate", "submitted", "{:.1%}"),
        ("turn_cap_share", "at the turn cap", "{:.1%}"),
        ("reward_mean", "reward", "{:.3f}"),
    ):
        for part, pick in (("first", slice(None, window)), ("last", slice(-window, None))):
            cells = []
            for steps, _ in runs:
                values = [s[key] for s in steps[pick] if key in s]
                cells.append(shown.format(statistics.fmean(values)) if values else "-")
            lines.append(f"| {label}, {part} {window} steps | " + " | ".join(cells) + " |")
    stages = list(dict.fromkeys(e.get("stage", "eval") for _, evals in runs for e in evals))
    for stage in stages:
        cells = []
        for _, evals in runs:
            scores = [e["pass_at_1"] for e in evals if e.get("stage", "eval") == stage]
            cells.append(f"{scores[-1]:.1%}" if scores else "-")
        lines.append(f"| pass@1 ({stage}) | " + " | ".join(cells) + " |")
    return "\n".join(["# Endings and scores", "", *lines]) + "\n"


def write_report(run_dir: str | Path) -> Path:
    """Write the plots and summary of `run_dir` into `run_dir/report`; returns that folder."""
    events = read_events(run_dir)
    steps = [e for e in events if e["kind"] == "step"]
    trajectories = [e for e in events if e["kind"] == "trajectory"]
    evals = [e for e in events if e["kind"] == "eval"]
    out = Path(run_dir) / "report"
    out.mkdir(exist_ok=True)
    _reward_plot(steps, evals, out)
    _step_time_plot(steps, out)
    _lengths_plot(trajectories, out)
    _sandbox_plot(trajectories, out)
    endings_plot({Path(run_dir).name: steps}, out)
    (out / "summary.md").write_text(_summary(steps, trajectories, evals))
    return out
