"""The cost of grading in a fresh sandbox, measured side by side with grading in place.

For each backend (local-bwrap; docker with a warm pool) and each concurrency level, N agent
sandboxes of the tiny `roman-subtractive` task get the gold patch, then all N are graded at
once, first in place (the task's grader in the agent's sandbox), then through
`FreshSandboxGrader` (a fresh sandbox per grade, the diff copied in, the tamper check, then the
same grader). Each grade's latency is recorded; prints medians, p95, the wall time of the batch
and the fresh/in-place ratios. The Docker pool is prewarmed off the clock and sized to N.

    python benchmarks/grading.py [--backends local-bwrap docker] [--concurrency 1 32] [--rounds 2]

`--verdict` measures the verdict channel instead (issue 27): for every task of the tiny set, a
gold-patched sandbox is graded `--rounds` times by the task's grader with the channel off (old:
the bundled runner's JUnit report) and on (new: supervisor, recorder, canaries), alternating,
through `FreshSandboxGrader` (`--mode fresh`, the default) or alone (`--mode in_place`); prints
the median per task side by side with the new/old ratio (target <= 1.5x), `--json` for a record.

    python benchmarks/grading.py --verdict [--backends local-bwrap] [--rounds 5] [--mode in_place] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

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


async def verdict_medians(kind: str, rounds: int, mode: str) -> dict[str, dict[str, float]]:
    """{task: {"old": median s, "new": median s}}: the channel off and on, alternating."""
    backend = make_backend(kind, 1)
    results: dict[str, dict[str, float]] = {}
    try:
        for task in tiny_task_set():
            inner: Any = task.grader  # a TestCommandGrader
            variants: dict[str, Grader] = {
                "old": dataclasses.replace(inner, verdict_channel=False, canaries=False),
                "new": dataclasses.replace(inner, verdict_channel=True, canaries=True),
            }
            if mode == "fresh":
                variants = {name: FreshSandboxGrader(g, backend, task) for name, g in variants.items()}
            times: dict[str, list[float]] = {name: [] for name in variants}
            sandbox = await agent_sandbox(backend, task)
            try:
                for _ in range(rounds):
                    for name, grader in variants.items():
                        times[name].append(await timed(grader, sandbox))
            finally:
                await sandbox.close()
            results[task.id] = {name: statistics.median(values) for name, values in times.items()}
    finally:
        await backend.aclose()
    return results


def verdict_main(args: argparse.Namespace) -> None:
    backends: dict[str, Any] = {}
    record = {"mode": args.mode, "rounds": args.rounds, "backends": backends}
    table = Table(title=f"grading the tiny tasks (gold), median seconds per grade, {args.mode}")
    for column in ("backend", "task", "old (report)", "new (verdict channel)", "new/old"):
        table.add_column(column, justify="right")
    for kind in args.backends:
        medians = asyncio.run(verdict_medians(kind, args.rounds, args.mode))
        old = statistics.median(m["old"] for m in medians.values())
        new = statistics.median(m["new"] for m in medians.values())
        for task_id, m in medians.items():
            table.add_row(kind, task_id, f"{m['old']:.3f}", f"{m['new']:.3f}", f"{m['new'] / m['old']:.2f}x")
        table.add_row(kind, "median of tasks", f"{old:.3f}", f"{new:.3f}", f"{new / old:.2f}x")
        backends[kind] = {"tasks": medians, "old": old, "new": new, "ratio": new / old}
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        Console(width=200).print(table)


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["local-bwrap", "docker"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--verdict", action="store_true", help="the verdict channel off vs on, per tiny task")
    parser.add_argument("--mode", choices=["fresh", "in_place"], default="fresh", help="with --verdict")
    parser.add_argument("--json", action="store_true", help="with --verdict: print the record as JSON")
    args = parser.parse_args()
    if args.verdict:
        verdict_main(args)
        return
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
