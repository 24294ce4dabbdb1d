"""Sandbox acquisition and time to first command, measured side by side.

For each backend (local, docker) and each concurrency level, N sandboxes are started at once;
each reports the time until `create()` returned (acquisition) and until its first command
(`true`) finished. Docker is measured cold (a new container each) and warm (containers taken
from a prewarmed pool, workspace already staged). Prints medians, p95 and warm/cold ratios.

    python benchmarks/sandbox_startup.py [--concurrency 1 8 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from patchgym.backends.sandbox.docker import DockerSandboxBackend
from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec
from patchgym.plugins.folder import TINY_TASKS

WORKSPACE = TINY_TASKS / "roman-subtractive" / "repo"
MODES = ("local", "docker cold", "docker warm")

Sample = tuple[float, float]
"""(seconds until create() returned, seconds until the first command finished)"""


async def first_command(backend: SandboxBackend, spec: SandboxSpec) -> tuple[Sample, Sandbox]:
    started = time.perf_counter()
    sandbox = await backend.create(spec)
    acquired = time.perf_counter() - started
    await sandbox.exec("true", timeout_s=60)
    return (acquired, time.perf_counter() - started), sandbox


async def round_of(backend: SandboxBackend, spec: SandboxSpec, n: int) -> list[Sample]:
    results = await asyncio.gather(*(first_command(backend, spec) for _ in range(n)))
    await asyncio.gather(*(sandbox.close() for _, sandbox in results))
    return [sample for sample, _ in results]


async def measure(mode: str, n: int, rounds: int) -> list[Sample]:
    spec = SandboxSpec(workspace=WORKSPACE)
    if mode == "local":
        backend: SandboxBackend = LocalSandboxBackend()
    else:
        pool = n if mode == "docker warm" else 0
        backend = DockerSandboxBackend(concurrency=n, pool_size=pool, pool_refill_concurrency=8)
    samples: list[Sample] = []
    try:
        for _ in range(rounds):
            if isinstance(backend, DockerSandboxBackend) and backend.pool_size:
                await backend.prewarm(spec)  # refill between rounds, off the clock
            samples += await round_of(backend, spec, n)
    finally:
        await backend.aclose()
    return samples


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def cell(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} / {p95(values) * 1e3:.0f}"


async def main(levels: list[int], rounds: int) -> None:
    results: dict[tuple[str, int], list[Sample]] = {}
    with Progress(console=Console(stderr=True), transient=True) as progress:
        bar = progress.add_task("measuring", total=len(MODES) * len(levels))
        for n in levels:
            for mode in MODES:
                results[mode, n] = await measure(mode, n, rounds)
                progress.advance(bar)
    table = Table(
        "concurrency",
        *(f"{mode}: first command" for mode in MODES),
        "docker warm: acquire",
        "warm / cold first command",
        "warm acquire / cold first command",
        title=f"sandbox start-up, ms median / p95 over {rounds} rounds",
    )
    for n in levels:
        first = {mode: [total for _, total in results[mode, n]] for mode in MODES}
        acquire = [acquired for acquired, _ in results["docker warm", n]]
        cold = statistics.median(first["docker cold"])
        table.add_row(
            str(n),
            *(cell(first[mode]) for mode in MODES),
            cell(acquire),
            f"{statistics.median(first['docker warm']) / cold:.1%}",
            f"{statistics.median(acquire) / cold:.1%}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.concurrency, args.rounds))
