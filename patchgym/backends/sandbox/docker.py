"""Docker sandbox backend on the `docker` SDK.

Each sandbox is a container running `sleep infinity` under `init` (zombies are reaped), with
the spec's CPU, memory and PID limits, labels naming its owner, and no network unless the spec
asks for it (then it joins one shared, pre-created network: never one network per sandbox).
Commands run in the image's environment (`bash -c`, not a login shell), each in a process
group that a timeout, the command's end, or a cancelled call kills. They travel over the
sandbox's exec channel (`exec_channel`: one long-lived exec with a small server inside that
forks each command) when the image has a Python, else as one `docker exec` each, wrapped
in-container (`process_group`); either way output is captured in capped buffers. Files move
as tar archives. The SDK is synchronous: it runs on a thread pool sized by `concurrency`,
and the HTTP connection pool is sized to match.

Starting sandboxes is taken off the critical path by a warm pool (`pool_size` started
containers per image, resource shape and workspace, the workspace already copied in; a
container is used for one sandbox only), and
containers of this owner's earlier processes that died are reaped when the backend starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import hashlib
import io
import os
import posixpath
import secrets
import socket
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import docker.types
import requests.exceptions
from docker.models.containers import Container
from docker.utils.socket import frames_iter

from patchgym.backends.sandbox.disk_quota import DiskQuota
from patchgym.backends.sandbox.exec_channel import ExecChannel
from patchgym.backends.sandbox.process_group import group_argv, kill_group_command
from patchgym.core.errors import (
    BuildError,
    ConfigError,
    InfraError,
    SandboxLostError,
    SandboxStartError,
    TransportError,
)
from patchgym.core.output import CappedBuffer
from patchgym.core.sandbox import (
    DEFAULT_MAX_OUTPUT_BYTES,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
)

T = TypeVar("T")

DEFAULT_IMAGE = "patchgym/base:latest"
LABEL = "patchgym"


def owner_name() -> str:
    """Who owns the containers this process starts: user@host."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _translate(exc: Exception, what: str) -> InfraError:
    """Map a docker SDK error onto our infrastructure errors."""
    if isinstance(exc, docker.errors.NotFound):
        return SandboxLostError(f"{what}: the container is gone ({exc.explanation})")
    if isinstance(exc, docker.errors.APIError):
        # 409, or a 500 when the container stopped while the engine was starting an exec in it
        if exc.status_code == 409 or "is not running" in str(exc.explanation or ""):
            return SandboxLostError(f"{what}: the container is not running ({exc.explanation})")
        return TransportError(f"{what}: Docker engine error {exc.status_code}: {exc.explanation}")
    return TransportError(f"{what}: cannot reach the Docker engine: {exc}")


_DOCKER_FAULTS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def _sdk_call(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, its Docker faults raised as InfraErrors (for the exec channel)."""
    try:
        return fn(*args)
    except _DOCKER_FAULTS as exc:
        raise _translate(exc, "exec channel") from exc


def _tar_dir(local_dir: Path, target: str) -> tempfile.SpooledTemporaryFile[bytes]:
    """A tar placing `local_dir`'s contents at `target` when extracted at "/".

    Spooled in memory up to 32 MiB, on disk beyond. Extracting at "/" creates the missing
    parents of `target` without another exec.
    """
    archive = tempfile.SpooledTemporaryFile(max_size=32 << 20)  # noqa: SIM115 - the caller closes it
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.add(str(local_dir), arcname=target.lstrip("/") or ".")
    archive.seek(0)
    return archive


def _tar_files(files: Mapping[str, bytes]) -> tempfile.SpooledTemporaryFile[bytes]:
    """A tar of regular files only (absolute paths to bytes): extracted at "/", it creates their
    missing parents and leaves existing directories' owner and mode alone."""
    archive = tempfile.SpooledTemporaryFile(max_size=32 << 20)  # noqa: SIM115 - the caller closes it
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    archive.seek(0)
    return archive


def _put_archive(container: Container, target: str, payload: Any) -> None:
    try:
        if not container.put_archive(target, payload):
            raise TransportError(f"the Docker engine refused to write into {target}")
    except _DOCKER_FAULTS as exc:
        raise _translate(exc, "write failed") from exc


def missing_image_hint(image: str) -> str:
    """What to do about an image this engine lacks: the base image is built offline by patchgym;
    a local SWE-bench instance image (`sweb.eval.*` without a namespace) by the swebench harness;
    anything else is built (a Debian base by patchgym, under that tag) or pulled."""
    if image == DEFAULT_IMAGE:
        how = "build it offline with `patchgym sandbox build-base`"
    elif image.startswith("sweb."):
        how = (
            "it is a locally built SWE-bench instance image: build it with the swebench harness "
            "(`python -m swebench.harness.prepare_images`), or set the task set's `namespace` to pull the published one"
        )
    else:
        how = (
            f"build it (`patchgym sandbox build-base --tag {image}` makes a Debian base offline) "
            f"or pull it with `docker pull {image}`"
        )
    return f"image {image!r} is not available locally: {how}"


@dataclass
class _Stream:
    """The raw socket of a running exec, so another thread can abort the read."""

    sock: Any = None
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        raw = getattr(self.sock, "_sock", self.sock)
        with contextlib.suppress(Exception):
            raw.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True)
