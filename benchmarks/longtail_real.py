"""The long tail on a real engine, small: sync vs one_step_off vs fully_async (+ turn cap), side by side.

What is real: the embedded engine (continuous batching, shared by every trajectory) serving the
tiny model, the local sandboxes (one per attempt, a real command each turn), the append-only
token context (generated tokens plus the command's output), and the `RolloutManager`. What is
scripted: whether an attempt solves its task. As in the reference, a few attempts (25%)
submit after a few turns (median 3) and the rest loop for 0.5-1.5x `--uncapped-turns` turns, or
until `--turn-cap` with the cap. The trainer, on its own devices in a real deployment, is a
`--train-s` wait, so the rows compare rollout scheduling on the same engine.

Every mode runs `--steps` steps after one fill-up step; the table gives the mean step time,
its ratio to sync, and the share of rollout time after 90% of a batch's trajectories had finished.

    python benchmarks/longtail_real.py [--steps 4] [--groups 4] [--group-size 4] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from longtail import endless_tasks
from rich.console import Console
from rich.table import Table

from patchgym.backends.inference.embedded import EmbeddedEngine
from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.inference import SamplingParams
from patchgym.core.rollout import RolloutConfig, RolloutManager
from patchgym.core.sandbox import SandboxSpec
from patchgym.core.tasks import Task
from patchgym.core.trajectory import Trajectory
from patchgym.models.tiny import init_tiny_model

COMMAND = "ls -la && head -c 400 notes.txt"
SUCCESS_P, SUCCESS_MEDIAN_TURNS = 0.25, 3


class EngineAgent:
    """Real generation and commands, scripted outcomes; see the module docstring."""

    def __init__(
        self, engine: EmbeddedEngine, sandboxes: LocalSandboxBackend, workspace: Path, args: argparse.Namespace
    ) -> None:
        self.engine, self.sandboxes, self.workspace, self.args = engine, sandboxes, workspace, args
        self.turn_cap: int | None = None
        self.rng = random.Random(args.seed)

    def _plan(self) -> tuple[int, bool]:
        if self.rng.random() < SUCCESS_P:
            return max(1, round(self.rng.lognormvariate(0, 0.5) * SUCCESS_MEDIAN_TURNS)), True
        loops = round(self.args.uncapped_turns * self.rng.uniform(0.5, 1.5))  # loops differ in length
        return min(loops, self.turn_cap or 10**9), False

    async def __call__(self, task: Task) -> Trajectory:
        turns, solved = self._plan()
        rng = random.Random(self.rng.getrandbits(32))
        context = [rng.randrange(3, self.args.vocab) for _ in range(self.args.prompt_tokens)]
        params = SamplingParams(max_new_tokens=self.args.tokens_per_turn, temperature=1.0)
        spec = SandboxSpec(workspace=self.workspace, labels={"patchgym.benchmark": "longtail_real"})
        async with await self.sandboxes.create(spec) as sandbox:
            for _ in range(turns):
                generation = await self.engine.generate(context, params)
                context += generation.token_ids
                result = await sandbox.exec(COMMAND, timeout_s=60)
                output = result.stdout.encode()[: self.args.observation_tokens]
                context += [3 + byte % (self.args.vocab - 3) for byte in output]
        trajectory = Trajectory(task.id, reward=1.0 if solved else 0.0)
        trajectory.termination = "submitted" if solved or self.turn_cap is None else "max_turns"
        return trajectory


async def run_mode(agent: EngineAgent, config: RolloutConfig, args: argparse.Namespace) -> dict[str, float]:
    manager = RolloutManager(endless_tasks(args.seed), agent, config)
    step_times, tails = [], []
    last = time.perf_counter()
    try:
        for step in range(args.steps + 1):
            batch = await manager.next_batch()
            assert batch is not None
            await asyncio.sleep(args.train_s)
            manager.publish(step + 1)
            now = time.perf_counter()
            if step:  # the first step includes the pipeline filling up
                step_times.append(now - last)
                tails.append(batch.metrics["tail_share_after_90pct"])
            last = now
    finally:
        await manager.aclose()
    return {"step_s": statistics.mean(step_times), "tail": statistics.mean(tails)}


async def main(args: argparse.Namespace) -> None:
    console = Console(width=120)
    base = {
        "group_size": args.group_size,
        "batch_groups": args.groups,
        "concurrency": args.concurrency,
        "zero_variance": "keep",
    }
    modes = {
        "sync": (RolloutConfig(mode="sync", **base), None),
        "one_step_off": (RolloutConfig(mode="one_step_off", **base), None),
        "fully_async": (RolloutConfig(mode="fully_async", max_staleness=2, **base), None),
        "fully_async + caps": (RolloutConfig(mode="fully_async", max_staleness=2, **base), args.turn_cap),
    }
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = init_tiny_model(Path(scratch) / "tiny", seed=args.seed)
        workspace = Path(scratch) / "workspace"
        workspace.mkdir()
        (workspace / "notes.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(100)))
        longest = math.ceil(1.5 * args.uncapped_turns)
        context = args.prompt_tokens + longest * (args.tokens_per_turn + args.observation_tokens) + 8
        engine = EmbeddedEngine(model_dir, max_context=context, max_batch_size=args.concurrency, stop_at_eos=False)
        sandboxes = LocalSandboxBackend()
        agent = EngineAgent(engine, sandboxes, workspace, args)
        results = {}
        try:
            for name, (config, cap) in modes.items():
                agent.turn_cap = cap
                started = time.perf_counter()
                results[name] = await run_mode(agent, config, args)
                console.print(f"{name}: {time.perf_counter() - started:.0f} s")
        finally:
            await engine.aclose()
            await sandboxes.aclose()
    table = Table(
        "mode",
        "mean step (s)",
        "speed-up vs sync",
        "rollout time after 90%",
        title=(
            f"{args.steps} steps of {args.groups} groups x {args.group_size}, concurrency {args.concurrency}, "
            f"trainer {args.train_s:.0f} s, {args.tokens_per_turn} tokens/turn, loops of {args.uncapped_turns} "
            f"turns on average (cap {args.turn_cap})"
        ),
    )
    for name, result in results.items():
        table.add_row(
            name,
            f"{result['step_s']:.1f}",
            f"{results['sync']['step_s'] / result['step_s']:.2f}x",
            f"{result['tail']:.0%}",
        )
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--train-s", type=float, default=3.0, help="the trainer's step, as a wait")
    parser.add_argument("--tokens-per-turn", type=int, default=24)
    parser.add_argument("--observation-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--uncapped-turns", type=int, default=24, help="mean turns of a looping attempt without a cap")
    parser.add_argument("--turn-cap", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
