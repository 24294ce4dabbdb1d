"""Cost of running one command in a sandbox, every path side by side in one run.

Docker paths, all on the same containers of `patchgym/base:latest`: patchgym's exec channel,
patchgym's plain exec (one `docker exec` per command), the raw `docker exec` CLI, the SDK's
bare `exec_run`, and mini-swe-agent's DockerEnvironment when it is installed. Local paths:
patchgym's local backend (isolation none and bwrap) and mini-swe-agent's LocalEnvironment.

Prints, per path: the median and p95 latency of `true`, `cat` of a 100 KB file and
`python3 -c pass`; commands/s with 1, 16 and 64 sandboxes running `true` at once; and CPU
milliseconds per command at 16 sandboxes (this process and its children, plus, for Docker,
dockerd, containerd, the containers' shims and the containers' cgroups: the daemons are
shared, so other work on the machine adds noise). Ratios are against the SDK's `exec_run`
(Docker) and mini-swe-agent's LocalEnvironment (local).

    nice -n 10 python benchmarks/sandbox_exec.py [--repeats 30] [--commands 192] [--sandboxes 1,16,64] [--image I]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import resource
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from patchgym.backends.sandbox.docker import DockerSandbox, DockerSandboxBackend
from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.sandbox import Sandbox, SandboxSpec

COMMANDS = {"true": "true", "cat 100 KB": "cat big.txt", "python3 -c pass": "python3 -c pass"}
RUN_LABEL = f"bench-{secrets.token_hex(4)}"
Run = Callable[[str], Awaitable[Any]]
"""Runs one command in one sandbox of a path."""


@dataclass
class Route:
    name: str
    group: str  # "docker" or "local"
    runners: list[Run]  # one per sandbox
    latency: dict[str, list[float]] = field(default_factory=dict)
    rate: dict[int, float] = field(default_factory=dict)
    cpu_ms: float = float("nan")


# -- CPU accounting ---------------------------------------------------------------------------
def _proc_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of a process, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _pids_named(*names: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() in names:
                    pids.append(int(entry.name))
    return pids


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cgroup_cpu_s(container_id: str) -> float:
    for path in (
        f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat",
        f"/sys/fs/cgroup/docker/{container_id}/cpu.stat",
    ):
        with contextlib.suppress(OSError):
            text = Path(path).read_text()
            if path.endswith("usage"):
                return int(text) / 1e9
            return int(text.split()[1]) / 1e6  # cpu.stat: usage_usec first
    return 0.0


def _self_cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def cpu_meter(containers: list[Any]) -> Iterator[list[float]]:
    """Seconds of CPU spent while the block runs (see the module docstring for what counts)."""
    daemons = _pids_named("dockerd", "containerd") if containers else []
    for container in containers:
        container.reload()  # the attributes of a container created by this process predate its start
    shims = [_parent(c.attrs["State"]["Pid"]) for c in containers]
    ids = [c.id for c in containers]

    def total() -> float:
        return _self_cpu_s() + sum(map(_proc_cpu_s, daemons + shims)) + sum(_cgroup_cpu_s(cid) for cid in ids)

    spent = [0.0]
    before = total()
    yield spent
    spent[0] = total() - before


# -- paths ------------------------------------------------------------------------------------
def _threaded(fn: Callable[[str], Any], pool: ThreadPoolExecutor) -> Run:
    async def run(cmd: str) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, cmd)

    return run


def _sandbox_runner(box: Sandbox) -> Run:
    async def run(cmd: str) -> Any:
        result = await box.exec(cmd, timeout_s=60)
        assert result.exit_code == 0, result
        return result

    return run


def _cli_runner(container_id: str) -> Run:
    async def run(cmd: str) -> bytes:
        proc = await asyncio.create_subprocess_exec(
            "docker", "exec", "-w", "/workspace", container_id, "bash", "-c", cmd, stdout=subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        return out

    return run


def _sdk_runner(container: Any, pool: ThreadPoolExecutor) -> Run:
    def run(cmd: str) -> Any:
        result = container.exec_run(["bash", "-c", cmd], workdir="/workspace", demux=True)
        assert result.exit_code == 0
        return result

    return _threaded(run, pool)


def _mini_docker_runner(container_id: str, pool: ThreadPoolExecutor) -> Run:
    """mini-swe-agent's DockerEnvironment, attached to an already started container."""
    from minisweagent.environments.docker import DockerEnvironment, DockerEnvironmentConfig

    env = DockerEnvironment.__new__(DockerEnvironment)
    env.config = DockerEnvironmentConfig(image="patchgym/base:latest", cwd="/workspace")
    env.container_id = container_id
    env.cleanup = lambda: None  # the container is the benchmark's, not mini's

    def run(cmd: str) -> Any:
        out = env.execute({"command": cmd})
        assert out["returncode"] == 0, out
        return out

    return _threaded(run, pool)


