"""E2B sandbox backend on the official `e2b` SDK (`AsyncSandbox`, fully async).

Each sandbox is an E2B microVM created from a template (`spec.image`; else the spec's Dockerfile
built into a template named by its content hash, once; else `default_template`)
with the spec's env and its labels as metadata, under a lease (the E2B sandbox timeout) that a
background task renews while the sandbox is open, so a crashed trainer's sandboxes expire on
their own. Commands go through `commands.run` wrapped in-sandbox with `timeout -k`, so the
timeout, the command's end or a cancelled call kills the whole process group inside the VM; a
non-zero exit is data. Output streams into capped buffers. Directories move as one tar file.

SDK exceptions become `InfraError`s (`translate_e2b_error`); creations are limited by
`create_concurrency` and retried with jittered exponential backoff on capacity errors.
`reap` kills every sandbox whose metadata carries the given labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import math
import posixpath
import random
import secrets
import shlex
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
from e2b import AsyncSandbox, AsyncTemplate, SandboxQuery
from e2b.exceptions import (
    AuthenticationException,
    BuildException,
    FileNotFoundException,
    InvalidArgumentException,
    NotEnoughSpaceException,
    RateLimitException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    ServiceBusyException,
    TemplateException,
)
from e2b.sandbox.commands.command_handle import CommandExitException

from patchgym.backends.sandbox.process_group import group_command, kill_group_command
from patchgym.core.errors import (
    BuildError,
    CapacityError,
    ConfigError,
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
log = logging.getLogger(__name__)

LABEL = "patchgym"
_DROPPED_STREAM = "Command ended without an end event"


def translate_e2b_error(exc: BaseException, what: str) -> Exception:
    """Map an E2B SDK error onto patchgym's errors (InfraError kinds, ConfigError, FileNotFoundError)."""
    if isinstance(exc, RateLimitException | ServiceBusyException):
        return CapacityError(f"{what}: E2B is out of capacity or rate-limited the request ({exc})")
    if isinstance(exc, AuthenticationException):
        return ConfigError(f"{what}: E2B rejected the credentials ({exc}); set E2B_API_KEY or the api_key setting")
    if isinstance(exc, BuildException | TemplateException):
        return BuildError(f"{what}: the E2B template cannot be used ({exc})")
    if isinstance(exc, FileNotFoundException):
        return FileNotFoundError(f"{what}: {exc}")
    if isinstance(exc, SandboxNotFoundException | SandboxNotRunningException):
        return SandboxLostError(f"{what}: the E2B sandbox is gone (killed or its lease expired): {exc}")
    if isinstance(exc, NotEnoughSpaceException):
        return SandboxLostError(f"{what}: the E2B sandbox is out of disk space: {exc}", retryable=True)
    if isinstance(exc, InvalidArgumentException):
        return ConfigError(f"{what}: E2B rejected an argument: {exc}")
    if isinstance(exc, SandboxException | httpx.HTTPError | OSError):
        return TransportError(f"{what}: the connection to E2B failed: {exc}")
    if type(exc) is Exception and _DROPPED_STREAM in str(exc):
        return TransportError(f"{what}: the command's stream dropped before it ended; its state is unknown")
    return TransportError(f"{what}: unexpected E2B SDK error {type(exc).__name__}: {exc}")


async def _call(what: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise translate_e2b_error(exc, what) from exc


def template_name(dockerfile: Path, cpus: int | None, memory_mb: int | None) -> str:
    """The E2B template name for a Dockerfile: a hash of it, its build context and its resources."""
    digest = hashlib.sha256(f"{cpus}/{memory_mb}\0".encode())
    context = dockerfile.parent
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(context).as_posix()}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return f"patchgym-{digest.hexdigest()[:24]}"


def _tar_dir(local_dir: Path) -> tempfile.SpooledTemporaryFile[bytes]:
    archive = tempfile.SpooledTemporaryFile(max_size=32 << 20)  # noqa: SIM115 - the caller closes it
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.add(str(local_dir), arcname=".")
    archive.seek(0)
    return archive


