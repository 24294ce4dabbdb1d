"""The `patchgym` command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from patchgym.cli_images import build_images_command
from patchgym.cli_options import parse_options
from patchgym.core.actions import SUBMIT_SENTINEL
from patchgym.core.errors import ConfigError, PatchgymError
from patchgym.core.plugins import KIND_LABELS, registry
from patchgym.core.sandbox import SandboxBackend
from patchgym.core.tasks import Task, TaskSet
from patchgym.core.validation import TaskValidation, validate_task
from patchgym.plugins.synthetic.command import generate_tasks

app = typer.Typer(help="patchgym: train software-engineering agents with reinforcement learning.", no_args_is_help=True)
tasks_app = typer.Typer(help="Inspect and validate task sets.", no_args_is_help=True)
env_app = typer.Typer(help="Use the SWE environment by hand.", no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")
sandbox_app = typer.Typer(help="Manage sandbox backends.", no_args_is_help=True)
app.add_typer(env_app, name="env")
app.add_typer(sandbox_app, name="sandbox")
model_app = typer.Typer(help="Create models for tests and quickstarts.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(__import__("patchgym.cli_engine", fromlist=["engine_app"]).engine_app, name="engine")
console = Console()
F = TypeVar("F", bound=Callable[..., Any])

TaskSetArg = Annotated[str, typer.Argument(help="a task set name (see `patchgym plugins`) or a folder of tasks")]
SandboxOpt = Annotated[str, typer.Option("--sandbox", help="sandbox backend name")]
SandboxOptionsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--sandbox-option",
        help="KEY=VALUE setting of the sandbox backend (repeatable; `patchgym plugins --options NAME` lists them)",
    ),
]


def make_sandbox(name: str, options: list[str] | None) -> SandboxBackend:
    return registry().create("sandbox", name, **parse_options(options))


JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
TaskOptionsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        "-o",
        help="KEY=VALUE option for the task set, e.g. -o count=8 (repeatable; `patchgym plugins --options NAME` "
        "lists them)",
    ),
]


def exit_if_threads_are_stuck(code: int) -> None:
    """End the process now with `code` if a worker thread is still running after the command
    failed: a blocking call whose peer died (a weight-update rendezvous with a killed engine)
    never returns, and the interpreter would wait for it at exit forever."""
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def friendly_errors(fn: F) -> F:
    """Turn patchgym's own errors into a red message and exit code 2."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PatchgymError as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
            raise typer.Exit(2) from exc

    return wrapper  # type: ignore[return-value]


def load_task_set(name: str, options: list[str] | None = None) -> TaskSet:
    parsed = parse_options(options)
    if Path(name).is_dir():
        marker = Path(name) / "taskset.json"  # names the loader of a generated task set
        kind = json.loads(marker.read_text()).get("task_set", "folder") if marker.is_file() else "folder"
        return registry().create("task_set", kind, path=name, **parsed)
    return registry().create("task_set", name, **parsed)


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _print_options(name: str, as_json: bool) -> None:
    reg = registry()
    found = [r for kind in KIND_LABELS for r in reg.registrations(kind) if r.name == name]
    if not found:
        raise ConfigError(f"nothing is registered as {name!r}; `patchgym plugins` lists every name")
    listing = []
    for registration in found:
        model = registration.options_model()
        rows = [
            {
                "option": option,
                "type": _type_name(info.annotation),
                "default": None if info.is_required() else info.default,
                "required": info.is_required(),
                "description": info.description or "",
            }
            for option, info in model.model_fields.items()
        ]
        listing.append(
            {"kind": registration.kind, "name": name, "description": registration.description, "options": rows}
        )
    if as_json:
        print(json.dumps(listing, indent=2, default=str))
        return
    for entry in listing:
        title = f"{KIND_LABELS[entry['kind']]} {name}: {entry['description']}".rstrip(": ")
        table = Table("option", "type", "default", "description", title=escape(title))
        for row in entry["options"]:
            default = "(required)" if row["required"] else repr(row["default"])
            table.add_row(escape(row["option"]), escape(row["type"]), escape(default), escape(row["description"]))
        console.print(table)