def _mini_local_runner(workdir: Path, pool: ThreadPoolExecutor) -> Run:
    from minisweagent.environments.local import LocalEnvironment

    env = LocalEnvironment(cwd=str(workdir))

    def run(cmd: str) -> Any:
        out = env.execute({"command": cmd})
        assert out["returncode"] == 0, out
        return out

    return _threaded(run, pool)


# -- measuring --------------------------------------------------------------------------------
async def measure_latency(path: Route, repeats: int) -> None:
    run = path.runners[0]
    for name, cmd in COMMANDS.items():
        await run(cmd)  # warm up (the channel starts its server on first use)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            await run(cmd)
            samples.append((time.perf_counter() - started) * 1e3)
        path.latency[name] = samples


async def measure_rate(path: Route, sandboxes: int, commands: int) -> float:
    per_box = max(2, commands // sandboxes)

    async def loop(run: Run) -> None:
        for _ in range(per_box):
            await run("true")

    runners = path.runners[:sandboxes]
    await asyncio.gather(*(run("true") for run in runners))  # warm up every sandbox
    started = time.perf_counter()
    await asyncio.gather(*(loop(run) for run in runners))
    return sandboxes * per_box / (time.perf_counter() - started)


async def measure(path: Route, args: argparse.Namespace, containers: list[Any], console: Console) -> None:
    console.print(f"[dim]measuring {path.name}[/dim]")
    await measure_latency(path, args.repeats)
    for n in args.sandboxes:
        if n == 16:
            with cpu_meter(containers[:n]) as spent:
                path.rate[n] = await measure_rate(path, n, args.commands)
            per_box = max(2, args.commands // n)
            path.cpu_ms = spent[0] * 1e3 / (n * (per_box + 1))
        else:
            path.rate[n] = await measure_rate(path, n, args.commands)


# -- report -----------------------------------------------------------------------------------
def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[18] if len(values) >= 2 else values[0]


def report(paths: list[Route], args: argparse.Namespace, console: Console) -> None:
    baselines = {"docker": "SDK exec_run", "local": "mini-swe-agent local"}
    for group, baseline_name in baselines.items():
        group_paths = [p for p in paths if p.group == group]
        baseline = next((p for p in group_paths if p.name == baseline_name), None)
        table = Table(title=f"{group}: per-command latency (ms) and throughput; ratio = path / {baseline_name}")
        table.add_column("path")
        for name in COMMANDS:
            table.add_column(f"{name}\nmedian / p95", justify="right")
        table.add_column("`true`\nratio", justify="right")
        for n in args.sandboxes:
            table.add_column(f"cmds/s\n@{n}", justify="right")
        table.add_column(f"cmds/s @{args.sandboxes[-1] if 16 not in args.sandboxes else 16}\nratio", justify="right")
        table.add_column("CPU ms\n/cmd @16", justify="right")
        for p in group_paths:
            cells = [f"{statistics.median(p.latency[c]):.2f} / {_p95(p.latency[c]):.2f}" for c in COMMANDS]
            ratio = (
                statistics.median(p.latency["true"]) / statistics.median(baseline.latency["true"])
                if baseline
                else float("nan")
            )
            key = 16 if 16 in args.sandboxes else args.sandboxes[-1]
            rate_ratio = p.rate[key] / baseline.rate[key] if baseline else float("nan")
            rates = [f"{p.rate[n]:.0f}" for n in args.sandboxes]
            table.add_row(p.name, *cells, f"{ratio:.2f}x", *rates, f"{rate_ratio:.2f}x", f"{p.cpu_ms:.1f}")
        console.print(table)


# -- setup ------------------------------------------------------------------------------------
async def main(args: argparse.Namespace) -> None:
    console = Console(width=200)
    most = max(args.sandboxes)
    mini = importlib.util.find_spec("minisweagent") is not None
    pool = ThreadPoolExecutor(max_workers=most)
    paths: list[Route] = []
    with tempfile.TemporaryDirectory(prefix="patchgym-bench-") as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        (workspace / "big.txt").write_bytes(b"x" * 99_999 + b"\n")
        spec = SandboxSpec(workspace=workspace, labels={"patchgym.bench": RUN_LABEL})

        channel = DockerSandboxBackend(concurrency=most, exec_channel=True, default_image=args.image)
        plain = DockerSandboxBackend(concurrency=most, exec_channel=False, reap_dead_owners=False)
        local = {iso: LocalSandboxBackend(isolation=iso, root_dir=tmp) for iso in ("none", "bwrap")}
        boxes: list[DockerSandbox] = []
        local_boxes: list[Sandbox] = []
        try:
            console.print(f"[dim]starting {most} containers[/dim]")
            for _ in range(0, most, 8):  # eight at a time: the machine is shared
                boxes += await asyncio.gather(*(channel.create(spec) for _ in range(min(8, most - len(boxes)))))
            containers = [b.container for b in boxes]
            plain_boxes = [DockerSandbox(plain, c, spec) for c in containers]
            paths += [
                Route("patchgym channel", "docker", [_sandbox_runner(b) for b in boxes]),
                Route("patchgym plain exec", "docker", [_sandbox_runner(b) for b in plain_boxes]),
                Route("docker exec CLI", "docker", [_cli_runner(c.id) for c in containers]),
                Route("SDK exec_run", "docker", [_sdk_runner(c, pool) for c in containers]),
            ]
            if mini:
                paths.append(
                    Route("mini-swe-agent docker", "docker", [_mini_docker_runner(c.id, pool) for c in containers])
                )
            for iso, backend in local.items():
                made = [await backend.create(spec) for _ in range(most)]
                local_boxes += made
                paths.append(Route(f"patchgym local {iso}", "local", [_sandbox_runner(b) for b in made]))
            if mini:
                paths.append(
                    Route("mini-swe-agent local", "local", [_mini_local_runner(workspace, pool) for _ in range(most)])
                )
            for path in paths:
                await measure(path, args, containers if path.group == "docker" else [], console)
            assert channel.settings()["exec_paths"]["channel"] == most, channel.settings()["exec_paths"]
        finally:
            await asyncio.gather(*(b.close() for b in boxes + local_boxes), return_exceptions=True)
            await channel.reap({"patchgym.bench": RUN_LABEL})
            for backend in (channel, plain, *local.values()):
                await backend.aclose()
            pool.shutdown()
    report(paths, args, console)
    if not mini:
        console.print("mini-swe-agent is not installed: its rows are missing (pip install mini-swe-agent)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="patchgym/base:latest", help="the Docker image (it needs bash and python3)")
    parser.add_argument("--repeats", type=int, default=30, help="latency samples per command and path")
    parser.add_argument("--commands", type=int, default=192, help="commands per throughput point (split over boxes)")
    parser.add_argument("--sandboxes", type=lambda s: [int(n) for n in s.split(",")], default=[1, 16, 64])
    asyncio.run(main(parser.parse_args()))
