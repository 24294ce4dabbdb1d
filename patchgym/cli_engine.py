"""`patchgym engine ...`: start inference engines."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from patchgym.core.errors import PatchgymError
from patchgym.process_groups import handle_interrupts

engine_app = typer.Typer(help="Start inference engines.", no_args_is_help=True)
launch_app = typer.Typer(help="Launch engine servers and wait until they are healthy.", no_args_is_help=True)
engine_app.add_typer(launch_app, name="launch")
console = Console()


@launch_app.command("sglang")
def launch_sglang_cmd(
    model: Annotated[Path, typer.Argument(help="a Hugging Face model directory")],
    python: Annotated[Path, typer.Option(help="python of the venv with sglang (see --cpu-venv)")] = Path("python"),
    cpu_venv: Annotated[
        bool,
        typer.Option("--cpu-venv", help="use (building if needed) patchgym's CPU SGLang venv; implies --device cpu"),
    ] = False,
    device: Annotated[str, typer.Option(help="cuda or cpu")] = "cuda",
    gpus: Annotated[str, typer.Option(help="comma-separated GPU ids: one engine per GPU")] = "0",
    port: Annotated[int, typer.Option(help="port of the first engine; the next ones count up")] = 30000,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    context_length: Annotated[int, typer.Option(help="hard cap on prompt + generated tokens")] = 32768,
    mem_fraction: Annotated[float, typer.Option(help="GPU memory fraction for weights + KV cache")] = 0.85,
    max_total_tokens: Annotated[
        int, typer.Option(help="KV pool size in tokens (0: SGLang decides; required on CPU)")
    ] = 0,
    dtype: Annotated[str, typer.Option(help="weights/activations dtype (auto, float32, bfloat16, ...)")] = "auto",
    log_dir: Annotated[Path, typer.Option(help="where server logs go")] = Path("sglang-logs"),
    health_timeout: Annotated[float, typer.Option(help="seconds to wait for /health")] = 600.0,
    stop_grace: Annotated[
        float, typer.Option(min=0.0, help="on Ctrl-C/SIGTERM: seconds for the servers to exit before SIGKILL")
    ] = 10.0,
    sleep_on_idle: Annotated[
        bool | None, typer.Option(help="SGLang --sleep-on-idle (default: on for CPU, off for GPU)")
    ] = None,
) -> None:
    """Start SGLang servers with the recommended flags, print their URLs, and keep them running until Ctrl-C."""
    from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings, launch_sglang, stop_servers

    handle_interrupts()  # also when started with SIGINT ignored (a shell's background job)
    try:
        stubs = None
        if cpu_venv:
            from patchgym.backends.inference.sglang_venv import build_sglang_venv, stubs_path, venv_python

            venv = build_sglang_venv(progress=lambda m: console.print(escape(m)))
            python, stubs, device = venv_python(venv), stubs_path(venv), "cpu"
        settings = SGLangLaunchSettings(
            model_path=model.resolve(),
            python=python,
            host=host,
            base_port=port,
            device=device,
            gpus=tuple(int(g) for g in gpus.split(",") if g.strip()),
            context_length=context_length,
            mem_fraction_static=mem_fraction if device == "cuda" else None,
            max_total_tokens=max_total_tokens or (65536 if device == "cpu" else None),
            dtype=dtype,
            stubs_dir=stubs,
            health_timeout_s=health_timeout,
            stop_grace_s=stop_grace,
            sleep_on_idle=sleep_on_idle,
        )
        with console.status("starting SGLang and waiting for /health"):
            servers = launch_sglang(settings, log_dir)
    except PatchgymError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from exc
    for server in servers:
        console.print(f"[green]healthy[/green] {server.url}  (log {server.log_path})", highlight=False)
    console.print("urls=" + ",".join(s.url for s in servers), highlight=False)
    try:
        while all(server.process.poll() is None for server in servers):
            time.sleep(1)
        dead = [s for s in servers if s.process.poll() is not None]
        console.print(f"[red]engine exited:[/red] {escape(dead[0].url)}\n{escape(dead[0].log_tail())}", highlight=False)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        stop_servers(servers, settings.stop_grace_s)
