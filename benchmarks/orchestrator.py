"""Orchestration overhead with 1,000+ concurrent trajectories on ONE core.

Each trajectory is a real `AsyncSWEEnv` episode (action parsing, command rendering, caps,
grading) driven by a simulated policy that waits `--llm-s` per turn, on an in-memory sandbox
whose commands return at once — so all CPU time is patchgym's own orchestration. The process is
pinned to one core. Prints the CPU cost per turn, the achieved turn rate, and the event-loop
lag (how late a 10 ms timer fires) at p50/p99: with no hidden caps, every trajectory progresses.

    python benchmarks/orchestrator.py [--trajectories 1000] [--turns 20] [--llm-s 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from rich.console import Console
from rich.table import Table

from patchgym.core.sandbox import DEFAULT_MAX_OUTPUT_BYTES, ExecResult, Sandbox, SandboxBackend, SandboxSpec
from patchgym.core.tasks import Grade, Grader, Task, TaskSet
from patchgym.envs.swe import AsyncSWEEnv

OUTPUT = "file.py\n" * 40


class MemorySandbox(Sandbox):
    """Commands answer instantly with a fixed listing: the sandbox costs nothing."""

    workdir = "/workspace"

    async def exec(
        self,
        cmd: str,
        *,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        return ExecResult(exit_code=0, stdout=OUTPUT, stderr="", duration_s=0.0)

    async def read_file(self, path: str) -> bytes:
        raise FileNotFoundError(path)

    async def write_file(self, path: str, data: bytes | str) -> None:
        pass

    async def upload_dir(self, local_dir: Path, path: str) -> None:
        pass

    async def download_dir(self, path: str, local_dir: Path) -> None:
        pass

    async def close(self) -> None:
        pass


class MemoryBackend(SandboxBackend):
    name = "memory"

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return MemorySandbox()

    async def reap(self, labels: Mapping[str, str]) -> int:
        return 0


class FixedGrader(Grader):
    async def grade(self, sandbox: Sandbox) -> Grade:
        return Grade(reward=0.0, resolved=False)


class OneTask(TaskSet):
    name = "one"

    def __iter__(self) -> Iterator[Task]:
        return iter([Task("bench", "Fix the bug in file.py.", SandboxSpec(), FixedGrader())])


async def trajectory(turns: int, llm_s: float, rng: random.Random) -> tuple[int, float]:
    """Runs one episode; returns its turn count and the time it spent waiting for the 'LLM'."""
    env = AsyncSWEEnv(OneTask(), MemoryBackend(), max_turns=turns + 1)
    await env.reset()
    waits = [llm_s * rng.uniform(0.5, 1.5) for _ in range(turns)]
    for wait in waits:
        await asyncio.sleep(wait)
        await env.step("Let me look.\n```bash\nls -la && cat file.py | head -40\n```")
    await env.step("```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")
    return turns + 1, sum(waits)


async def measure_lag(stop: asyncio.Event, lags: list[float], period: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(period)
        lags.append(loop.time() - start - period)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main(n: int, turns: int, llm_s: float) -> None:
    rng = random.Random(0)
    stop, lags = asyncio.Event(), []
    ticker = asyncio.create_task(measure_lag(stop, lags))
    wall, cpu = time.perf_counter(), time.process_time()
    done = await asyncio.gather(*(trajectory(turns, llm_s, rng) for _ in range(n)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stop.set()
    await ticker
    total_turns = sum(count for count, _ in done)
    ideal = max(waited for _, waited in done)  # the slowest trajectory's own LLM waits
    table = Table("figure", "value", title=f"{n} concurrent trajectories x {turns + 1} turns on one core")
    table.add_row("turns handled", f"{total_turns}")
    table.add_row("CPU per turn (orchestration)", f"{cpu / total_turns * 1e6:.0f} µs")
    table.add_row("turn rate", f"{total_turns / wall:.0f} turns/s")
    table.add_row("wall time / slowest trajectory's LLM waits", f"{wall / ideal:.3f}")
    table.add_row("event-loop lag p50 / p99", f"{quantile(lags, 0.5) * 1e3:.1f} / {quantile(lags, 0.99) * 1e3:.1f} ms")
    table.add_row("lag samples", str(len(lags)))
    table.add_row("mean lag", f"{statistics.mean(lags) * 1e3:.1f} ms")
    Console(width=100).print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--llm-s", type=float, default=1.0, help="simulated LLM latency per turn (mean)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    asyncio.run(main(args.trajectories, args.turns, args.llm_s))
