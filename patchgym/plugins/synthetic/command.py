"""`patchgym tasks generate`: the synthetic bug generator on the command line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from patchgym.core.plugins import registry
from patchgym.plugins.synthetic.generate import GenerateReport, GenerateSettings, generate
from patchgym.plugins.synthetic.modifiers import MODIFIERS

console = Console()


def generate_tasks(
    sources: Annotated[
        list[str], typer.Argument(help="stdlib:MODULE, a project directory with tests/, or an sdist .tar.gz")
    ],
    out: Annotated[Path, typer.Option("--out", help="directory to write the task set into")],
    seed: Annotated[int, typer.Option(help="seed for choosing and ordering bugs")] = 0,
    max_tasks: Annotated[int, typer.Option(min=1, help="stop after this many validated tasks")] = 50,
    concurrency: Annotated[int, typer.Option(min=1, help="candidate bugs tested at once")] = 4,
    hard: Annotated[bool, typer.Option("--hard", help="issue texts that name no tests and no function")] = False,
    sandbox: Annotated[str, typer.Option("--sandbox", help="sandbox backend name")] = "local",
    test_timeout_s: Annotated[float, typer.Option(help="time limit of any one test run")] = 300.0,
    timeout_factor: Annotated[float, typer.Option(help="a buggy run may take this many times the clean run")] = 5.0,
    min_timeout_s: Annotated[float, typer.Option(help="the least time a buggy run is given")] = 10.0,
    max_candidates: Annotated[int | None, typer.Option(min=1, help="try at most this many bugs")] = None,
    modifier: Annotated[
        list[str] | None, typer.Option(help=f"bug modifier to use (repeatable; default all: {', '.join(MODIFIERS)})")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Inject bugs into real code with AST modifiers and keep those its own tests catch."""
    settings = GenerateSettings(
        seed=seed,
        max_tasks=max_tasks,
        concurrency=concurrency,
        hard=hard,
        test_timeout_s=test_timeout_s,
        timeout_factor=timeout_factor,
        min_timeout_s=min_timeout_s,
        max_candidates=max_candidates,
        modifiers=tuple(modifier or MODIFIERS),
    )
    backend = registry().create("sandbox", sandbox)

    async def run() -> GenerateReport:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        try:
            with Progress(*columns, console=console, transient=True, disable=as_json) as progress:
                return await generate(sources, out, backend, settings, progress)
        finally:
            await backend.aclose()

    report = asyncio.run(run())
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
        return
    console.print(
        f"kept {report.accepted} tasks of {report.tried} bugs tried ({report.candidates} candidates) "
        f"in {report.duration_s:.1f}s; written to {escape(str(out))}"
    )
    for repo, count in sorted(report.per_repo.items()):
        console.print(f"  {escape(repo)}: {count} tasks")
    if report.rejected:
        reasons = ", ".join(f"{reason} {count}" for reason, count in report.rejected.most_common())
        console.print(f"  rejected: {escape(reasons)}")
    if report.accepted < max_tasks:
        console.print(f"[yellow]only {report.accepted} of the {max_tasks} tasks asked for were found[/yellow]")