class _Shape:
    """What makes two containers interchangeable in the warm pool."""

    image: str
    workdir: str
    cpus: float | None
    memory_mb: int | None
    pids: int | None
    network: bool
    env: tuple[tuple[str, str], ...]
    workspace: str | None
    """Staged into the container before it is handed out, so warm containers are ready to use."""
    user: str | None = None

    @classmethod
    def of(cls, spec: SandboxSpec, image: str) -> _Shape:
        env = tuple(sorted(spec.env.items()))
        workspace = str(Path(spec.workspace).resolve()) if spec.workspace else None
        return cls(image, spec.workdir, spec.cpus, spec.memory_mb, spec.pids, spec.network, env, workspace, spec.user)


@dataclass
class _Pool:
    ready: list[Container] = field(default_factory=list)
    filling: int = 0


class DockerSandbox(Sandbox):
    """One container; see the module docstring."""

    def __init__(self, backend: DockerSandboxBackend, container: Container, spec: SandboxSpec) -> None:
        self._backend = backend
        self.container = container
        self.workdir = spec.workdir
        self._closed = False
        self.channel = backend.channel_for(container) if backend.exec_channel else None
        if self.channel is None:
            backend.exec_paths["exec"] += 1

    async def _attributed(self, operation: Awaitable[T]) -> T:
        """`operation`, a lost container told apart: one that exited by itself (its processes
        stopped it, or the kernel OOM-killed them) while this sandbox was open is lost from inside."""
        try:
            return await operation
        except SandboxLostError as exc:
            if exc.from_inside or self._closed:
                raise
            try:
                state = (await self._backend.run_sync(self._backend.client.api.inspect_container, self.container.id))[
                    "State"
                ]
            except (InfraError, *_DOCKER_FAULTS):
                raise exc from None  # gone (removed on the host) or the engine is unreachable: not the agent
            if state.get("Running"):
                raise
            why = f"exit code {state.get('ExitCode')}" + (", OOM-killed" if state.get("OOMKilled") else "")
            raise SandboxLostError(
                f"{exc}; the container exited by itself ({why}): its own processes ended it",
                retryable=False,
                from_inside=True,
            ) from exc

    async def exec(
        self,
        cmd: str,
        *,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        command = self._exec(cmd, timeout_s, cwd, env, max_output_bytes)
        if self._backend.storage_opt_quota:  # the engine enforces the quota
            return await self._attributed(command)
        return await self._attributed(self._backend.quota.run(command, self._disk_used))

    async def _disk_used(self) -> int:
        return await self._backend.run_sync(self._backend.disk_used, self.container.id)

    async def _exec(
        self, cmd: str, timeout_s: float, cwd: str | None, env: Mapping[str, str] | None, max_output_bytes: int
    ) -> ExecResult:
        self._check_open()
        workdir = posixpath.normpath(posixpath.join(self.workdir, cwd or "."))
        if self.channel is not None:
            result = await self.channel.exec(
                cmd, timeout_s=timeout_s, workdir=workdir, env=env or {}, limit=max_output_bytes
            )
            if result is not None:
                return result
        token = secrets.token_hex(8)
        grace = self._backend.kill_grace_s
        argv = group_argv(cmd, timeout_s, grace, token)
        stream = _Stream()
        started = time.perf_counter()
        run = self._backend.run_sync(self._run_exec, argv, workdir, dict(env or {}), max_output_bytes, stream)
        try:
            code, stdout, stderr = await asyncio.wait_for(asyncio.shield(run), timeout_s + 2 * grace + 5)
            client_timeout = False
        except (TimeoutError, asyncio.CancelledError) as exc:
            await self._kill_exec(token)
            stream.abort()
            if isinstance(exc, asyncio.CancelledError):
                raise
            code, stdout, stderr = await run
            client_timeout = True
        duration = time.perf_counter() - started
        timed_out = client_timeout or (code in (124, 137) and duration >= timeout_s)
        return ExecResult(
            exit_code=None if timed_out else code,
            stdout=stdout.text(),
            stderr=stderr.text(),
            timed_out=timed_out,
            truncated=stdout.truncated or stderr.truncated,
            duration_s=duration,
        )

    def _run_exec(
        self, argv: list[str], workdir: str, env: dict[str, str], limit: int, stream: _Stream
    ) -> tuple[int | None, CappedBuffer, CappedBuffer]:
        api = self._backend.client.api
        stdout, stderr = CappedBuffer(limit), CappedBuffer(limit)
        try:
            exec_id = api.exec_create(self.container.id, argv, environment=env, workdir=workdir)["Id"]
            stream.sock = api.exec_start(exec_id, socket=True)
            try:
                for kind, data in frames_iter(stream.sock, tty=False):
                    (stderr if kind == 2 else stdout).write(data)
            except OSError:
                if not stream.aborted:
                    raise
            finally:
                stream.sock.close()
            return api.exec_inspect(exec_id)["ExitCode"], stdout, stderr
        except _DOCKER_FAULTS as exc:
            raise _translate(exc, "exec failed") from exc

    async def _kill_exec(self, token: str) -> None:
        kill = kill_group_command(token)
        with contextlib.suppress(InfraError):
            await self._backend.run_sync(self._simple_exec, kill)

    def _simple_exec(self, cmd: str) -> int:
        try:
            return self.container.exec_run(["sh", "-c", cmd]).exit_code
        except _DOCKER_FAULTS as exc:
            raise _translate(exc, "exec failed") from exc

    async def read_file(self, path: str) -> bytes:
        return await self._attributed(self._read_file(path))

    async def _read_file(self, path: str) -> bytes:
        self._check_open()
        target = self._path(path)
        for _ in range(8):  # follow symbolic links, each hop confined like the path itself
            member, data = await self._backend.run_sync(self._get_member, target)
            if not member.issym():
                return data
            link = posixpath.join(posixpath.dirname(target), member.linkname)
            target = self._path(link)
        raise OSError(f"too many levels of symbolic links: {path!r}")

    def _get_member(self, target: str) -> tuple[tarfile.TarInfo, bytes]:
        try:
            chunks, _ = self.container.get_archive(target)
            archive = io.BytesIO(b"".join(chunks))
        except docker.errors.NotFound as exc:
            if "No such container" in str(exc.explanation):
                raise SandboxLostError(f"read failed: the container is gone ({exc.explanation})") from exc
            raise FileNotFoundError(f"no such file in the sandbox: {target}") from exc
        except _DOCKER_FAULTS as exc:
            raise _translate(exc, "read failed") from exc
        with tarfile.open(fileobj=archive) as tar:
            member = tar.next()
            if member is None:
                raise FileNotFoundError(f"no such file in the sandbox: {target}")
            if member.isdir():
                raise IsADirectoryError(f"{target} is a directory in the sandbox")
            extracted = tar.extractfile(member) if member.isfile() else None
            return member, extracted.read() if extracted else b""

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        await self.write_files({path: data.encode() if isinstance(data, str) else data})

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        self._check_open()
        archive = await self._backend.run_sync(_tar_files, {self._path(path): data for path, data in files.items()})
        with archive:
            await self._attributed(self._backend.run_sync(_put_archive, self.container, "/", archive))

    async def upload_dir(self, local_dir: Path, path: str) -> None:
        self._check_open()
        archive = await self._backend.run_sync(_tar_dir, Path(local_dir), self._path(path))
        with archive:
            await self._backend.run_sync(_put_archive, self.container, "/", archive)

    async def download_dir(self, path: str, local_dir: Path) -> None:
        self._check_open()
        await self._attributed(self._backend.run_sync(self._extract_to, self._path(path), Path(local_dir)))

    def _extract_to(self, target: str, local_dir: Path) -> None:
        try:
            chunks, _ = self.container.get_archive(target.rstrip("/") + "/.")
        except docker.errors.NotFound as exc:
            raise FileNotFoundError(f"no such directory in the sandbox: {target}") from exc
        except _DOCKER_FAULTS as exc:
            raise _translate(exc, "download failed") from exc
        with tempfile.TemporaryFile() as spool:
            for chunk in chunks:
                spool.write(chunk)
            spool.seek(0)
            local_dir.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=spool) as tar:
                tar.extractall(local_dir, filter="data")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.channel is not None:
            await self.channel.close()
        await self._backend.remove(self.container)


