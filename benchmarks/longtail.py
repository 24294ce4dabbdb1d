"""The long tail, simulated with the reference run's shape: step time of sync vs fully async.

A simulated policy and sandbox reproduce the reference's trajectories (recipe-facts.md):
~15% of attempts succeed after a median of 8 turns; failing attempts loop until a cap (200+
turns when uncapped, 80 with the turn cap); each turn costs an LLM call (4.4 s) plus a
command (1 s); attempts at one task differ up to 2.5x in speed; a trainer step costs 147 s
(131 s actor update + 16 s log-prob recompute). Simulated seconds run `--scale` times faster.

The same RolloutManager drives every mode, in one run:
- `sync`: on-policy, no turn cap (the reference's starting point);
- `fully_async`: max staleness 1 plus over-sampling, no turn cap;
- `fully_async + caps`: the same with the 80-turn cap.
Prints the mean step time (simulated seconds), the speed-up over sync, and the share of rollout
time spent after 90% of a batch's trajectories had finished.

    python benchmarks/longtail.py [--steps 6] [--groups 16] [--group-size 8] [--scale 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from patchgym.core.rollout import RolloutConfig, RolloutManager
from patchgym.core.sandbox import Sandbox, SandboxSpec
from patchgym.core.tasks import Grade, Grader, Task
from patchgym.core.trajectory import Trajectory

LLM_S, COMMAND_S, TRAIN_S = 4.4, 1.0, 147.0
SUCCESS_P, SUCCESS_MEDIAN_TURNS, TURN_CAP = 0.15, 8, 80


class _Simulated(Grader):
    async def grade(self, sandbox: Sandbox) -> Grade:
        raise NotImplementedError("simulated tasks are never graded")


def endless_tasks(seed: int) -> Iterator[Task]:
    rng = random.Random(seed)
    while True:
        yield Task(f"task-{rng.getrandbits(32):08x}", "", SandboxSpec(), _Simulated())


class SimulatedAgent:
    """Turn counts and speeds with the reference's shape; sleeps stand in for LLM and commands."""

    def __init__(self, *, turn_cap: int | None, scale: float, seed: int) -> None:
        self.turn_cap = turn_cap
        self.scale = scale
        self.rng = random.Random(seed)

    def _turns(self) -> tuple[int, bool]:
        if self.rng.random() < SUCCESS_P:
            return max(2, round(self.rng.lognormvariate(0, 0.6) * SUCCESS_MEDIAN_TURNS)), True
        loops = round(200 + self.rng.expovariate(1 / 40))  # failing agents loop 200+ turns
        return (min(loops, self.turn_cap) if self.turn_cap else loops), False

    async def __call__(self, task: Task) -> Trajectory:
        turns, solved = self._turns()
        speed = self.rng.uniform(1.0, 2.5)  # attempts at one task differ up to 2.5x
        await asyncio.sleep(turns * (LLM_S + COMMAND_S) * speed / self.scale)
        trajectory = Trajectory(task.id, reward=1.0 if solved else 0.0)
        trajectory.termination = "submitted" if solved or turns < (self.turn_cap or 10**9) else "max_turns"
        return trajectory


async def run_mode(
    config: RolloutConfig, turn_cap: int | None, steps: int, scale: float, seed: int
) -> dict[str, float]:
    manager = RolloutManager(endless_tasks(seed), SimulatedAgent(turn_cap=turn_cap, scale=scale, seed=seed), config)
    step_times, tails = [], []
    last = time.perf_counter()
    try:
        for step in range(steps + 1):
            batch = await manager.next_batch()
            assert batch is not None
            await asyncio.sleep(TRAIN_S / scale)
            manager.publish(step + 1)
            now = time.perf_counter()
            if step:  # the first step includes the pipeline filling up
                step_times.append((now - last) * scale)
                tails.append(batch.metrics["tail_share_after_90pct"])
            last = now
    finally:
        await manager.aclose()
    return {"step_s": statistics.mean(step_times), "tail": statistics.mean(tails)}


async def main(steps: int, groups: int, group_size: int, scale: float, seed: int) -> None:
    trajectories = groups * group_size
    base = {"group_size": group_size, "batch_groups": groups, "concurrency": trajectories * 2, "zero_variance": "keep"}
    asynchronous = RolloutConfig(mode="fully_async", max_staleness=1, oversample_groups=groups // 2, **base)
    modes = {
        "sync": (RolloutConfig(mode="sync", **base), None),
        "fully_async": (asynchronous, None),
        "fully_async + caps": (asynchronous, TURN_CAP),
    }
    results = {}
    with Progress(console=Console(stderr=True), transient=True) as progress:
        bar = progress.add_task("simulating", total=len(modes))
        for name, (config, cap) in modes.items():
            results[name] = await run_mode(config, cap, steps, scale, seed)
            progress.advance(bar)
    table = Table(
        "mode",
        "mean step (simulated s)",
        "speed-up vs sync",
        "rollout time after 90% finished",
        title=f"{steps} steps of {groups} groups x {group_size}, trainer step {TRAIN_S:.0f} s",
    )
    for name, result in results.items():
        speedup = results["sync"]["step_s"] / result["step_s"]
        table.add_row(name, f"{result['step_s']:.0f}", f"{speedup:.1f}x", f"{result['tail']:.0%}")
    Console(width=120).print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--scale", type=float, default=1000.0, help="simulated seconds per real second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.groups, args.group_size, args.scale, args.seed))
