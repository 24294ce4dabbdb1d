"""The synthetic bug generator at scale: tasks made and validated per minute from real code bases.

Generates from scratch (no cache) into a temporary directory, then validates every task
(gold patch → reward 1, empty patch → reward 0), and prints the times, the counts per code
base, the rejection reasons, the median time per validated task, and whether the issue's
target (>= 50 validated tasks from >= 2 code bases in under 15 minutes) was met.

    python benchmarks/synthetic_generate.py [--sources stdlib:textwrap stdlib:fractions ...]
        [--max-tasks 60] [--concurrency N] [--seed 0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.validation import TaskValidation, validate_task
from patchgym.plugins.synthetic.generate import GenerateSettings, generate
from patchgym.plugins.synthetic.taskset import SyntheticTaskSet

TARGET_TASKS, TARGET_REPOS, TARGET_S = 50, 2, 15 * 60
COLUMNS = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


async def validate_all(
    out: Path, backend: LocalSandboxBackend, concurrency: int, console: Console
) -> list[TaskValidation]:
    tasks = list(SyntheticTaskSet(out))
    gate = asyncio.Semaphore(concurrency)
    with Progress(*COLUMNS, console=console, transient=True) as progress:
        bar = progress.add_task("validating", total=len(tasks))

        async def one(task):  # type: ignore[no-untyped-def]
            async with gate:
                result = await validate_task(backend, task)
            progress.advance(bar)
            return result

        return list(await asyncio.gather(*(one(task) for task in tasks)))


async def main(args: argparse.Namespace) -> None:
    console = Console()
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="patchgym-synth-bench-"))
    backend = LocalSandboxBackend()
    settings = GenerateSettings(seed=args.seed, max_tasks=args.max_tasks, concurrency=args.concurrency)
    try:
        with Progress(*COLUMNS, console=console, transient=True) as progress:
            report = await generate(args.sources, out, backend, settings, progress)
        started = time.perf_counter()
        results = await validate_all(out, backend, args.concurrency, console)
        validate_s = time.perf_counter() - started
    finally:
        await backend.aclose()
    valid = [r for r in results if r.valid]
    total_s = report.duration_s + validate_s
    table = Table("measure", "value", title=f"synthetic generation, concurrency {args.concurrency}, seed {args.seed}")
    table.add_row("sources", ", ".join(args.sources))
    table.add_row("candidates / tried / kept", f"{report.candidates} / {report.tried} / {report.accepted}")
    table.add_row("kept per code base", ", ".join(f"{k}: {v}" for k, v in sorted(report.per_repo.items())))
    table.add_row("rejected", ", ".join(f"{k}: {v}" for k, v in report.rejected.most_common()) or "-")
    table.add_row("generation (s)", f"{report.duration_s:.1f}")
    table.add_row("validation of every task (s)", f"{validate_s:.1f}")
    table.add_row("valid tasks", f"{len(valid)} / {len(results)}")
    table.add_row("median validation per task (s)", f"{statistics.median(r.duration_s for r in results):.2f}")
    table.add_row("tasks kept per minute of generation", f"{60 * report.accepted / report.duration_s:.1f}")
    console.print(table)
    met = len(valid) >= TARGET_TASKS and len(report.per_repo) >= TARGET_REPOS and total_s < TARGET_S
    console.print(
        f"target >= {TARGET_TASKS} valid tasks from >= {TARGET_REPOS} code bases in < {TARGET_S}s: "
        f"{'MET' if met else 'NOT MET'} ({len(valid)} tasks, {len(report.per_repo)} code bases, "
        f"{total_s:.1f}s generate + validate; {out})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", nargs="+", default=["stdlib:textwrap", "stdlib:fractions", "stdlib:shlex"])
    parser.add_argument("--max-tasks", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="write the task set here instead of a temporary directory")
    asyncio.run(main(parser.parse_args()))