class DockerSandboxBackend(SandboxBackend):
    """Sandboxes as Docker containers; see the module docstring.

    Settings: `concurrency` sizes the thread pool and the HTTP connection pool; `pool_size`
    started containers are kept ready per image, resource shape and workspace, refilled by at most
    `pool_refill_concurrency` creations at once; `network` names an existing Docker network
    for specs that allow network (create it once, with inter-container traffic off:
    `docker network create -o com.docker.network.bridge.enable_icc=false patchgym`).
    `exec_channel` runs commands over a per-sandbox exec channel when the image has a Python
    (its server must say hello within `channel_start_timeout_s`); `settings()["exec_paths"]`
    counts the sandboxes on each path.

    Args:
        concurrency: Docker API calls at once: the thread pool and the HTTP connection pool
        pool_size: started containers kept ready per image, resource shape and workspace (0: no warm pool)
        pool_refill_concurrency: container creations at once while the warm pool refills
        default_image: the image of a task that names none (patchgym sandbox build-base builds the default offline)
        network: an existing Docker network that specs allowing network join (null: such specs are refused network)
        base_url: the Docker engine's address (null: DOCKER_HOST or the local socket)
        api_timeout_s: seconds one Docker API call may take
        kill_grace_s: seconds between SIGTERM and SIGKILL when a command's time is up
        owner: the owner label of this backend's containers (default: user@host); reaping looks at it
        run_id: the run label of this backend's containers (default: a random id)
        reap_dead_owners: at start, remove the containers of this owner's processes that have died
        exec_channel: run commands over one long-lived exec channel per sandbox when the image has a Python
        channel_start_timeout_s: seconds the exec channel's server has to say hello before docker exec is used
    """

    name = "docker"

    def __init__(
        self,
        *,
        concurrency: int = 32,
        pool_size: int = 0,
        pool_refill_concurrency: int = 4,
        default_image: str = DEFAULT_IMAGE,
        network: str | None = None,
        base_url: str | None = None,
        api_timeout_s: float = 120.0,
        kill_grace_s: float = 1.0,
        owner: str | None = None,
        run_id: str | None = None,
        reap_dead_owners: bool = True,
        exec_channel: bool = True,
        channel_start_timeout_s: float = 60.0,
        disk_quota_mb: int | None = 10_240,
        disk_check_interval_s: float = 1.0,
    ) -> None:
        if concurrency < 1 or pool_size < 0 or pool_refill_concurrency < 1:
            raise ConfigError("docker backend: concurrency and pool_refill_concurrency must be >= 1, pool_size >= 0")
        self.concurrency = concurrency
        self.pool_size = pool_size
        self.pool_refill_concurrency = pool_refill_concurrency
        self.default_image = default_image
        self.network = network
        self.kill_grace_s = kill_grace_s
        self.owner = owner or owner_name()
        self.run_id = run_id or secrets.token_hex(6)
        self._reap_dead_owners = reap_dead_owners
        self.exec_channel = exec_channel
        self.channel_start_timeout_s = channel_start_timeout_s
        self.exec_paths: Counter[str] = Counter()
        self.quota = DiskQuota(disk_quota_mb * 2**20 if disk_quota_mb else None, disk_check_interval_s)
        self.storage_opt_quota: bool | None = None
        """Whether the engine enforces the quota itself (`--storage-opt size`); None until a container says."""
        try:
            kwargs: dict[str, Any] = {"max_pool_size": concurrency + pool_refill_concurrency, "timeout": api_timeout_s}
            self.client = docker.DockerClient(base_url=base_url, **kwargs) if base_url else docker.from_env(**kwargs)
        except docker.errors.DockerException as exc:
            raise SandboxStartError(
                f"cannot reach a Docker engine ({exc}); start dockerd or set DOCKER_HOST", retryable=False
            ) from exc
        self._executor = ThreadPoolExecutor(
            max_workers=concurrency + pool_refill_concurrency, thread_name_prefix="patchgym-docker"
        )
        self._pools: dict[_Shape, _Pool] = {}
        self._refill_gate = asyncio.Semaphore(pool_refill_concurrency)
        self._refills: set[asyncio.Task[None]] = set()
        self._builds: dict[str, asyncio.Future[str]] = {}
        self._started: asyncio.Future[None] | None = None
        self.reaped_at_start = 0

    def settings(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "threads": self.concurrency + self.pool_refill_concurrency,
            "http_pool_size": self.concurrency + self.pool_refill_concurrency,
            "pool_size": self.pool_size,
            "pool_refill_concurrency": self.pool_refill_concurrency,
            "default_image": self.default_image,
            "network": self.network,
            "kill_grace_s": self.kill_grace_s,
            "disk_quota_bytes": self.quota.quota_bytes,
            "disk_check_interval_s": self.quota.interval_s,
            "disk_quota_by": self._quota_by(),
            "owner": self.owner,
            "run_id": self.run_id,
            "enforces_resource_limits": True,
            "exec_channel": self.exec_channel,
            "channel_start_timeout_s": self.channel_start_timeout_s,
            "exec_paths": {"channel": 0, "exec": 0, **self.exec_paths},
        }

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking SDK call on the backend's thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _quota_by(self) -> str:
        if self.quota.quota_bytes is None:
            return "none"
        return {True: "storage-opt", False: "watch"}.get(self.storage_opt_quota, "storage-opt or watch")  # type: ignore[arg-type]

    def _quota_options(self) -> dict[str, Any]:
        """Container options of the disk quota: the engine's own (`storage_opt`, overlay on XFS
        with pquota) where it has one, else a file size limit (the watch does the rest)."""
        quota = self.quota.quota_bytes
        if quota is None:
            return {}
        if self.storage_opt_quota is not False:
            return {"storage_opt": {"size": f"{quota // 2**20}m"}}
        return {"ulimits": [docker.types.Ulimit(name="fsize", soft=quota, hard=quota)]}

    def disk_used(self, container_id: str) -> int:
        """Bytes in a container's writable layer, as the engine counts them (apparent sizes)."""
        try:
            found = self.client.api.containers(all=True, size=True, filters={"id": container_id})
        except _DOCKER_FAULTS as exc:
            raise _translate(exc, "measuring disk use failed") from exc
        return int(found[0].get("SizeRw") or 0) if found else 0

    def channel_for(self, container: Container) -> ExecChannel:
        """A new exec channel into `container` (one per sandbox: nothing is shared)."""
        return ExecChannel(
            self.client.api,
            container.id,
            lambda fn, *args: self.run_sync(_sdk_call, fn, *args),
            grace_s=self.kill_grace_s,
            start_timeout_s=self.channel_start_timeout_s,
            paths=self.exec_paths,
        )

    # -- lifecycle -----------------------------------------------------------------------
    async def _ensure_started(self) -> None:
        """Once per backend: reap containers left by this owner's dead processes."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._startup())
        await asyncio.shield(self._started)

    async def _startup(self) -> None:
        if self._reap_dead_owners:
            self.reaped_at_start = await self.run_sync(self._reap_dead)

    def _labels(self, spec_labels: Mapping[str, str] | None = None) -> dict[str, str]:
        return {
            **dict(spec_labels or {}),
            f"{LABEL}.managed": "true",
            f"{LABEL}.owner": self.owner,
            f"{LABEL}.owner_pid": str(os.getpid()),
            f"{LABEL}.run": self.run_id,
        }

    def _reap_dead(self) -> int:
        removed = 0
        for container in self._list({f"{LABEL}.owner": self.owner}):
            pid = int(container.labels.get(f"{LABEL}.owner_pid", "0") or 0)
            if pid and pid != os.getpid() and not _pid_alive(pid):
                self._remove_sync(container)
                removed += 1
        return removed

    def _list(self, labels: Mapping[str, str], attempts: int = 3) -> list[Container]:
        filters = [f"{LABEL}.managed=true", *(f"{k}={v}" for k, v in labels.items())]
        for attempt in range(attempts):
            try:
                return self.client.containers.list(all=True, filters={"label": filters})
            except docker.errors.NotFound:
                # the SDK inspects each listed container: one removed meanwhile (by another
                # process) is not a fault, so list again
                if attempt == attempts - 1:
                    raise SandboxLostError("listing containers failed: containers kept vanishing") from None
            except _DOCKER_FAULTS as exc:
                raise _translate(exc, "listing containers failed") from exc
        return []

    async def reap(self, labels: Mapping[str, str]) -> int:
        containers = await self.run_sync(self._list, labels)
        await asyncio.gather(*(self.run_sync(self._remove_sync, c) for c in containers))
        return len(containers)

    def _remove_sync(self, container: Container) -> None:
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                raise _translate(exc, "removing a container failed") from exc

    async def remove(self, container: Container) -> None:
        await self.run_sync(self._remove_sync, container)

    async def aclose(self) -> None:
        # let refills finish (a cancelled one would still create its container in its thread)
        await asyncio.gather(*self._refills, return_exceptions=True)
        pooled = [c for pool in self._pools.values() for c in pool.ready]
        self._pools.clear()
        await asyncio.gather(*(self.remove(c) for c in pooled), return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # -- images --------------------------------------------------------------------------
    async def image_for(self, spec: SandboxSpec) -> str:
        """The image a spec runs: built from its Dockerfile (cached by content), or named."""
        if spec.dockerfile is None:
            return spec.image or self.default_image
        dockerfile = Path(spec.dockerfile)
        digest = await self.run_sync(_context_digest, dockerfile)
        tag = f"patchgym/build:{digest[:16]}"
        if tag not in self._builds:
            self._builds[tag] = asyncio.ensure_future(self.run_sync(self._build, dockerfile, tag))
        try:
            return await asyncio.shield(self._builds[tag])
        except BaseException:
            self._builds.pop(tag, None)
            raise

    def _build(self, dockerfile: Path, tag: str) -> str:
        try:
            self.client.images.get(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        try:
            self.client.images.build(
                path=str(dockerfile.parent),
                dockerfile=dockerfile.name,
                tag=tag,
                network_mode="none",
                rm=True,
                forcerm=True,  # no intermediate containers left behind by a failed build
                labels={f"{LABEL}.managed": "true"},
            )
        except docker.errors.BuildError as exc:
            log = "".join(str(line.get("stream", line.get("error", ""))) for line in exc.build_log)[-2000:]
            raise BuildError(f"building {dockerfile} failed: {exc.msg}\n{log}") from exc
        except _DOCKER_FAULTS as exc:
            raise _translate(exc, f"building {dockerfile} failed") from exc
        return tag

    # -- sandboxes -----------------------------------------------------------------------
    def _run_container(self, shape: _Shape, labels: Mapping[str, str]) -> Container:
        if shape.network and not self.network:
            raise SandboxStartError(
                "this sandbox asks for network access but the docker backend has no `network` setting; "
                "create one shared network once and name it (see DockerSandboxBackend)",
                retryable=False,
            )
        limits: dict[str, Any] = {}
        if shape.cpus:
            limits["nano_cpus"] = int(shape.cpus * 1e9)
        if shape.memory_mb:
            limits["mem_limit"] = limits["memswap_limit"] = f"{shape.memory_mb}m"
        if shape.pids:
            limits["pids_limit"] = shape.pids
        network = {"network": self.network} if shape.network else {"network_mode": "none"}
        # an unprivileged user cannot change the interpreter, the system or other users' files;
        # its home is in /tmp, which it can write (an image's nobody has none)
        environment = {"HOME": "/tmp", **dict(shape.env)} if shape.user else dict(shape.env)
        try:  # create + start, not run: run would try to pull a missing image from a registry
            container = self._create(shape, labels, environment, {**network, **limits})
        except docker.errors.ImageNotFound as exc:
            raise BuildError(missing_image_hint(shape.image)) from exc
        except _DOCKER_FAULTS as exc:
            raise SandboxStartError(f"cannot create a container from {shape.image!r}: {exc}") from exc
        try:
            container.start()
        except _DOCKER_FAULTS as exc:
            self._remove_sync(container)
            raise SandboxStartError(f"cannot start a container from {shape.image!r}: {exc}") from exc
        return container

    def _create(
        self, shape: _Shape, labels: Mapping[str, str], environment: dict[str, str], options: dict[str, Any]
    ) -> Container:
        def create() -> Container:
            return self.client.containers.create(
                shape.image,
                ["sleep", "infinity"],
                init=True,
                labels=dict(labels),
                working_dir=shape.workdir,
                environment=environment,
                user=shape.user or "",
                **options,
                **self._quota_options(),
            )

        try:
            container = create()
        except docker.errors.APIError as exc:
            if "storage-opt" not in str(exc.explanation or exc) or self.storage_opt_quota:
                raise
            self.storage_opt_quota = False  # this storage driver has no quota: watch instead
            return create()
        if self.quota.quota_bytes is not None and self.storage_opt_quota is None:
            self.storage_opt_quota = True
        return container

    def _provision(self, shape: _Shape, labels: Mapping[str, str]) -> Container:
        """A started container with the workspace staged at its workdir (owned by the spec's user)."""
        container = self._run_container(shape, labels)
        try:
            if shape.workspace is not None:
                with _tar_dir(Path(shape.workspace), shape.workdir) as archive:
                    _put_archive(container, "/", archive)
            if shape.user:
                owned = container.exec_run(["chown", "-R", shape.user, shape.workdir], user="root")
                if owned.exit_code != 0:
                    raise OSError(f"chown of {shape.workdir} to {shape.user} failed: {owned.output[-500:]!r}")
        except (InfraError, OSError, *_DOCKER_FAULTS) as exc:
            self._remove_sync(container)
            raise SandboxStartError(f"cannot prepare {shape.workdir} in a container of {shape.image!r}: {exc}") from exc
        return container

    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        await self._ensure_started()
        if spec.workspace is not None and not Path(spec.workspace).is_dir():
            raise SandboxStartError(f"workspace {str(spec.workspace)!r} does not exist or is not a directory")
        shape = _Shape.of(spec, await self.image_for(spec))
        container = self._take_warm(shape) or await self.run_sync(self._provision, shape, self._labels(spec.labels))
        self._refill(shape)
        return DockerSandbox(self, container, spec)

    # -- warm pool -----------------------------------------------------------------------
    def _take_warm(self, shape: _Shape) -> Container | None:
        pool = self._pools.get(shape)
        return pool.ready.pop() if pool and pool.ready else None

    def _refill(self, shape: _Shape) -> None:
        pool = self._pools.setdefault(shape, _Pool())
        missing = self.pool_size - len(pool.ready) - pool.filling
        for _ in range(max(missing, 0)):
            pool.filling += 1
            task = asyncio.ensure_future(self._add_warm(shape, pool))
            self._refills.add(task)
            task.add_done_callback(self._refills.discard)

    async def _add_warm(self, shape: _Shape, pool: _Pool) -> None:
        try:
            async with self._refill_gate:
                container = await self.run_sync(self._provision, shape, self._labels({f"{LABEL}.pooled": "true"}))
            pool.ready.append(container)
        except InfraError:
            pass  # the pool is an optimisation: a cold start will surface the error to its caller
        finally:
            pool.filling -= 1

    async def prewarm(self, spec: SandboxSpec) -> int:
        """Fill the warm pool for `spec`'s image and shape; returns how many are ready."""
        await self._ensure_started()
        shape = _Shape.of(spec, await self.image_for(spec))
        self._refill(shape)
        await asyncio.gather(*list(self._refills), return_exceptions=True)
        return len(self._pools[shape].ready)


def _context_digest(dockerfile: Path) -> str:
    """Content hash of a Dockerfile's build context (names and bytes of every file)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in dockerfile.parent.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(dockerfile.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(dockerfile.name.encode())
    return digest.hexdigest()