@app.command()
@friendly_errors
def plugins(
    options: Annotated[
        str | None, typer.Option("--options", help="show the options of the part registered under this name")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List plugins, what they registered, and any that failed to load; or one part's options."""
    if options is not None:
        _print_options(options, as_json)
        return
    reg = registry()
    records = [record.as_dict() for record in reg.plugins()]
    conflicts = reg.conflicts()
    if as_json:
        print(json.dumps({"plugins": records, "conflicts": conflicts}, indent=2))
        return
    table = Table("plugin", "status", "registers", "source")
    for record in records:
        status = {"loaded": "[green]loaded", "failed": "[red]failed", "disabled": "[yellow]disabled"}[record["status"]]
        detail = record["error"] or ", ".join(record["registered"]) or "-"
        table.add_row(escape(record["name"]), status, escape(detail), escape(record["source"]))
    console.print(table)
    for kind, label in KIND_LABELS.items():
        console.print(f"{label}s: {escape(', '.join(reg.names(kind))) or '-'}")
    for conflict in conflicts:
        console.print(f"[red]conflict:[/red] {escape(conflict)}", highlight=False)


@tasks_app.command("list")
@friendly_errors
def tasks_list(task_set: TaskSetArg, option: TaskOptionsOpt = None, as_json: JsonOpt = False) -> None:
    """List the tasks of a task set."""
    tasks = list(load_task_set(task_set, option))
    rows = [
        {"id": t.id, "title": t.instruction.strip().splitlines()[0].lstrip("# ") if t.instruction.strip() else ""}
        for t in tasks
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("task", "title", title=f"{escape(task_set)}: {len(rows)} tasks")
    for row in rows:
        table.add_row(escape(row["id"]), escape(row["title"]))
    console.print(table)


async def _validate_all(tasks: list[Task], backend: SandboxBackend, concurrency: int) -> list[TaskValidation]:
    gate = asyncio.Semaphore(concurrency)
    columns = (TextColumn("validating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("validate", total=len(tasks))

        async def one(task: Task) -> TaskValidation:
            async with gate:
                result = await validate_task(backend, task)
            progress.advance(bar)
            return result

        try:
            return list(await asyncio.gather(*(one(task) for task in tasks)))
        finally:
            await backend.aclose()


@tasks_app.command("validate")
@friendly_errors
def tasks_validate(
    task_set: TaskSetArg,
    sandbox: SandboxOpt = "local",
    sandbox_option: SandboxOptionsOpt = None,
    option: TaskOptionsOpt = None,
    limit: Annotated[int | None, typer.Option(min=1, help="validate only the first N tasks")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="tasks validated at once")] = 4,
    as_json: JsonOpt = False,
) -> None:
    """Check every task: its gold patch must earn reward 1 and the empty patch reward 0."""
    tasks = list(load_task_set(task_set, option))[:limit]
    backend = make_sandbox(sandbox, sandbox_option)
    results = asyncio.run(_validate_all(tasks, backend, concurrency))
    invalid = [r for r in results if not r.valid]
    if as_json:
        print(json.dumps({"valid": not invalid, "tasks": [r.as_dict() for r in results]}, indent=2))
    else:
        table = Table(
            "task", "gold", "empty", "valid", "seconds", "problems", title=f"{escape(task_set)} on {escape(sandbox)}"
        )
        for r in results:
            d = r.as_dict()
            mark = "[green]yes" if r.valid else "[red]NO"
            table.add_row(
                escape(r.task_id),
                str(d["gold_reward"]),
                str(d["empty_reward"]),
                mark,
                f"{r.duration_s:.1f}",
                escape("; ".join(r.problems)),
            )
        console.print(table)
        console.print(f"{len(results) - len(invalid)}/{len(results)} tasks valid")
    if invalid:
        raise typer.Exit(1)


@env_app.command("play")
@friendly_errors
def env_play(
    task_set: TaskSetArg,
    task_id: str,
    sandbox: SandboxOpt = "local",
    sandbox_option: SandboxOptionsOpt = None,
    option: TaskOptionsOpt = None,
) -> None:
    """Be the agent: type bash commands, see what the agent would see. `submit` ends and grades."""
    from patchgym.envs.swe import SWEEnv

    env = SWEEnv(load_task_set(task_set, option), sandbox, sandbox_options=parse_options(sandbox_option))
    try:
        observation, info = env.reset(options={"task": task_id})
        # soft_wrap: long lines go out whole, for the terminal to wrap (code lines are never split)
        console.print(info["system_prompt"], style="dim", markup=False, highlight=False, soft_wrap=True)
        console.print(observation, markup=False, highlight=False, soft_wrap=True)
        if info["infra_error"]:
            console.print(f"[red]infrastructure error:[/red] {escape(info['infra_error']['message'])}", highlight=False)
            raise typer.Exit(1)
        console.print("\n[bold]Type a bash command per line; `submit` to submit, `quit` or Ctrl-D to stop.[/bold]")
        done = False
        while not done:
            try:
                line = console.input("[bold cyan]$ [/bold cyan]")
            except EOFError:
                line = "quit"
            if not line.strip():
                continue
            if line.strip() == "quit":
                reward, info = env.truncate("quit")
                break
            message = SUBMIT_SENTINEL if line.strip() == "submit" else f"```bash\n{line}\n```"
            observation, reward, terminated, truncated, info = env.step(message)
            console.print(observation, markup=False, highlight=False, soft_wrap=True)
            done = terminated or truncated
        _print_outcome(reward, info)
    finally:
        env.close()


def _print_outcome(reward: float, info: dict[str, Any]) -> None:
    console.print(f"\nepisode ended: {info['termination']}; reward {reward}")
    if info["infra_error"]:
        console.print(f"[red]infrastructure error:[/red] {escape(info['infra_error']['message'])}", highlight=False)
    elif info["grade"]:
        details = info["grade"]["details"]
        for label in ("fail_to_pass", "pass_to_pass"):
            if label in details:
                console.print(f"{label}: {details[label]['passed']}/{details[label]['total']} passing")


RUN_MARKERS = ("config.yaml", "events.jsonl", "state.json")
"""Files that make a folder a patchgym run directory (one `--overwrite` may empty)."""


def _claim_run_dir(run_dir: Path, overwrite: bool) -> None:
    """A new run needs an empty (or absent) run directory; `--overwrite` empties an earlier run's."""
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    if not overwrite:
        raise ConfigError(
            f"run directory {run_dir} is not empty: continue that run with `patchgym run --resume {run_dir}`, "
            "start it again with --overwrite, or set run_dir to a new folder"
        )
    if not any((run_dir / marker).exists() for marker in RUN_MARKERS):
        raise ConfigError(f"{run_dir} holds files but no patchgym run ({', '.join(RUN_MARKERS)}): not removing it")
    import shutil

    shutil.rmtree(run_dir)


@app.command("run")
@friendly_errors
def run_pipeline(
    config: Annotated[Path | None, typer.Argument(help="a run configuration (YAML)")] = None,
    resume: Annotated[Path | None, typer.Option(help="continue the run in this directory")] = None,
    overwrite: Annotated[bool, typer.Option(help="remove an earlier run in the config's run_dir first")] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="print what would start where (commands, environment, Megatron layout); start nothing"
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="with --dry-run: print the plan as JSON")] = False,
) -> None:
    """Run the pipeline: eval base → SFT → eval → GRPO → eval, with checkpoints and metrics.

    Every name and option in CONFIG is checked before anything is written (`patchgym plugins
    --options NAME` lists a part's options)."""
    import shutil

    from patchgym.pipeline.checks import check_config
    from patchgym.pipeline.config import load_run_config

    if (config is None) == (resume is None):
        raise ConfigError("give either CONFIG (a new run) or --resume RUN_DIR (continue a run)")
    if as_json and not dry_run:
        raise ConfigError("--json prints the plan of --dry-run: add --dry-run")
    source = resume / "config.yaml" if resume is not None else config
    assert source is not None
    if resume is not None and not source.is_file():
        raise ConfigError(f"{resume} is not a run directory (it has no config.yaml)")
    settings = load_run_config(source)
    if resume is not None:
        settings = settings.model_copy(update={"run_dir": str(resume)})
    if dry_run:
        command = ["patchgym", "run", *(["--resume", str(resume)] if resume is not None else [str(config)])]
        _print_plan(settings, command, as_json)
        return
    check_config(settings)  # before torch is imported, for every part but the trainer and the engine
    from patchgym.logs import library_output_to
    from patchgym.pipeline.run import Pipeline

    if resume is None:
        _claim_run_dir(Path(settings.run_dir), overwrite)
        Path(settings.run_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, Path(settings.run_dir) / "config.yaml")
    try:
        with library_output_to(Path(settings.run_dir)):  # library warnings and logging: RUN_DIR/library.log
            asyncio.run(Pipeline(settings, console=console).run(resume=resume is not None))
    except KeyboardInterrupt:
        from patchgym.pipeline.feedback import resume_hint

        console.print(f"[yellow]{escape(resume_hint(settings.run_dir))}[/]", highlight=False)
        raise typer.Exit(130) from None
    console.print(f"events, checkpoints and plots: {escape(settings.run_dir)} (`patchgym report` draws the plots)")


def _print_plan(settings: Any, command: list[str], as_json: bool) -> None:
    """`patchgym run --dry-run`: the launch plan, as a table and tree or as JSON."""
    from patchgym.launch.show import render_plan
    from patchgym.pipeline.dry_run import plan_run

    plan = plan_run(settings, command)
    if as_json:
        print(json.dumps(plan.to_dict(), indent=2))
        return
    title = f"launch plan of {' '.join(command)} (placement: {plan.placement})"
    for shown in render_plan(plan, title):
        console.print(shown, soft_wrap=True)


@app.command()
@friendly_errors
def report(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="run directories holding events.jsonl (two or more: compared)")
    ],
) -> None:
    """Write PNG plots and a markdown summary of each run into RUN_DIR/report; print the group
    accounting, and with several runs their step-time split, endings and scores side by side (their
    endings also plotted together, into the first run's report folder)."""
    from patchgym.report import compare_endings, compare_outcomes, compare_step_split, write_report

    try:
        for run_dir in run_dirs:
            out = write_report(run_dir)
            written = "reward.png, step_time.png, lengths.png, sandbox.png, endings.png, summary.md"
            console.print(f"wrote {escape(str(out))}: {written}")
            console.print((out / "summary.md").read_text(), markup=False, highlight=False, soft_wrap=True)
        if len(run_dirs) > 1:
            for table in (compare_step_split(run_dirs), compare_outcomes(run_dirs)):
                console.print(table, markup=False, highlight=False, soft_wrap=True)
            plot = compare_endings(run_dirs, Path(run_dirs[0]) / "report")
            console.print(f"wrote {escape(str(plot))}: the runs' endings per step together")
        if len(run_dirs) > 2:  # seeds of one config: each figure as a range
            from patchgym.seed_spread import spread_plot, spread_table

            console.print(spread_table(run_dirs), markup=False, highlight=False, soft_wrap=True)
            plot = spread_plot(run_dirs, Path(run_dirs[0]) / "report")
            console.print(f"wrote {escape(str(plot))}: the runs' training reward, mean and range")
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


