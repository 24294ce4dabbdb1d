"""`patchgym report RUN_DIR`: PNG plots and a markdown summary from a run's events.jsonl.

Writes into RUN_DIR/report/: reward.png (training reward and pass@1 of each evaluation over
steps), step_time.png (stacked split of each step's time), lengths.png (trajectory turns by
termination reason), sandbox.png (phase times per trajectory), and summary.md.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from patchgym.core.metrics import read_events

STEP_PARTS = ("actor_update_s", "rollout_wait_s", "logprob_recompute_s", "weight_sync_s")
PHASES = ("sandbox_start_s", "commands_s", "llm_s", "grade_s")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _reward_plot(steps: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if steps:
        x = [s["step"] for s in steps]
        mean = [s.get("reward_mean", 0.0) for s in steps]
        std = [s.get("reward_std", 0.0) for s in steps]
        ax.plot(x, mean, label="training reward (batch mean)")
        ax.fill_between(
            x,
            [m - d for m, d in zip(mean, std, strict=True)],
            [m + d for m, d in zip(mean, std, strict=True)],
            alpha=0.2,
        )
    for e in evals:
        ax.scatter([e.get("step", 0)], [e["pass_at_1"]], marker="D", zorder=3)
        ax.annotate(f"{e.get('stage', 'eval')}: {e['pass_at_1']:.1%}", (e.get("step", 0), e["pass_at_1"]), fontsize=8)
    ax.set(xlabel="step", ylabel="reward / pass@1", title="Reward and pass@1", ylim=(-0.05, 1.05))
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)
    plt.close(fig)


def _step_time_plot(steps: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    bottom = [0.0] * len(steps)
    for part in STEP_PARTS:
        values = [s.get("timings", {}).get(part, 0.0) for s in steps]
        ax.bar(x, values, bottom=bottom, label=part.removesuffix("_s").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="step", ylabel="seconds", title="Where each step's time went")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)


def _lengths_plot(trajectories: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    by_reason: dict[str, list[int]] = defaultdict(list)
    for t in trajectories:
        by_reason[t.get("termination") or "none"].append(int(t.get("turns", 0)))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if by_reason:
        ax.hist(list(by_reason.values()), bins=20, stacked=True, label=list(by_reason))
        ax.legend(title="termination")
    ax.set(xlabel="turns", ylabel="trajectories", title="Trajectory length by termination reason")
    fig.tight_layout()
    fig.savefig(out / "lengths.png", dpi=110)
    plt.close(fig)


def _sandbox_plot(trajectories: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    data = [[t.get("timings", {}).get(p, 0.0) for t in trajectories] for p in PHASES]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if trajectories:
        ax.boxplot(data, tick_labels=[p.removesuffix("_s").replace("_", " ") for p in PHASES])
    ax.set(ylabel="seconds per trajectory", title="Trajectory phase times")
    fig.tight_layout()
    fig.savefig(out / "sandbox.png", dpi=110)
    plt.close(fig)


def _endings_plot(steps: list[dict[str, Any]], out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    for key, label in (("submit_rate", "submitted"), ("turn_cap_share", "ended at the turn cap")):
        ax.plot(x, [s.get(key, 0.0) for s in steps], label=label)
    ax.set(xlabel="step", ylabel="share of the step's episodes", title="How episodes ended", ylim=(-0.05, 1.05))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "endings.png", dpi=110)
    plt.close(fig)


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
        totals = {p: sum(s.get("timings", {}).get(p, 0.0) for s in steps) for p in STEP_PARTS}
        whole = sum(totals.values()) or 1.0
        split = ", ".join(f"{p.removesuffix('_s')} {v / whole:.0%}" for p, v in totals.items())
        row("mean step time", f"{whole / len(steps):.1f} s ({split})")
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
    _endings_plot(steps, out)
    (out / "summary.md").write_text(_summary(steps, trajectories, evals))
    return out
