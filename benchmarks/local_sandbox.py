"""Local sandbox costs, measured side by side: isolation none vs bubblewrap.

Prints medians over repeated runs and the bwrap/none ratio for: creating a sandbox from the
tiny task's workspace (plus its git setup), one trivial command, grading, and the peak Python
memory while capturing 200 MB of output with a 1 MB cap.

    python benchmarks/local_sandbox.py [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import tracemalloc

from rich.console import Console
from rich.progress import track
from rich.table import Table

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.tasks import start_task_sandbox
from patchgym.plugins.folder import tiny_task_set


async def measure(isolation: str, repeats: int) -> dict[str, float]:
    backend = LocalSandboxBackend(isolation=isolation)  # type: ignore[arg-type]
    task = tiny_task_set().get("roman-subtractive")
    samples: dict[str, list[float]] = {"start + setup (ms)": [], "exec `true` (ms)": [], "grade (ms)": []}
    for _ in track(range(repeats), description=f"{isolation:>5}", transient=True):
        started = time.perf_counter()
        sandbox = await start_task_sandbox(backend, task)
        samples["start + setup (ms)"].append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        await sandbox.exec("true", timeout_s=30)
        samples["exec `true` (ms)"].append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        await task.grader.grade(sandbox)
        samples["grade (ms)"].append((time.perf_counter() - started) * 1e3)
        await sandbox.close()
    async with await start_task_sandbox(backend, task) as sandbox:
        tracemalloc.start()
        await sandbox.exec("head -c 200000000 /dev/zero", timeout_s=120, max_output_bytes=1_000_000)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    await backend.aclose()
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["peak MB capturing 200 MB"] = peak / 1e6
    return result


async def main(repeats: int) -> None:
    none = await measure("none", repeats)
    bwrap = await measure("bwrap", repeats) if LocalSandboxBackend().isolation == "bwrap" else None
    table = Table("metric (median)", "none", "bwrap", "bwrap / none", title=f"local sandbox, {repeats} repeats")
    for name, value in none.items():
        other = bwrap[name] if bwrap else float("nan")
        table.add_row(name, f"{value:.2f}", f"{other:.2f}", f"{other / value:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    asyncio.run(main(parser.parse_args().repeats))
