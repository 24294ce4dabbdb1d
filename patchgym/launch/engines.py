"""The `sglang` inference backend as `patchgym run` builds it: attach to engines, or start a group.

`inference: {name: sglang, options: {urls: [...]}}` attaches to servers started elsewhere.
`options: {launch: {engines: N, cpu_venv: true, tp: 1, extra_args: [...]}}` starts N servers
itself (one free port each on 127.0.0.1; the CPU SGLang venv of `sglang_venv` with `cpu_venv`,
GPUs `gpus[i*tp : (i+1)*tp]` otherwise) and puts the SGLang router (`sglang-router`, run from
this environment, bound to 127.0.0.1) in front of them: generation goes through the router
(`router: cache_aware` by default; `random`, `round_robin`, `power_of_two`; `none` balances
in the client), control calls (pause, abort, weight updates, group set-up, cache flush) go to
each server directly. The servers, the router and their logs belong to the engine: `start()`
waits until all are healthy, `aclose()` stops them.
"""

from __future__ import annotations

import importlib.util
import inspect
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from patchgym.core.errors import ConfigError
from patchgym.launch.context import log_dir
from patchgym.launch.processes import Supervisor

if TYPE_CHECKING:
    from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings

RouterPolicy = Literal["cache_aware", "round_robin", "random", "power_of_two", "none"]


class EngineLaunch(BaseModel):
    """How to start an engine group (`launch:` in the sglang backend's options)."""

    model_config = ConfigDict(extra="forbid")

    engines: int = Field(1, ge=1, description="SGLang servers to start")
    cpu_venv: bool = Field(False, description="run on CPU from patchgym's SGLang venv (built if missing)")
    python: str | None = Field(None, description="python of an environment with sglang (GPU machines)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per server (--tp-size)")
    gpus: list[int] | None = Field(None, description="GPU ids to use, tp per server in order (default 0..N*tp-1)")
    context_length: int | None = Field(None, ge=1, description="server context (default: the client's max_context)")
    max_total_tokens: int | None = Field(None, ge=1, description="KV pool in tokens (CPU default 16384)")
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="GPU memory for weights and KV")
    dtype: str = "auto"
    extra_args: list[str] = Field(default_factory=list, description="more sglang.launch_server flags")
    health_timeout_s: float = Field(600.0, gt=0, description="how long the servers may take to become healthy")
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM to SIGKILL when stopping")


