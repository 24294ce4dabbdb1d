"""The `sglang` inference backend as `patchgym run` builds it: attach to engines, or start a group.

`inference: {name: sglang, options: {urls: [...]}}` attaches to servers started elsewhere.
`options: {launch: {engines: N, cpu_venv: true, tp: 1, extra_args: [...]}}` starts N servers
itself (one free port each on 127.0.0.1; the CPU SGLang venv of `sglang_venv` with `cpu_venv`,
GPUs `gpus[i*tp : (i+1)*tp]` otherwise) and puts the SGLang router (`sglang-router`, run from
this environment, bound to 127.0.0.1) in front of them: generation goes through the router
(`router: cache_aware` by default; `random`, `round_robin`, `power_of_two`; `none` balances
in the client; `router_options` are more router flags), control calls (pause, abort, weight
updates, group set-up, cache flush) go to each server directly. The servers, the router and
their logs belong to the engine: `start()` waits until all are healthy, `aclose()` stops them.

`plan_sglang` decides every process (argv, environment, GPUs, ports from a given source) and
starts nothing; `sglang_backend` starts what it decided, and `patchgym run --dry-run` shows it.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from patchgym.core.errors import ConfigError
from patchgym.launch.context import log_dir
from patchgym.launch.plan import ProcessPlan, Where
from patchgym.launch.processes import Supervisor

if TYPE_CHECKING:
    from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings

RouterPolicy = Literal["cache_aware", "round_robin", "random", "power_of_two", "none"]
CACHE_AWARE_BALANCE = {"balance_abs_threshold": 2, "balance_rel_threshold": 1.2}
"""patchgym's balance for `cache_aware` (the router's own defaults: 64 and 1.5). Rollout prompts
share their system prompt, so the prefix tree sends every new episode to the engine that holds
it, and the router's defaults rebalance only once one engine has 64 more requests in flight:
at a rollout concurrency of 32, one engine of two served everything. With these, a request goes
to the least-loaded engine as soon as the loads differ by more than 2 and 20%; while the
engines are balanced, the later turns of an episode follow their cached prefix."""


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
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per CPU server (default: this machine's cores / engines, at least 1; two "
        "engines of 2 threads on 2 cores spun in each other's thread barriers, 10x slower)",
    )
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="GPU memory for weights and KV")
    dtype: str = "auto"
    extra_args: list[str] = Field(default_factory=list, description="more sglang.launch_server flags")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables for the servers")
    health_timeout_s: float = Field(600.0, gt=0, description="how long the servers may take to become healthy")
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM to SIGKILL when stopping")


@dataclass(frozen=True)
class EngineRuntime:
    """The python the servers run with and their device."""

    python: Path
    device: Literal["cuda", "cpu"]
    stubs: Path | None = None
    ready: bool = True
    """False: the CPU SGLang venv is not built yet (`patchgym run` builds it before starting the servers)."""


@dataclass(frozen=True)
class SGLangPlan:
    """What the sglang backend starts (engines, then the router) and where its client connects."""

    engine_urls: tuple[str, ...]
    router_url: str | None
    processes: tuple[ProcessPlan, ...]
    launch: EngineLaunch | None = None
    """The launch settings of a started group; None for attached servers."""
    runtime: EngineRuntime | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def require_router() -> None:
    """A clear error when the SGLang router (the `sglang` extra) is not installed here."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError(
            "the SGLang router is not installed: pip install 'patchgym[sglang]' (sglang-router), "
            "or set router: none to balance requests in the client"
        )