class E2BSandbox(Sandbox):
    """One E2B sandbox; see the module docstring."""

    def __init__(self, backend: E2BSandboxBackend, box: AsyncSandbox, spec: SandboxSpec, lease_s: float) -> None:
        self._backend = backend
        self.box = box
        self.sandbox_id: str = box.sandbox_id
        self.workdir = spec.workdir
        self._lease_s = lease_s
        self._closed = False
        renew = backend.lease_renew_s if backend.lease_renew_s is not None else lease_s / 3
        self._renewal = asyncio.create_task(self._renew_forever(renew)) if renew > 0 else None

    async def _renew_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.box.set_timeout(int(max(self._lease_s, 1)))
            except (SandboxNotFoundException, SandboxNotRunningException):
                log.warning("E2B sandbox %s is gone; lease renewal stops", self.sandbox_id)
                return
            except Exception as exc:  # a missed renewal is retried at the next tick
                log.warning("renewing the lease of E2B sandbox %s failed: %s", self.sandbox_id, exc)

    async def exec(
        self,
        cmd: str,
        *,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        self._check_open()
        grace = self._backend.kill_grace_s
        token = secrets.token_hex(8)
        stdout, stderr = CappedBuffer(max_output_bytes), CappedBuffer(max_output_bytes)
        started = time.perf_counter()
        try:
            handle = await _call(
                "exec failed",
                self.box.commands.run(
                    group_command(cmd, timeout_s, grace, token),
                    background=True,
                    envs=dict(env or {}),
                    cwd=posixpath.normpath(posixpath.join(self.workdir, cwd or ".")),
                    on_stdout=lambda text: stdout.write(text.encode()),
                    on_stderr=lambda text: stderr.write(text.encode()),
                    timeout=timeout_s + 2 * grace + self._backend.exec_margin_s,
                    retain_output=False,
                ),
            )
        except asyncio.CancelledError:
            await asyncio.shield(self._kill_group(token, None))
            raise
        client_timeout = False
        try:
            code: int | None = (await handle.wait()).exit_code
        except CommandExitException as exc:
            code = exc.exit_code
        except asyncio.CancelledError:
            await asyncio.shield(self._kill_group(token, handle))
            raise
        except Exception as exc:
            error = translate_e2b_error(exc, "exec failed")
            if not (isinstance(error, TransportError) and time.perf_counter() - started >= timeout_s):
                raise error from exc
            await self._kill_group(token, handle)  # the stream's own deadline passed: treat as our timeout
            code, client_timeout = None, True
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

    async def _kill_group(self, token: str, handle: Any) -> None:
        """Kill a command's process group through a second command, then drop its stream."""
        kill = kill_group_command(token)
        with contextlib.suppress(Exception):
            await self.box.commands.run(kill, timeout=self._backend.exec_margin_s + 5)
        if handle is None:
            return
        with contextlib.suppress(Exception):
            await handle.kill()
        with contextlib.suppress(Exception):
            await handle.disconnect()

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        target = self._path(path)
        for _ in range(8):  # follow symbolic links, each hop confined like the path itself
            info = await _call("read failed", self.box.files.get_info(target))
            if not info.symlink_target:
                return bytes(await _call("read failed", self.box.files.read(target, format="bytes")))
            target = self._path(posixpath.join(posixpath.dirname(target), info.symlink_target))
        raise OSError(f"too many levels of symbolic links: {path!r}")

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        payload = data.encode() if isinstance(data, str) else data
        await _call("write failed", self.box.files.write(self._path(path), payload, use_octet_stream=True))

    async def _must(self, cmd: str, what: str) -> None:
        result = await self.exec(cmd, timeout_s=self._backend.transfer_timeout_s)
        if not result.ok:
            raise TransportError(f"{what} failed in the E2B sandbox: {result.output.strip()[-500:]}")

    async def upload_dir(self, local_dir: Path, path: str) -> None:
        self._check_open()
        target = self._path(path)
        staged = f"/tmp/.patchgym-{secrets.token_hex(6)}.tar"
        with await asyncio.to_thread(_tar_dir, Path(local_dir)) as archive:
            await _call("upload failed", self.box.files.write(staged, archive, use_octet_stream=True))
        quoted = shlex.quote(target)
        await self._must(f"mkdir -p {quoted} && tar -xf {staged} -C {quoted}; rc=$?; rm -f {staged}; exit $rc", "untar")

    async def download_dir(self, path: str, local_dir: Path) -> None:
        self._check_open()
        staged = f"/tmp/.patchgym-{secrets.token_hex(6)}.tar"
        await self._must(f"tar -cf {staged} -C {shlex.quote(self._path(path))} .", "tar")
        try:
            data = await _call("download failed", self.box.files.read(staged, format="bytes"))
        finally:
            with contextlib.suppress(Exception):
                await self.box.files.remove(staged)

        def extract() -> None:
            Path(local_dir).mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
                tar.extractall(local_dir, filter="data")

        await asyncio.to_thread(extract)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._renewal is not None:
            self._renewal.cancel()
        try:
            await self.box.kill()
        except Exception as exc:  # the lease ends it anyway; a failed kill is not the agent's fault
            log.warning("killing E2B sandbox %s failed (its lease will end it): %s", self.sandbox_id, exc)


class E2BSandboxBackend(SandboxBackend):
    """Sandboxes as E2B microVMs; see the module docstring.

    Settings: `api_key`/`domain` (default: E2B_API_KEY / E2B_DOMAIN); `api_url`/`sandbox_url`
    point the SDK at an E2B-compatible server (self-hosted, or the test fake); `default_template`
    is used when a spec names no image; `lease_s` is the sandbox timeout, renewed every
    `lease_renew_s` (default a third of the lease; 0 turns renewal off). Every REST call is
    retried by the SDK itself up to `sdk_retries` times on 429/502/503/504, honouring the
    server's Retry-After; a capacity error that outlasts those becomes a `CapacityError`, and a
    creation is then tried again, up to `create_attempts` in all, after a backoff of
    `backoff_base_s * 2**n` (at most `backoff_max_s`) times a jitter in [0.5, 1.5).
    `create_concurrency` bounds creations in flight. A spec with a Dockerfile and no image runs
    the template `patchgym-<hash of Dockerfile, context and resources>`, built once (at most
    `build_concurrency` builds at a time) unless E2B already has it.

    Args:
        api_key: the E2B API key (default: E2B_API_KEY)
        domain: the E2B domain (default: E2B_DOMAIN, else e2b.app)
        api_url: the REST API's address of an E2B-compatible server (self-hosted, or the test fake)
        sandbox_url: the sandboxes' address of an E2B-compatible server
        http_version: the HTTP version the SDK speaks (null: the SDK's default)
        request_timeout_s: seconds one REST request may take
        sdk_retries: retries of a REST call on 429/502/503/504 by the SDK itself (honouring Retry-After)
        default_template: the template of a spec that names no image
        lease_s: the sandbox timeout E2B enforces; renewed while the sandbox is open
        lease_renew_s: seconds between lease renewals (null: a third of lease_s; 0: no renewal)
        create_concurrency: sandbox creations in flight
        create_attempts: tries of one creation when capacity errors outlast the SDK's retries
        build_concurrency: template builds at once (a spec with a Dockerfile and no image)
        backoff_base_s: first backoff between creation attempts; doubles each attempt, with jitter
        backoff_max_s: longest backoff between creation attempts
        kill_grace_s: seconds between SIGTERM and SIGKILL when a command's time is up
        exec_margin_s: seconds the SDK call waits beyond a command's own timeout and grace
        transfer_timeout_s: seconds a file transfer into or out of a sandbox may take
        run_id: the run label in the sandboxes' metadata (default: a random id)
    """

    name = "e2b"

    def __init__(
        self,
        *,
        api_key: str | None = None,
        domain: str | None = None,
        api_url: str | None = None,
        sandbox_url: str | None = None,
        http_version: str | None = None,
        request_timeout_s: float = 60.0,
        sdk_retries: int = 3,
        default_template: str = "base",
        lease_s: float = 900.0,
        lease_renew_s: float | None = None,
        create_concurrency: int = 16,
        create_attempts: int = 5,
        build_concurrency: int = 4,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        kill_grace_s: float = 1.0,
        exec_margin_s: float = 10.0,
        transfer_timeout_s: float = 600.0,
        run_id: str | None = None,
    ) -> None:
        if min(create_concurrency, create_attempts, build_concurrency) < 1 or sdk_retries < 0:
            raise ConfigError(
                "e2b backend: create_concurrency, create_attempts and build_concurrency must be >= 1, sdk_retries >= 0"
            )
        if lease_s < 1 or (lease_renew_s is not None and lease_renew_s < 0):
            raise ConfigError("e2b backend: lease_s must be >= 1 second and lease_renew_s >= 0")
        params = {
            "api_key": api_key,
            "domain": domain,
            "api_url": api_url,
            "sandbox_url": sandbox_url,
            "http_version": http_version,
            "request_timeout": request_timeout_s,
            "retries": sdk_retries,
        }
        self._api: dict[str, Any] = {key: value for key, value in params.items() if value is not None}
        self.default_template = default_template
        self.lease_s = lease_s
        self.lease_renew_s = lease_renew_s
        self.create_concurrency = create_concurrency
        self.create_attempts = create_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.kill_grace_s = kill_grace_s
        self.exec_margin_s = exec_margin_s
        self.transfer_timeout_s = transfer_timeout_s
        self.run_id = run_id or secrets.token_hex(6)
        self.build_concurrency = build_concurrency
        self._creating = asyncio.Semaphore(create_concurrency)
        self._building = asyncio.Semaphore(build_concurrency)
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._built: set[str] = set()
        self._random = random.Random()

    def settings(self) -> dict[str, Any]:
        shown = {key: value for key, value in self._api.items() if key != "api_key"}
        return {
            **shown,
            "default_template": self.default_template,
            "lease_s": self.lease_s,
            "lease_renew_s": self.lease_renew_s if self.lease_renew_s is not None else "lease_s/3",
            "create_concurrency": self.create_concurrency,
            "create_attempts": self.create_attempts,
            "build_concurrency": self.build_concurrency,
            "backoff_base_s": self.backoff_base_s,
            "backoff_max_s": self.backoff_max_s,
            "kill_grace_s": self.kill_grace_s,
            "exec_margin_s": self.exec_margin_s,
            "transfer_timeout_s": self.transfer_timeout_s,
            "run_id": self.run_id,
        }

    def backoff_s(self, attempt: int, error: CapacityError) -> float:
        """How long to wait before creation attempt `attempt + 1` after a capacity error."""
        if error.retry_after_s is not None:
            return error.retry_after_s
        return min(self.backoff_max_s, self.backoff_base_s * 2**attempt) * self._random.uniform(0.5, 1.5)

    async def create(self, spec: SandboxSpec) -> E2BSandbox:
        if spec.workspace is not None and not Path(spec.workspace).is_dir():
            raise SandboxStartError(f"workspace {str(spec.workspace)!r} does not exist or is not a directory")
        template = await self._template_for(spec)
        lease_s = spec.lease_s or self.lease_s
        metadata = {LABEL: "1", f"{LABEL}.run": self.run_id, **spec.labels}
        for attempt in range(self.create_attempts):
            try:
                async with self._creating:
                    box = await _call(
                        "creating an E2B sandbox failed",
                        AsyncSandbox.create(
                            template=template,
                            timeout=int(lease_s),
                            metadata=metadata,
                            envs=dict(spec.env),
                            allow_internet_access=spec.network,
                            **self._api,
                        ),
                    )
                break
            except CapacityError as exc:
                if attempt + 1 == self.create_attempts:
                    raise
                delay = self.backoff_s(attempt, exc)
                log.info("E2B capacity error (%s); retrying creation in %.1f s", exc, delay)
                await asyncio.sleep(delay)
        sandbox = E2BSandbox(self, box, spec, lease_s)
        try:
            workdir = shlex.quote(spec.workdir)
            make = f"mkdir -p {workdir} && {{ chown user: {workdir} 2>/dev/null || true; }}"
            await _call("creating the workdir failed", box.commands.run(make, user="root", timeout=60))
            if spec.workspace is not None:
                await sandbox.upload_dir(Path(spec.workspace), spec.workdir)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def _template_for(self, spec: SandboxSpec) -> str:
        """The template to start: the spec's image, else its Dockerfile built once (by content hash)."""
        if spec.image or spec.dockerfile is None:
            return spec.image or self.default_template
        dockerfile = Path(spec.dockerfile)
        if not dockerfile.is_file():
            raise BuildError(f"Dockerfile {str(dockerfile)!r} does not exist")
        cpus = math.ceil(spec.cpus) if spec.cpus else None
        name = await asyncio.to_thread(template_name, dockerfile, cpus, spec.memory_mb)
        async with self._build_locks.setdefault(name, asyncio.Lock()):
            if name in self._built:
                return name
            if not await _call("looking up an E2B template failed", AsyncTemplate.alias_exists(name, **self._api)):
                builder = AsyncTemplate(file_context_path=dockerfile.parent).from_dockerfile(str(dockerfile))
                log.info("building E2B template %s from %s", name, dockerfile)
                async with self._building:
                    build = AsyncTemplate.build(builder, name, cpu_count=cpus, memory_mb=spec.memory_mb, **self._api)
                    await _call(f"building E2B template {name} from {dockerfile} failed", build)
            self._built.add(name)
        return name

    async def reap(self, labels: Mapping[str, str]) -> int:
        query = SandboxQuery(metadata={LABEL: "1", **labels})
        paginator = AsyncSandbox.list(query=query, **self._api)
        killed = 0
        while paginator.has_next:
            for info in await _call("listing E2B sandboxes failed", paginator.next_items()):
                if await _call("killing an E2B sandbox failed", AsyncSandbox.kill(info.sandbox_id, **self._api)):
                    killed += 1
        return killed