@sandbox_app.command("build-base")
@friendly_errors
def sandbox_build_base(
    tag: Annotated[str, typer.Option(help="image name to create")] = "patchgym/base:latest",
    suite: Annotated[str, typer.Option(help="Debian suite for debootstrap")] = "bookworm",
    mirror: Annotated[str | None, typer.Option(help="Debian mirror URL (default: debootstrap's)")] = None,
    python: Annotated[
        str, typer.Option(help="the Python package (the suite sets its version: bullseye 3.9, bookworm 3.11)")
    ] = "python3",
    package: Annotated[list[str] | None, typer.Option(help="an extra Debian package to include (repeatable)")] = None,
) -> None:
    """Build the offline base image (Debian minbase + python3, git, patch) without any registry."""
    from patchgym.backends.sandbox.docker_base import build_base_image

    with console.status(f"debootstrap {suite} and docker import as {tag} (about a minute)"):
        image_id = build_base_image(tag, suite=suite, mirror=mirror, python=python, extra_packages=tuple(package or ()))
    console.print(f"built {escape(tag)} ({image_id[:19]})")


@sandbox_app.command("reap")
@friendly_errors
def sandbox_reap(
    sandbox: SandboxOpt = "docker",
    sandbox_option: SandboxOptionsOpt = None,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE a sandbox must carry (repeatable)")] = None,
) -> None:
    """Remove leaked sandboxes carrying all the given labels (all patchgym sandboxes if none)."""
    labels = {key: str(value) for key, value in parse_options(label).items()}
    backend = make_sandbox(sandbox, sandbox_option)

    async def reap() -> int:
        try:
            return await backend.reap(labels)
        finally:
            await backend.aclose()

    console.print(f"removed {asyncio.run(reap())} sandboxes")