def router_flags(policy: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The router flags a run uses: patchgym's balance for cache_aware, overridden by `options`."""
    return {**(CACHE_AWARE_BALANCE if policy == "cache_aware" else {}), **(options or {})}


def router_command(
    urls: Sequence[str],
    port: int,
    policy: str,
    *,
    metrics_port: int,
    options: Mapping[str, Any] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """`sglang_router.launch_router` on 127.0.0.1 over `urls` with `policy` (from this environment);
    `options` are more of its flags by name (`balance_abs_threshold: 2` → `--balance-abs-threshold 2`)."""
    command = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warn"]
    for name, value in (options or {}).items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    # its metrics exporter listens too (by default on 0.0.0.0:29000, taken by a second router)
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return [*command, "--worker-startup-check-interval", "1"]  # register an engine as soon as it is up


def router_process(
    urls: Sequence[str], policy: str, ports: Callable[[], int], options: Mapping[str, Any] | None = None
) -> ProcessPlan:
    """The router in front of `urls`, on a port of 127.0.0.1 from `ports`, with `router_flags(policy, options)`."""
    port = ports()
    argv = router_command(urls, port, policy, metrics_port=ports(), options=router_flags(policy, options))
    return ProcessPlan("sglang-router", "router", Where(host="127.0.0.1"), tuple(argv), url=f"http://127.0.0.1:{port}")


def engine_runtime(launch: EngineLaunch, *, build: bool) -> EngineRuntime:
    """The servers' python: `launch.python` (or this one) on GPUs, or the CPU SGLang venv, built
    first when `build` (otherwise only its path: a plan that starts nothing builds nothing)."""
    if not launch.cpu_venv:
        return EngineRuntime(Path(launch.python or sys.executable), "cuda")
    from patchgym.backends.inference.sglang_venv import (
        build_sglang_venv,
        default_venv_path,
        is_ready,
        stubs_path,
        venv_python,
    )

    venv = build_sglang_venv(progress=lambda _: None) if build else default_venv_path()
    return EngineRuntime(venv_python(venv), "cpu", stubs_path(venv), ready=is_ready(venv))


def server_settings(
    model: Path, launch: EngineLaunch, *, max_context: int, runtime: EngineRuntime
) -> SGLangLaunchSettings:
    """The flags every server of the group shares (its port, host and GPU are each server's own)."""
    from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings

    return SGLangLaunchSettings(
        model_path=model.resolve(),
        python=runtime.python,
        device=runtime.device,
        context_length=launch.context_length or max_context,
        mem_fraction_static=launch.mem_fraction_static if runtime.device == "cuda" else None,
        max_total_tokens=launch.max_total_tokens or (16384 if runtime.device == "cpu" else None),
        dtype=launch.dtype,
        stubs_dir=runtime.stubs,
        cpu_threads=(launch.cpu_threads or max(1, (os.cpu_count() or 1) // launch.engines))
        if runtime.device == "cpu"
        else None,
        extra_args=(*(["--tp-size", str(launch.tp)] if launch.tp > 1 else []), *launch.extra_args),
    )


def server_environment(settings: SGLangLaunchSettings, launch: EngineLaunch) -> dict[str, str]:
    """What a server adds to the environment it inherits: its own variables, then `launch.env`."""
    from patchgym.backends.inference.sglang_launch import server_env_changes

    return {**server_env_changes(settings), **launch.env}


def plan_group(
    model: Path,
    launch: EngineLaunch,
    *,
    max_context: int,
    router: RouterPolicy,
    runtime: EngineRuntime,
    ports: Callable[[], int] = free_port,
    router_options: Mapping[str, Any] | None = None,
) -> SGLangPlan:
    """`launch.engines` servers, each on a port from `ports` and its GPUs (and the router unless `router` is none)."""
    device, tp = runtime.device, launch.tp
    gpus = launch.gpus if launch.gpus is not None else list(range(launch.engines * tp))
    if device == "cuda" and len(gpus) < launch.engines * tp:
        raise ConfigError(f"{launch.engines} engines at tp={tp} need {launch.engines * tp} GPUs")
    base = server_settings(model, launch, max_context=max_context, runtime=runtime)
    engines = []
    for i in range(launch.engines):
        own = tuple(gpus[i * tp : (i + 1) * tp]) if device == "cuda" else ()
        engines.append(engine_process(f"sglang-engine-{i}", base, launch, host=base.host, port=ports(), gpus=own))
    urls = [engine.url or "" for engine in engines]
    front = router_process(urls, router, ports, router_options) if router != "none" else None
    return SGLangPlan(
        engine_urls=tuple(urls),
        router_url=front.url if front else None,
        processes=(*engines, *([front] if front else [])),
        launch=launch,
        runtime=runtime,
    )


def engine_process(
    name: str,
    base: SGLangLaunchSettings,
    launch: EngineLaunch,
    *,
    host: str,
    port: int,
    gpus: tuple[int, ...],
    base_gpu: int | None = None,
) -> ProcessPlan:
    """One server of the group: `base`'s flags on `host:port`, holding `gpus` (its `--base-gpu-id` is
    `base_gpu`, default the first of them: a Ray actor that sees only its own GPUs passes 0)."""
    from patchgym.backends.inference.sglang_launch import server_command

    first = base_gpu if base_gpu is not None else (gpus[0] if gpus else 0)
    settings = replace(base, host=host, base_port=port, gpus=(first,))
    cuda = base.device == "cuda"
    where = Where(host=host, gpus=gpus, resources={"GPU": launch.tp} if cuda else {})
    argv, env = tuple(server_command(settings, 0)), server_environment(settings, launch)
    return ProcessPlan(name, "engine", where, argv, env, url=f"http://{host}:{port}")


def launch_settings(value: Any) -> EngineLaunch:
    """`launch:` checked, or a `ConfigError` listing what is wrong."""
    try:
        return EngineLaunch.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid sglang launch settings: {problems}") from None


def plan_sglang(
    model: str | Path | None = None,
    *,
    build: bool,
    ports: Callable[[], int],
    urls: str | Sequence[str] | None = None,
    launch: dict[str, Any] | None = None,
    router: RouterPolicy | None = None,
    router_options: Mapping[str, Any] | None = None,
    **client: Any,
) -> SGLangPlan:
    """The `sglang` backend's processes for its options (see `sglang_backend`), starting nothing;
    `build` builds the CPU SGLang venv if the plan needs it."""
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
        workers = tuple([urls] if isinstance(urls, str) else urls)
        front = router_process(workers, router, ports, router_options) if router not in (None, "none") else None
        return SGLangPlan(workers, front.url if front else None, (front,) if front else ())
    if model is None:
        raise ConfigError("launching SGLang servers needs the model directory")
    settings = launch_settings(launch)
    runtime = engine_runtime(settings, build=build)
    return plan_group(
        Path(model), settings, max_context=client["max_context"], router=router or "cache_aware", runtime=runtime,
        ports=ports, router_options=router_options,
    )  # fmt: skip


def sglang_backend(
    model: str | Path | None = None,
    *,
    urls: str | Sequence[str] | None = None,
    launch: dict[str, Any] | None = None,
    router: RouterPolicy | None = None,
    router_options: Mapping[str, Any] | None = None,
    **client: Any,
) -> Any:
    """The registered `sglang` factory: attach to `urls`, or start the group `launch` describes.

    `router` defaults to cache_aware for a started group and to none (client-side balancing)
    for attached URLs; `router_options` are more `sglang_router.launch_router` flags by name
    (for cache_aware, `CACHE_AWARE_BALANCE` unless given); `client` holds `SGLangEngine`'s
    settings (max_context, concurrency, ...).

    Args:
        model: the policy's Hugging Face folder (the pipeline passes model.path); servers load it
        urls: attach to running SGLang servers at these URLs (a list or comma-separated) instead of launching
        launch: start a group of SGLang servers: engines, tp, gpus, mem_fraction_static, ... (see the Inference page)
        router: the SGLang router's policy in front of a started group (cache_aware, round_robin, ...; none: balance
            in the client)
        router_options: more sglang_router flags by name; also takes SGLangEngine's settings (max_context,
            concurrency, ...)
    """
    from patchgym.backends.inference.sglang import SGLangEngine

    plan = plan_sglang(
        model, build=True, ports=free_port, urls=urls, launch=launch, router=router, router_options=router_options,
        **client,
    )  # fmt: skip
    if not plan.processes:  # attached servers, balanced in the client
        return SGLangEngine(list(plan.engine_urls), **client)
    if plan.router_url is not None:
        require_router()
    policy = router or ("cache_aware" if launch is not None else "none")
    settings, started = plan.launch, {"router": {"policy": policy, **router_flags(policy, router_options)}}
    if settings is not None:
        started |= {
            "ranks_per_engine": [settings.tp] * settings.engines,
            "start_timeout_s": settings.health_timeout_s,
            "launch": settings.model_dump(),
        }
    grace = {} if settings is None else {"stop_grace_s": settings.stop_grace_s}
    supervisor = Supervisor(log_dir("sglang"), **grace)
    try:
        for process in plan.processes:
            supervisor.start(process.name, list(process.argv), process.environ())
        return SGLangEngine(
            list(plan.engine_urls), router_url=plan.router_url, supervisor=supervisor, **started, **client
        )
    except BaseException:
        supervisor.stop()
        raise
