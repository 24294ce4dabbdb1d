"""Rollouts thrown away when a stage starts at a version above 0: before and after stage-relative gating.

GRPO after SFT starts at policy version 1, and a resumed run at its checkpoint's version. When
capacity gating counted the absolute version, such a start admitted `v * batch_groups` extra
groups at once; they ran with weights soon too stale and were set aside. This runs the quickstart's
rollout settings (configs/quickstart.yaml: group size 4, 8 groups per step, 32 episodes at once,
fully async with staleness 1, zero-variance groups kept) with a stand-in episode (a sleep with a
long-tailed duration; episode and trainer times as configured below, `--scale` times faster),
under the rollout manager of this tree ("after") and of `--before` (a git revision, default the
last one before the fix), in one process, and prints per start version: groups started at the
start version, groups and episodes set aside per step, and the share of episodes set aside.

    python benchmarks/rollout_waste.py [--steps 20] [--starts 1 21] [--before c461454] [--scale 50]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from patchgym.core import rollout as after_module
from patchgym.core.sandbox import Sandbox, SandboxSpec
from patchgym.core.tasks import Grade, Grader, Task
from patchgym.core.trajectory import Trajectory, Turn

ROOT = Path(__file__).resolve().parents[1]
EPISODE_MEDIAN_S, EPISODE_SIGMA, TRAIN_S = 1.0, 0.6, 1.5


class _StandIn(Grader):
    async def grade(self, sandbox: Sandbox) -> Grade:
        raise NotImplementedError("stand-in tasks are never graded")


def module_at(revision: str) -> types.ModuleType:
    """core/rollout.py as it was at `revision` (git), imported under another name."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:patchgym/core/rollout.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType(f"rollout_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:patchgym/core/rollout.py", "exec"), module.__dict__)
    return module


class StandInEpisodes:
    """Episodes of one task id per group (unique tasks), recording the version each started at."""

    def __init__(self, seed: int, scale: float) -> None:
        self.rng, self.scale = random.Random(seed), scale
        self.started: Counter[str] = Counter()
        self.drawn_at: Counter[int] = Counter()
        self.version: Callable[[], int] = lambda: 0

    def tasks(self) -> Iterator[Task]:
        for n in range(10**9):
            self.drawn_at[self.version()] += 1  # the producer draws a task as it starts its group
            yield Task(f"t{n}", "", SandboxSpec(), _StandIn())

    async def __call__(self, task: Task) -> Trajectory:
        self.started[task.id] += 1
        await asyncio.sleep(self.rng.lognormvariate(0, EPISODE_SIGMA) * EPISODE_MEDIAN_S / self.scale)
        trajectory = Trajectory(task.id, turns=[Turn("a", "o", "command")])
        trajectory.reward, trajectory.termination = float(self.rng.random() < 0.75), "submitted"
        return trajectory


async def measure(module: types.ModuleType, rollout: dict[str, Any], start: int, steps: int, scale: float) -> dict:
    episodes = StandInEpisodes(seed=start, scale=scale)
    manager = module.RolloutManager(episodes.tasks(), episodes, module.RolloutConfig(**rollout))
    manager.version = start  # how the pipeline started a stage before managers took `version`
    episodes.version = lambda: manager.version
    trained: set[str] = set()
    for step in range(steps):
        batch = await manager.next_batch()
        trained |= {g.task.id for g in batch.groups}
        await asyncio.sleep(TRAIN_S / scale)
        manager.publish(start + step + 1)
    pending = {g.task.id for g in manager.pending_groups()}
    await manager.aclose()
    set_aside = [t for t in episodes.started if t not in trained and t not in pending]
    wasted = sum(episodes.started[t] for t in set_aside)
    return {
        "at_start": episodes.drawn_at[start],
        "groups_per_step": len(set_aside) / steps,
        "episodes_per_step": wasted / steps,
        "share": wasted / max(1, sum(episodes.started.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--starts", type=int, nargs="+", default=[1, 21], help="versions a stage starts at")
    parser.add_argument("--before", default="c461454", help="git revision of the rollout manager to compare")
    parser.add_argument("--scale", type=float, default=50.0, help="simulated seconds run this many times faster")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rollout = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["grpo"]["rollout"]
    modules = {f"before ({args.before})": module_at(args.before), "after": after_module}
    table = Table(
        "start version",
        "manager",
        "groups started at it",
        "groups set aside / step",
        "episodes set aside / step",
        "share of episodes set aside",
        title=f"quickstart rollout {rollout}, stand-in episodes, {args.steps} steps, median of {args.repeats}",
    )
    for start in args.starts:
        results = {}
        for label, module in modules.items():
            runs = [asyncio.run(measure(module, rollout, start, args.steps, args.scale)) for _ in range(args.repeats)]
            results[label] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            r = results[label]
            table.add_row(
                str(start),
                label,
                f"{r['at_start']:.0f}",
                f"{r['groups_per_step']:.2f}",
                f"{r['episodes_per_step']:.1f}",
                f"{r['share']:.1%}",
            )
        before, after = results.values()
        ratio = before["episodes_per_step"] / after["episodes_per_step"] if after["episodes_per_step"] else float("inf")
        table.add_row(
            "", "before / after", f"{before['at_start'] / max(1, after['at_start']):.1f}x", "", f"{ratio:.1f}x", ""
        )
    Console().print(table)


if __name__ == "__main__":
    main()
