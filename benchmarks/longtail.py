"""The long tail, simulated with the reference run's shape and a shared engine: step time per mode.

Trajectories follow the reference (recipe-facts.md): ~15% of attempts succeed after a median of
8 turns; failing attempts loop until a cap (200+ turns uncapped, 80 with the turn cap); attempts
at one task differ up to 2.5x; each turn runs a command (1 s) and one LLM call; a trainer step
costs 147 s (131 s actor update + 16 s log-prob recompute). The batch is the reference's: 48
groups x 8 = 384 trajectories, on 24 engines (16 trajectories each).

LLM calls are served by simulated engines with a throughput curve (benchmarks/sim_clock.py): a
decode step's time grows with the sequences in flight, and a turn's prefill costs time in
proportion to its context (capped at the reference's 64K engine context). The curve's form
comes from the tiny model measured on the embedded engine and on SGLang's CPU server
(benchmarks/engine_curve.py, stored in benchmarks/engine_curve.json); it is scaled so that one
LLM call takes the reference's 4.4 s at 16 trajectories per engine. So extra concurrency is no
longer free: more trajectories in flight make every call slower.

The same `RolloutManager` drives every mode, in simulated time (a virtual-clock event loop:
the whole table takes a few CPU minutes and is deterministic for a seed; `--turns-per-call`
turns go to the engine as one request, with their tokens, prefills and commands summed, which
keeps the load and cuts the events to simulate):
- `sync`, `one_step_off`, `fully_async` (`--max-staleness`, 2), each without a turn cap;
- `fully_async + caps`: the 80-turn cap;
each with and without over-sampling, and each again on capacity-free engines (every call takes
a flat 4.4 s whatever the load): the old benchmark's model, an upper bound.

    python benchmarks/longtail.py [--steps 6] [--groups 48] [--group-size 8] [--engines 24]
        [--curve benchmarks/engine_curve.json --curve-source sglang]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sim_clock import EngineCurve, EngineGroup, run_simulated

from patchgym.core.rollout import Batch, RolloutConfig, RolloutManager
from patchgym.core.sandbox import Sandbox, SandboxSpec
from patchgym.core.tasks import Grade, Grader, Task
from patchgym.core.trajectory import Trajectory

LLM_CALL_S, COMMAND_S, TRAIN_S = 4.4, 1.0, 147.0
SUCCESS_P, SUCCESS_MEDIAN_TURNS, TURN_CAP = 0.15, 8, 80
TOKENS_PER_TURN = 375  # ~30K response tokens over an 80-turn trajectory
PROMPT_TOKENS, OBSERVATION_TOKENS, CONTEXT_CAP = 1_500, 400, 65_536
REFERENCE_PER_ENGINE = 16  # 24 single-GPU engines x 16 trajectories = 384 concurrent
DEFAULT_CURVE = Path(__file__).with_name("engine_curve.json")


class _Simulated(Grader):
    async def grade(self, sandbox: Sandbox) -> Grade:
        raise NotImplementedError("simulated tasks are never graded")


def endless_tasks(seed: int) -> Iterator[Task]:
    rng = random.Random(seed)
    while True:
        yield Task(f"task-{rng.getrandbits(32):08x}", "", SandboxSpec(), _Simulated())


def context_at(turn: int) -> int:
    return min(CONTEXT_CAP, PROMPT_TOKENS + turn * (TOKENS_PER_TURN + OBSERVATION_TOKENS))


def reference_curve(curve: EngineCurve) -> EngineCurve:
    """`curve` scaled so that an LLM call of a capped trajectory's average turn takes 4.4 s when
    16 trajectories share an engine: each call then waits for the 16 calls' prefills of one cycle
    plus its own decode at batch 16 (prefill-first scheduling)."""
    mean_context = statistics.mean(context_at(t) for t in range(TURN_CAP))
    per_engine = REFERENCE_PER_ENGINE
    cycle = per_engine * curve.prefill_per_token_s * mean_context + TOKENS_PER_TURN * curve.step_s(per_engine)
    return curve.scaled(LLM_CALL_S / cycle)


class FlatLLM:
    """Capacity-free calls: every call takes the same time, however many run at once."""

    engines: tuple[()] = ()
    busy_s = 0.0

    async def generate(self, context_tokens: int, new_tokens: int) -> None:
        await asyncio.sleep(LLM_CALL_S * new_tokens / TOKENS_PER_TURN)


@dataclass
class Timing:
    started: float
    finished: float


class SimulatedAgent:
    """Turn counts and speeds with the reference's shape; LLM calls go to `llm`."""

    def __init__(self, llm: EngineGroup | FlatLLM, *, turn_cap: int | None, turns_per_call: int, seed: int) -> None:
        self.llm, self.turn_cap, self.turns_per_call = llm, turn_cap, turns_per_call
        self.rng = random.Random(seed)
        self.timings: dict[int, Timing] = {}

    def _turns(self) -> tuple[int, bool]:
        if self.rng.random() < SUCCESS_P:
            return max(2, round(self.rng.lognormvariate(0, 0.6) * SUCCESS_MEDIAN_TURNS)), True
        loops = round(200 + self.rng.expovariate(1 / 40))  # failing agents loop 200+ turns
        return (min(loops, self.turn_cap) if self.turn_cap else loops), False

    async def __call__(self, task: Task) -> Trajectory:
        loop = asyncio.get_running_loop()
        started = loop.time()
        turns, solved = self._turns()
        speed = self.rng.uniform(1.0, 2.5)  # attempts at one task differ up to 2.5x
        for first in range(0, turns, self.turns_per_call):
            chunk = range(first, min(first + self.turns_per_call, turns))
            await self.llm.generate(sum(context_at(t) for t in chunk), round(TOKENS_PER_TURN * speed * len(chunk)))
            await asyncio.sleep(COMMAND_S * speed * len(chunk))
        trajectory = Trajectory(task.id, reward=1.0 if solved else 0.0)
        trajectory.termination = "submitted" if solved or turns < (self.turn_cap or 10**9) else "max_turns"
        self.timings[id(trajectory)] = Timing(started, loop.time())
        return trajectory

    def tail_share(self, batch: Batch) -> float:
        return tail_share([self.timings[id(t)] for g in batch.groups for t in g.members])