@model_app.command("init-tiny")
@friendly_errors
def model_init_tiny(
    directory: Annotated[Path, typer.Argument(help="folder to write the model to (created)")],
    seed: Annotated[int, typer.Option(help="seed for the random weights and the tokenizer corpus")] = 0,
) -> None:
    """Write a tiny random-weight Qwen3 model and a locally trained tokenizer (Hugging Face format)."""
    try:
        from patchgym.models.tiny import init_tiny_model
    except ImportError as exc:
        raise ConfigError(f"init-tiny needs the train extra: pip install 'patchgym[train]' ({exc})") from exc
    path = init_tiny_model(directory, seed=seed)
    console.print(f"wrote a tiny Qwen3 model to {escape(str(path))}")


@model_app.command("serve")
@friendly_errors
def model_serve(
    directory: Annotated[Path, typer.Argument(help="a Hugging Face model folder (e.g. from init-tiny)")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="port on 127.0.0.1 (0: any free port)")] = 8000,
    max_context: Annotated[int, typer.Option(min=2, help="hard cap on prompt + reply tokens")] = 4096,
    max_batch_size: Annotated[int, typer.Option(min=1, help="requests decoded together")] = 32,
) -> None:
    """Serve a local model with the embedded engine as an OpenAI-compatible API on 127.0.0.1."""
    from patchgym.backends.inference.openai_server import ChatCompletionsServer, EngineChatHandler
    from patchgym.process_groups import handle_interrupts

    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(f"serve needs the train extra: pip install 'patchgym[train]' ({exc})") from exc
    engine = registry().create(
        "inference", "embedded", model=str(directory), max_context=max_context, max_batch_size=max_batch_size
    )
    handler = EngineChatHandler(engine, AutoTokenizer.from_pretrained(directory), model_name=directory.name)

    async def serve() -> None:
        async with ChatCompletionsServer(handler, model_name=directory.name, port=port) as server:
            console.print(f"serving {escape(str(directory))} at {server.url} (Ctrl-C stops)", highlight=False)
            try:
                await asyncio.Event().wait()
            finally:
                await engine.aclose()

    handle_interrupts()  # Ctrl-C/SIGTERM stop it, also when started with SIGINT ignored
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


