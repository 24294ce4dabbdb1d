"""The cost of grading in a fresh sandbox, measured side by side with grading in place.

For each backend (local-bwrap; docker with a warm pool) and each concurrency level, N agent
sandboxes of the tiny `roman-subtractive` task get the gold patch, then all N are graded at
once, first in place (the task's grader in the agent's sandbox), then through
`FreshSandboxGrader` (a fresh sandbox per grade, the diff copied in, the tamper check, then the
same grader). Each grade's latency is recorded; prints medians, p95, the wall time of the batch
and the fresh/in-place ratios. The Docker pool is prewarmed off the clock and sized to N.

    python benchmarks/grading.py [--backends local-bwrap docker] [--concurrency 1 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from patchgym.backends.sandbox.docker import DockerSandboxBackend
from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.fresh_grading import FreshSandboxGrader
from patchgym.core.sandbox import Sandbox, SandboxBackend
from patchgym.core.tasks import Grader, Task, start_task_sandbox
from patchgym.core.validation import apply_patch
from patchgym.plugins.folder import tiny_task_set

TASK = "roman-subtractive"


def make_backend(kind: str, n: int) -> SandboxBackend:
    if kind == "docker":
        # agent sandboxes and fresh grading sandboxes both come from the pool
        return DockerSandboxBackend(concurrency=2 * n, pool_size=2 * n, pool_refill_concurrency=8)
    return LocalSandboxBackend(isolation="bwrap")


async def agent_sandbox(backend: SandboxBackend, task: Task) -> Sandbox:
    sandbox = await start_task_sandbox(backend, task)
    assert task.gold_patch
    applied = await apply_patch(sandbox, task.gold_patch)
    assert applied.ok, applied.output
    return sandbox


async def timed(grader: Grader, sandbox: Sandbox) -> float:
    started = time.perf_counter()
    grade = await grader.grade(sandbox)
    assert grade.reward == 1.0, grade.details
    return time.perf_counter() - started


async def batch(
    backend: SandboxBackend, task: Task, n: int, grader_of: Callable[[Task], Grader]
) -> tuple[list[float], float]:
    """Grade N gold-patched sandboxes at once: (per-grade seconds, wall seconds)."""
    if isinstance(backend, DockerSandboxBackend):
        await backend.prewarm(task.sandbox)
    sandboxes = await asyncio.gather(*(agent_sandbox(backend, task) for _ in range(n)))
    if isinstance(backend, DockerSandboxBackend):
        await backend.prewarm(task.sandbox)  # the fresh sandboxes' share, off the clock
    try:
        started = time.perf_counter()
        latencies = await asyncio.gather(*(timed(grader_of(task), sandbox) for sandbox in sandboxes))
        return list(latencies), time.perf_counter() - started
    finally:
        await asyncio.gather(*(sandbox.close() for sandbox in sandboxes))


async def measure(kind: str, n: int, rounds: int) -> dict[str, tuple[list[float], float]]:
    task = tiny_task_set().get(TASK)
    backend = make_backend(kind, n)
    graders: dict[str, Callable[[Task], Grader]] = {
        "in place": lambda t: t.grader,
        "fresh": lambda t: FreshSandboxGrader(t.grader, backend, t),
    }
    results: dict[str, tuple[list[float], float]] = {mode: ([], 0.0) for mode in graders}
    try:
        for _ in range(rounds):
            for mode, grader_of in graders.items():
                latencies, wall = await batch(backend, task, n, grader_of)
                results[mode] = (results[mode][0] + latencies, results[mode][1] + wall / rounds)
    finally:
        await backend.aclose()
    return results


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["local-bwrap", "docker"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    table = Table(title=f"grading {TASK} (gold patch), seconds per grade")
    for column in (
        "backend",
        "N",
        "in place median",
        "fresh median",
        "ratio",
        "in place p95",
        "fresh p95",
        "in place wall",
        "fresh wall",
        "wall ratio",
    ):
        table.add_column(column, justify="right")
    for kind in args.backends:
        for n in args.concurrency:
            results = asyncio.run(measure(kind, n, args.rounds))
            (place, place_wall), (fresh, fresh_wall) = results["in place"], results["fresh"]
            table.add_row(
                kind,
                str(n),
                f"{statistics.median(place):.3f}",
                f"{statistics.median(fresh):.3f}",
                f"{statistics.median(fresh) / statistics.median(place):.2f}x",
                f"{p95(place):.3f}",
                f"{p95(fresh):.3f}",
                f"{place_wall:.2f}",
                f"{fresh_wall:.2f}",
                f"{fresh_wall / place_wall:.2f}x",
            )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