def tail_share(timings: list[Timing]) -> float:
    """Share of a batch's rollout time spent after 90% of its trajectories had finished."""
    finishes = sorted(t.finished for t in timings)
    begin, end = min(t.started for t in timings), finishes[-1]
    t90 = finishes[max(0, math.ceil(0.9 * len(finishes)) - 1)]
    return (end - t90) / (end - begin) if end > begin else 0.0


@dataclass(frozen=True)
class Mode:
    name: str
    rollout: RolloutConfig
    turn_cap: int | None


async def run_mode(
    mode: Mode, llm: EngineGroup | FlatLLM, steps: int, seed: int, turns_per_call: int
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    agent = SimulatedAgent(llm, turn_cap=mode.turn_cap, turns_per_call=turns_per_call, seed=seed)
    manager = RolloutManager(endless_tasks(seed), agent, mode.rollout)
    step_times, tails, utilisation = [], [], []
    last = loop.time()
    try:
        for step in range(steps + 1):
            busy_before = llm.busy_s
            batch = await manager.next_batch()
            assert batch is not None
            await asyncio.sleep(TRAIN_S)
            manager.publish(step + 1)
            now = loop.time()
            if step:  # the first step includes the pipeline filling up
                step_times.append(now - last)
                tails.append(agent.tail_share(batch))
                if llm.engines:
                    utilisation.append((llm.busy_s - busy_before) / ((now - last) * len(llm.engines)))
            last = now
    finally:
        await manager.aclose()
    return {
        "step_s": statistics.mean(step_times),
        "tail": statistics.mean(tails),
        "busy": statistics.mean(utilisation) if utilisation else math.nan,
    }


def modes(groups: int, group_size: int, concurrency: int, oversample: int, staleness: int) -> list[Mode]:
    base = {"group_size": group_size, "batch_groups": groups, "concurrency": concurrency, "zero_variance": "keep"}
    over = {"oversample_groups": oversample}
    asynchronous = {"mode": "fully_async", "max_staleness": staleness, **base}
    return [
        Mode("sync", RolloutConfig(mode="sync", **base), None),
        Mode("one_step_off", RolloutConfig(mode="one_step_off", **base), None),
        Mode("one_step_off + oversample", RolloutConfig(mode="one_step_off", **base, **over), None),
        Mode("fully_async", RolloutConfig(**asynchronous), None),
        Mode("fully_async + oversample", RolloutConfig(**asynchronous, **over), None),
        Mode("fully_async + caps", RolloutConfig(**asynchronous), TURN_CAP),
        Mode(
            "fully_async + caps + oversample",
            RolloutConfig(**asynchronous, **over),
            TURN_CAP,
        ),
    ]


def load_curve(path: Path, source: str) -> EngineCurve:
    data = json.loads(path.read_text())
    if source not in data:
        raise SystemExit(f"{path} has no curve {source!r}; it has {sorted(data)} (run benchmarks/engine_curve.py)")
    fit = data[source]["fit"]
    return EngineCurve(fit["decode_base_s"], fit["decode_per_seq_s"], fit["prefill_per_token_s"])


async def simulate(args: argparse.Namespace, curve: EngineCurve) -> list[tuple[str, dict, dict]]:
    rows = []
    for mode in modes(args.groups, args.group_size, args.concurrency, args.oversample, args.max_staleness):
        shared = await run_mode(mode, EngineGroup(curve, args.engines), args.steps, args.seed, args.turns_per_call)
        flat = await run_mode(mode, FlatLLM(), args.steps, args.seed, args.turns_per_call)
        rows.append((mode.name, shared, flat))
    return rows


def main(args: argparse.Namespace) -> None:
    measured = load_curve(args.curve, args.curve_source)
    curve = reference_curve(measured)
    console = Console(width=140)
    per_engine = REFERENCE_PER_ENGINE
    console.print(
        f"engine curve ({args.curve_source}, scaled x{curve.decode_base_s / measured.decode_base_s:.3g}): decode step "
        f"{curve.decode_base_s * 1e3:.2f} ms + {curve.decode_per_seq_s * 1e3:.3f} ms per sequence; prefill "
        f"{curve.prefill_per_token_s * 1e6:.2f} us per context token; {curve.tokens_per_s(1):.0f} tok/s at 1 sequence, "
        f"{curve.tokens_per_s(per_engine):.0f} at {per_engine}, {curve.tokens_per_s(4 * per_engine):.0f} at "
        f"{4 * per_engine}"
    )
    rows = run_simulated(simulate(args, curve))
    sync_shared, sync_flat = rows[0][1]["step_s"], rows[0][2]["step_s"]
    table = Table(
        "mode",
        "step (s)",
        "speed-up vs sync",
        "after 90%",
        "engines busy",
        "flat-LLM step (s)",
        "flat-LLM speed-up",
        title=(
            f"{args.steps} steps of {args.groups} groups x {args.group_size}, {args.engines} engines, concurrency "
            f"{args.concurrency}, over-sampling {args.oversample} groups, trainer step {TRAIN_S:.0f} s (simulated s)"
        ),
    )
    for name, shared, flat in rows:
        table.add_row(
            name,
            f"{shared['step_s']:.0f}",
            f"{sync_shared / shared['step_s']:.2f}x",
            f"{shared['tail']:.0%}",
            f"{shared['busy']:.0%}",
            f"{flat['step_s']:.0f}",
            f"{sync_flat / flat['step_s']:.2f}x",
        )
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--engines", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=384, help="trajectories in flight (the reference's 384)")
    parser.add_argument("--oversample", type=int, default=24, help="extra groups per batch in the oversample rows")
    parser.add_argument("--max-staleness", type=int, default=2, help="fully_async's max staleness")
    parser.add_argument("--curve", type=Path, default=DEFAULT_CURVE)
    parser.add_argument("--curve-source", default="sglang", help="which measured curve: sglang or embedded")
    parser.add_argument(
        "--turns-per-call", type=int, default=4, help="turns simulated as one engine request (fewer events, same load)"
    )
    parser.add_argument("--seed", type=int, default=0)
    main(parser.parse_args())