@app.command("eval")
@friendly_errors
def eval_chat_model(
    model_url: Annotated[str, typer.Option("--model-url", help="base URL of an OpenAI-compatible API")],
    task_set: Annotated[str, typer.Option("--task-set", help="a task set name or a folder of tasks")],
    model: Annotated[str | None, typer.Option(help="model name (default: the first at /v1/models)")] = None,
    sandbox: SandboxOpt = "local",
    sandbox_option: SandboxOptionsOpt = None,
    attempts: Annotated[int, typer.Option(min=1, help="episodes per task (pass@1 is averaged)")] = 1,
    concurrency: Annotated[int, typer.Option(min=1, help="episodes at once (and HTTP connections)")] = 4,
    limit: Annotated[int | None, typer.Option(min=1, help="only the first N tasks")] = None,
    max_turns: Annotated[int, typer.Option(min=1, help="turns per episode")] = 80,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens per model reply")] = 4096,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    api_key_env: Annotated[str, typer.Option(help="environment variable holding the API key")] = "OPENAI_API_KEY",
    out: Annotated[Path | None, typer.Option(help="write the full report (every trajectory) as JSON")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a chat model (hosted or local, text level) on a task set: pass@1 over the tasks."""
    from patchgym.backends.inference.openai import OpenAIChatModel
    from patchgym.envs.chat_eval import evaluate

    tasks = load_task_set(task_set)
    ids = tasks.ids()[:limit]
    chat_model = OpenAIChatModel(
        model_url,
        model,
        api_key_env=api_key_env,
        max_tokens=max_tokens,
        temperature=temperature,
        max_connections=concurrency,
    )
    backend = make_sandbox(sandbox, sandbox_option)

    async def run() -> Any:
        columns = (TextColumn("episodes"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            bar = progress.add_task("eval", total=len(ids) * attempts)
            try:
                return await evaluate(
                    chat_model,
                    tasks,
                    backend,
                    attempts=attempts,
                    concurrency=concurrency,
                    config={"max_turns": max_turns},
                    task_ids=ids,
                    on_episode=lambda _: progress.advance(bar),
                )
            finally:
                await chat_model.aclose()
                await backend.aclose()

    report = asyncio.run(run())
    if out is not None:
        out.write_text(json.dumps(report.as_dict(), indent=2))
    summary = {k: v for k, v in report.as_dict().items() if k != "trajectories"}
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table("task", "rewards", "terminations", title=f"{escape(task_set)} with {escape(model_url)}")
    for task_id, rewards in report.per_task.items():
        ends = [t.termination or "-" for t in report.trajectories if t.task_id == task_id]
        table.add_row(escape(task_id), " ".join(f"{r:g}" for r in rewards) or "-", escape(", ".join(ends)))
    console.print(table)
    pass_at_1 = "n/a" if report.pass_at_1 is None else f"{report.pass_at_1:.3f}"
    console.print(f"pass@1 {pass_at_1} over {len(report.per_task)} tasks; infra errors: {report.infra_errors}")


tasks_app.command("generate")(friendly_errors(generate_tasks))
tasks_app.command("build-images")(friendly_errors(build_images_command))


def main() -> None:
    """The `patchgym` command: `app()`, and after a failure an exit that does not wait for a
    stuck worker thread (see `exit_if_threads_are_stuck`)."""
    try:
        app()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if code:
            exit_if_threads_are_stuck(code)
        raise


if __name__ == "__main__":
    main()