@dataclass(frozen=True)
class GroupPlan:
    """Ports and commands of one engine group, decided before anything starts."""

    engine_commands: list[list[str]]
    engine_urls: list[str]
    ranks_per_engine: list[int]
    router_command: list[str] | None
    router_url: str | None
    env: dict[str, str]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command(urls: Sequence[str], port: int, policy: str, python: str = sys.executable) -> list[str]:
    """`sglang_router.launch_router` on 127.0.0.1 over `urls` with `policy` (from this environment)."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError(
            "the SGLang router is not installed: pip install 'patchgym[sglang]' (sglang-router), "
            "or set router: none to balance requests in the client"
        )
    command = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warn"]
    # its metrics exporter listens too (by default on 0.0.0.0:29000, taken by a second router)
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return [*command, "--worker-startup-check-interval", "1"]  # register an engine as soon as it is up


def server_settings(model: Path, launch: EngineLaunch, *, max_context: int) -> SGLangLaunchSettings:
    """The flags every server of the group shares (port, host and GPU are each server's own): the CPU
    SGLang venv (built if missing) with `cpu_venv`, `launch.python` (or this one) on GPUs."""
    from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings

    python, stubs, device = Path(launch.python or sys.executable), None, "cuda"
    if launch.cpu_venv:
        from patchgym.backends.inference.sglang_venv import build_sglang_venv, stubs_path, venv_python

        venv = build_sglang_venv(progress=lambda _: None)
        python, stubs, device = venv_python(venv), stubs_path(venv), "cpu"
    return SGLangLaunchSettings(
        model_path=model.resolve(),
        python=python,
        device=device,
        context_length=launch.context_length or max_context,
        mem_fraction_static=launch.mem_fraction_static if device == "cuda" else None,
        max_total_tokens=launch.max_total_tokens or (16384 if device == "cpu" else None),
        dtype=launch.dtype,
        stubs_dir=stubs,
        extra_args=(*(["--tp-size", str(launch.tp)] if launch.tp > 1 else []), *launch.extra_args),
    )


def plan_group(model: Path, launch: EngineLaunch, *, max_context: int, router: RouterPolicy) -> GroupPlan:
    """Commands for `launch.engines` servers (and the router unless `router` is none)."""
    from patchgym.backends.inference.sglang_launch import server_command, server_env

    base = server_settings(model, launch, max_context=max_context)
    gpus = launch.gpus if launch.gpus is not None else list(range(launch.engines * launch.tp))
    if base.device == "cuda" and len(gpus) < launch.engines * launch.tp:
        raise ConfigError(f"{launch.engines} engines at tp={launch.tp} need {launch.engines * launch.tp} GPUs")
    commands, urls = [], []
    for i in range(launch.engines):
        settings = replace(base, base_port=free_port(), gpus=(gpus[i * launch.tp],))
        commands.append(server_command(settings, 0))
        urls.append(f"http://127.0.0.1:{settings.base_port}")
    router_port = free_port() if router != "none" else None
    return GroupPlan(
        engine_commands=commands,
        engine_urls=urls,
        ranks_per_engine=[launch.tp] * launch.engines,
        router_command=router_command(urls, router_port, router) if router_port else None,
        router_url=f"http://127.0.0.1:{router_port}" if router_port else None,
        env=server_env(base),
    )


def launch_settings(value: Any) -> EngineLaunch:
    """`launch:` of the sglang backend, checked (a `ConfigError` naming each bad field)."""
    try:
        return EngineLaunch.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid sglang launch settings: {problems}") from None


def sglang_backend(
    model: str | Path | None = None,
    *,
    urls: str | Sequence[str] | None = None,
    launch: dict[str, Any] | None = None,
    router: RouterPolicy | None = None,
    **client: Any,
) -> Any:
    """The registered `sglang` factory: attach to `urls`, or start the group `launch` describes.

    `router` defaults to cache_aware for a started group and to none (client-side balancing)
    for attached URLs; `client` holds `SGLangEngine`'s settings (max_context, concurrency, ...).
    """
    from patchgym.backends.inference.sglang import SGLangEngine

    if (urls is None) == (launch is None):
        raise ConfigError(
            "the sglang backend needs either urls: [...] (servers started elsewhere) "
            "or launch: {engines: N, cpu_venv: true, ...} (patchgym starts them)"
        )
    if router is not None and router not in RouterPolicy.__args__:  # type: ignore[attr-defined]
        raise ConfigError(f"router must be one of {', '.join(RouterPolicy.__args__)}, not {router!r}")  # type: ignore[attr-defined]
    try:
        inspect.signature(SGLangEngine).bind(["url"], **client)
    except TypeError as exc:
        raise ConfigError(f"invalid sglang client settings: {exc}") from None
    if urls is not None:
        workers = [urls] if isinstance(urls, str) else list(urls)
        policy = router or "none"
        supervisor = Supervisor(log_dir("sglang")) if policy != "none" else None
        router_url = None
        if supervisor is not None:
            port = free_port()
            supervisor.start("sglang-router", router_command(workers, port, policy))
            router_url = f"http://127.0.0.1:{port}"
        return SGLangEngine(workers, router_url=router_url, supervisor=supervisor, **client)
    if model is None:
        raise ConfigError("launching SGLang servers needs the model directory")
    settings = launch_settings(launch)
    plan = plan_group(Path(model), settings, max_context=client["max_context"], router=router or "cache_aware")
    supervisor = Supervisor(log_dir("sglang"), stop_grace_s=settings.stop_grace_s)
    try:
        for i, command in enumerate(plan.engine_commands):
            supervisor.start(f"sglang-engine-{i}", command, plan.env)
        if plan.router_command is not None:
            supervisor.start("sglang-router", plan.router_command)
        return SGLangEngine(
            plan.engine_urls,
            router_url=plan.router_url,
            supervisor=supervisor,
            ranks_per_engine=plan.ranks_per_engine,
            start_timeout_s=settings.health_timeout_s,
            launch=settings.model_dump(),
            **client,
        )
    except BaseException:
        supervisor.stop()
        raise
