"""Start SGLang servers with the recommended flags and wait until they are healthy.

One engine per GPU (pinned with `--base-gpu-id`), a hard context cap (`context_length`, the
`max_context` to give `SGLangEngine`),
a memory fraction for the KV cache. On CPU (`device="cpu"`) the flags that work without
CUDA kernels: `--device cpu --attention-backend torch_native --disable-cuda-graph` and a
`--max-total-tokens` bound on the KV pool (otherwise it takes most of the RAM), with the
stub modules of a venv from `sglang_venv` on PYTHONPATH, and `--sleep-on-idle` (an idle
scheduler otherwise polls its sockets and keeps a core busy).

Each server leads its own process group (its scheduler and detokenizer are in it), and
`stop_servers` stops the whole group: SIGTERM, then SIGKILL after `stop_grace_s`.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from patchgym.core.errors import ConfigError, SandboxStartError, TransportError
from patchgym.process_groups import stop_groups

SERVER_CONTEXT_HEADROOM = 8
"""SGLang admits a prompt only if it is shorter than its context length minus 6 (reserved
tokens), so servers get this much above the cap; the client (`SGLangEngine.max_context`)
enforces the cap itself."""


class EngineStartError(SandboxStartError):
    """An inference engine process did not come up."""

    kind = "engine_start"


@dataclass(frozen=True)
class SGLangLaunchSettings:
    """Flags for each server; every limit is explicit."""

    model_path: Path
    python: Path = Path("python")
    host: str = "127.0.0.1"
    base_port: int = 30000
    device: str = "cuda"
    gpus: Sequence[int] = (0,)
    context_length: int = 32768
    mem_fraction_static: float | None = 0.85
    max_total_tokens: int | None = None
    dtype: str = "auto"
    max_running_requests: int | None = None
    stubs_dir: Path | None = None
    extra_args: Sequence[str] = ()
    health_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    """Seconds a stopped server's process group gets to exit after SIGTERM before SIGKILL."""
    cpu_threads: int | None = None
    """Torch threads of a CPU server (`OMP_NUM_THREADS`); None: torch's default (every core)."""
    sleep_on_idle: bool | None = None
    """`--sleep-on-idle`: block on the sockets when there is no work; None = on for CPU, off for GPU."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"device must be cuda or cpu, not {self.device!r}")
        if self.context_length <= 0:
            raise ConfigError("context_length must be > 0")
        if self.device == "cpu" and self.max_total_tokens is None:
            raise ConfigError("on CPU set max_total_tokens (the KV pool otherwise takes most of the RAM)")
        if not self.gpus:
            raise ConfigError("gpus must name at least one device (use (0,) on CPU)")
        if self.stop_grace_s < 0:
            raise ConfigError(f"stop_grace_s must be >= 0, not {self.stop_grace_s}")


@dataclass
class SGLangServer:
    url: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def server_command(settings: SGLangLaunchSettings, index: int) -> list[str]:
    s = settings
    cmd = [
        str(s.python), "-m", "sglang.launch_server",
        "--model-path", str(s.model_path),
        "--host", s.host,
        "--port", str(s.base_port + index),
        "--context-length", str(s.context_length + SERVER_CONTEXT_HEADROOM),
        "--dtype", s.dtype,
        "--weight-version", "0",
    ]  # fmt: skip
    if s.device == "cpu":
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
    else:
        cmd += ["--base-gpu-id", str(s.gpus[index])]
    if s.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(s.mem_fraction_static)]
    if s.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(s.max_total_tokens)]
    if s.max_running_requests is not None:
        cmd += ["--max-running-requests", str(s.max_running_requests)]
    if s.sleep_on_idle if s.sleep_on_idle is not None else s.device == "cpu":
        cmd += ["--sleep-on-idle"]
    return cmd + list(s.extra_args)


def server_env_changes(settings: SGLangLaunchSettings, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a server gets on top of `base`: offline hub, and on CPU the CPU engine and the stubs
    (put before `base`'s PYTHONPATH)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if settings.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if settings.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(settings.cpu_threads)
        if settings.stubs_dir is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(settings.stubs_dir), base.get("PYTHONPATH")) if p)
    return env


def server_env(settings: SGLangLaunchSettings) -> dict[str, str]:
    return {**os.environ, **server_env_changes(settings)}


def launch_sglang(settings: SGLangLaunchSettings, log_dir: Path) -> list[SGLangServer]:
    """Start one server per GPU (one on CPU) and wait for `/health` on all; kill them on failure."""
    log_dir.mkdir(parents=True, exist_ok=True)
    count = 1 if settings.device == "cpu" else len(settings.gpus)
    servers = []
    for index in range(count):
        cmd = server_command(settings, index)
        log_path = log_dir / f"sglang-{settings.base_port + index}.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(settings), start_new_session=True
            )
        url = f"http://{settings.host}:{settings.base_port + index}"
        servers.append(SGLangServer(url, process, log_path, cmd))
    try:
        for server in servers:
            wait_healthy(server, settings.health_timeout_s)
    except BaseException:
        stop_servers(servers, settings.stop_grace_s)
        raise
    return servers


def wait_healthy(server: SGLangServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise EngineStartError(
                f"SGLang server {server.url} exited with code {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            if httpx.get(server.url + "/health", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TransportError(f"SGLang server {server.url} not healthy after {timeout_s:.0f} s:\n{server.log_tail()}")


def stop_servers(servers: Sequence[SGLangServer], grace_s: float = SGLangLaunchSettings.stop_grace_s) -> None:
    """SIGTERM each server's process group, SIGKILL what is left of them after `grace_s` (all at once)."""
    stop_groups([server.process for server in servers], grace_s)
