"""`patchgym tasks build-images swebench`: instance images for SWE-bench rows, without registries."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from patchgym.cli_options import parse_options
from patchgym.core.errors import ConfigError
from patchgym.core.plugins import registry
from patchgym.plugins.swe_data import load_rows, require
from patchgym.plugins.swebench import SWEBenchTaskSet

if TYPE_CHECKING:  # the docker SDK is an extra: imported when the command runs
    from patchgym.plugins.swebench_images.build import ImageBuilder, ImageResult

console = Console()
DEFAULT_CACHE = Path.home() / ".cache" / "patchgym" / "swebench-images"
STATUS_STYLE = {"built": "[green]built", "cached": "[green]cached", "failed": "[red]FAILED"}


def pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    """KEY=VALUE items as a dict; a `ConfigError` naming the option for a malformed one."""
    found = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{what} takes KEY=VALUE, got {item!r}")
        found[key] = value
    return found


async def build_all(
    rows: Sequence[Mapping[str, Any]], builder: ImageBuilder, concurrency: int, *, show_progress: bool = True
) -> list[ImageResult]:
    """Build every row's image, `concurrency` at once, with a progress line per image in flight."""
    gate = asyncio.Semaphore(concurrency)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True, disable=not show_progress) as progress:
        overall = progress.add_task("images", total=len(rows))

        async def one(row: Mapping[str, Any]) -> ImageResult:
            async with gate:
                line = progress.add_task(escape(row["instance_id"]), total=None)

                def stage(text: str) -> None:
                    progress.update(line, description=escape(f"{row['instance_id']}: {text}"))

                try:
                    return await asyncio.to_thread(builder.build, row, stage)
                finally:
                    progress.remove_task(line)
                    progress.advance(overall)

        return list(await asyncio.gather(*(one(row) for row in rows)))


def summary(results: Sequence[ImageResult]) -> Table:
    table = Table("instance", "image", "status", "seconds", "error", title="SWE-bench instance images")
    for r in results:
        table.add_row(
            escape(r.instance_id), escape(r.image), STATUS_STYLE[r.status], f"{r.seconds:.1f}", escape(r.error)
        )
    return table


def build_images_command(
    task_set: Annotated[str, typer.Argument(help="the task set whose rows to build images for: swebench")],
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="KEY=VALUE option of the task set: path (required), ids, subset, limit"),
    ] = None,
    repo_source: Annotated[
        list[str] | None,
        typer.Option(help="OWNER/NAME=PATH: a local clone or mirror holding the rows' commits (repeatable)"),
    ] = None,
    repos_dir: Annotated[
        Path | None, typer.Option(help="a folder of clones named OWNER__NAME, for repositories without --repo-source")
    ] = None,
    cache_dir: Annotated[
        Path,
        typer.Option(help="wheels, locks and build logs (copy it to an air-gapped machine)"),
    ] = DEFAULT_CACHE,
    base: Annotated[
        list[str] | None,
        typer.Option(help="PYTHON=IMAGE: the base image for a Python version (default: built from Debian packages)"),
    ] = None,
    mirror: Annotated[str | None, typer.Option(help="Debian mirror for building base images")] = None,
    offline: Annotated[
        bool, typer.Option(help="never use the network: every row's lock and wheels must be in the cache already")
    ] = False,
    force: Annotated[bool, typer.Option(help="rebuild images that are up to date")] = False,
    concurrency: Annotated[int, typer.Option(min=1, help="images built at once")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="print the results as JSON")] = False,
) -> None:
    """Build SWE-bench instance images offline: repositories from local sources, wheels fetched
    on the host, `docker build --network none`; images named as the harness names local ones."""
    if task_set != "swebench":
        raise ConfigError(f"build-images builds SWE-bench instance images: use the swebench task set, not {task_set!r}")
    missing = [name for name in ("swebench", "uv", "docker") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"build-images needs {', '.join(missing)}: pip install 'patchgym[swebench,docker]'")
    from patchgym.plugins.swebench_images.build import BuildSettings, ImageBuilder
    from patchgym.plugins.swebench_images.sources import RepoSources

    options = {"namespace": "", **parse_options(option)}
    if "path" not in options:
        raise ConfigError("give the rows to build: -o path=ROWS.jsonl (or .json, .parquet)")
    chosen = registry().create("task_set", "swebench", **options)
    assert isinstance(chosen, SWEBenchTaskSet)
    if chosen.options["arch"] != "x86_64":
        raise ConfigError(f"build-images builds x86_64 images only, not {chosen.options['arch']!r}")
    rows = chosen.select(load_rows(chosen.path, split=chosen.options["split"]))
    if not rows:
        raise ConfigError(f"{chosen.path} holds no instances to build")
    for row in rows:
        require(row, ("instance_id", "repo", "base_commit", "version"), chosen.path)
    sources = RepoSources({repo: Path(path) for repo, path in pairs(repo_source, "--repo-source").items()}, repos_dir)
    settings = BuildSettings(
        sources=sources,
        cache=cache_dir,
        bases=pairs(base, "--base"),
        mirror=mirror,
        tag=chosen.options["tag"],
        force=force,
        offline=offline,
    )
    results = asyncio.run(build_all(rows, ImageBuilder(settings), concurrency, show_progress=not as_json))
    failed = [r for r in results if r.status == "failed"]
    if as_json:
        print(json.dumps({"ok": not failed, "images": [r.as_dict() for r in results]}, indent=2))
    else:
        console.print(summary(results))
        counts = {status: sum(r.status == status for r in results) for status in STATUS_STYLE}
        console.print(f"{counts['built']} built, {counts['cached']} up to date, {counts['failed']} failed")
        if not failed:
            console.print(f"grade them with: -o path={escape(chosen.path)} -o namespace= --sandbox docker")
    if failed:
        raise typer.Exit(1)
