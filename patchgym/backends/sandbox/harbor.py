"""Harbor sandbox backend: any Harbor environment provider as a patchgym sandbox.

Harbor (`harbor` on PyPI, Python >= 3.12) drives many providers (docker, daytona, modal,
runloop, e2b, ...) through one interface, `harbor.environments.base.BaseEnvironment`
(start / exec / upload / download / stop). This backend builds a Harbor environment per
sandbox from the spec (an `environment/` directory holding the spec's Dockerfile, or one
`FROM` the spec's image, and an `EnvironmentConfig` with its resources, env, workdir and network
policy) and adapts it. The provider is a setting: `environment` (a Harbor environment type) or
`import_path` (`"module:Class"` of any `BaseEnvironment`).

Harbor's `exec` buffers a command's whole output, so the command is wrapped in the sandbox:
`timeout -k` in its own process group (killed with all its children when it ends, times out or
is cancelled), and each stream captured there as its first and last bytes and a byte count,
so at most `max_output_bytes` per stream ever leave the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import posixpath
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from patchgym.core.errors import ConfigError, InfraError, SandboxStartError, TransportError
from patchgym.core.sandbox import (
    DEFAULT_MAX_OUTPUT_BYTES,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
)

if sys.version_info < (3, 12):  # pragma: no cover - exercised on 3.11 by the plugin factory
    raise ImportError(
        f"the harbor sandbox backend needs Python >= 3.12 (Harbor does); this is Python "
        f"{sys.version_info.major}.{sys.version_info.minor}"
    )

from harbor.environments.base import BaseEnvironment  # noqa: E402
from harbor.environments.factory import EnvironmentFactory  # noqa: E402
from harbor.models.environment_type import EnvironmentType  # noqa: E402
from harbor.models.task.config import EnvironmentConfig, NetworkMode  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "patchgym/base:latest"
_EXEC_DIR = "/tmp/.patchgym-exec"

# $1 command, $2 timeout, $3 kill grace, $4 scratch dir, $5 head bytes, $6 tail bytes, $7 token.
# Each stream: the first $5 bytes (dd bs=1 reads no further), then the rest counted by dd and
# its last $6 bytes kept by tail. The last stderr line reports "token exit-code".
_WRAPPER = r"""
d=$4; H=$5; T=$6; mkdir -p "$d"
run() {
  timeout -k "$3" "$2" bash -c "$1" </dev/null & echo $! > "$d/pid"; wait $!; echo $? > "$d/rc"
  kill -9 -"$(cat "$d/pid")" 2>/dev/null
}
cap() { dd bs=1 count="$H" of="$d/$1.h" status=none; dd bs=65536 2> "$d/$1.s" | tail -c "$T" > "$d/$1.t"; }
emit() {
  rest=$(sed -n 's/^\([0-9][0-9]*\) bytes.*/\1/p' "$d/$1.s"); rest=${rest:-0}
  cat "$d/$1.h"
  if [ "$rest" -gt "$T" ]; then printf '\n[... %d bytes omitted ...]\n' $((rest - T)); fi
  cat "$d/$1.t"
}
{ run "$@" 2>&1 >&3 3>&- | cap e; } 3>&1 | cap o
emit o; emit e >&2
printf '\n%s %s\n' "$7" "$(cat "$d/rc")" >&2
rm -rf "$d"
"""


def _infra(exc: BaseException, what: str) -> InfraError:
    """Harbor raises plain exceptions (RuntimeError on a provider timeout or failure)."""
    if isinstance(exc, InfraError):
        return exc
    return TransportError(f"{what}: the Harbor environment failed: {type(exc).__name__}: {exc}")


class HarborSandbox(Sandbox):
    """One Harbor environment; see the module docstring."""

    def __init__(self, backend: HarborSandboxBackend, env: BaseEnvironment, spec: SandboxSpec, trial_dir: Path):
        self._backend = backend
        self.environment = env
        self.workdir = spec.workdir
        self.labels = dict(spec.labels)
        self._trial_dir = trial_dir
        self._closed = False

    async def _exec_raw(self, script: str, cwd: str, env: dict[str, str] | None, timeout_s: float) -> Any:
        try:
            return await self.environment.exec(script, cwd=cwd, env=env or None, timeout_sec=math.ceil(timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _infra(exc, "exec failed") from exc

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
        scratch = f"{_EXEC_DIR}/{token}"
        head = max_output_bytes // 2
        args = [cmd, f"{max(timeout_s, 0.001):.3f}", f"{grace:g}", scratch, str(head), str(max_output_bytes - head)]
        script = shlex.join(["bash", "-c", _WRAPPER, "patchgym", *args, token])
        workdir = posixpath.normpath(posixpath.join(self.workdir, cwd or "."))
        started = time.perf_counter()
        run = asyncio.ensure_future(
            self._exec_raw(script, workdir, dict(env or {}), timeout_s + 2 * grace + self._backend.exec_margin_s)
        )
        try:
            raw = await asyncio.shield(run)
        except asyncio.CancelledError:
            run.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, not raised
            await asyncio.shield(self._kill_group(scratch))
            raise
        duration = time.perf_counter() - started
        stderr, _, trailer = (raw.stderr or "").rstrip("\n").rpartition("\n")
        parts = trailer.split()
        if len(parts) != 2 or parts[0] != token:
            raise TransportError(f"exec failed: the Harbor environment lost the command's status ({trailer[-200:]!r})")
        code = int(parts[1])
        stdout = raw.stdout or ""
        timed_out = code in (124, 137) and duration >= timeout_s
        marker = "bytes omitted ...]"
        return ExecResult(
            exit_code=None if timed_out else code,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            truncated=marker in stdout or marker in stderr,
            duration_s=duration,
        )

    async def _kill_group(self, scratch: str) -> None:
        kill = f"kill -9 -$(cat {scratch}/pid) 2>/dev/null; rm -rf {scratch}"
        with contextlib.suppress(Exception):
            await self.environment.exec(kill, timeout_sec=math.ceil(self._backend.exec_margin_s))

    async def _must(self, cmd: str, what: str) -> None:
        result = await self.exec(cmd, timeout_s=self._backend.transfer_timeout_s)
        if not result.ok:
            raise TransportError(f"{what} failed in the Harbor environment: {result.output.strip()[-500:]}")

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        target = self._path(path)
        resolved = await self.exec(f"readlink -f {shlex.quote(target)}", timeout_s=60)
        if resolved.ok:  # symbolic links may not lead out of the sandbox's areas
            self._path(resolved.stdout.strip())
        with tempfile.TemporaryDirectory() as local:
            copy = Path(local) / "file"
            try:
                await self.environment.download_file(target, copy)
            except Exception as exc:
                if not (await self.exec(f"test -f {shlex.quote(target)}", timeout_s=60)).ok:
                    raise FileNotFoundError(f"no such file in the sandbox: {target}") from exc
                raise _infra(exc, "read failed") from exc
            if not copy.is_file():
                raise FileNotFoundError(f"no such file in the sandbox: {target}")
            return await asyncio.to_thread(copy.read_bytes)

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        target = self._path(path)
        with tempfile.TemporaryDirectory() as local:
            copy = Path(local) / "file"
            await asyncio.to_thread(copy.write_bytes, data.encode() if isinstance(data, str) else data)
            await self._must(f"mkdir -p {shlex.quote(posixpath.dirname(target))}", "mkdir")
            try:
                await self.environment.upload_file(copy, target)
            except Exception as exc:
                raise _infra(exc, "write failed") from exc

    async def upload_dir(self, local_dir: Path, path: str) -> None:
        self._check_open()
        target = self._path(path)
        await self._must(f"mkdir -p {shlex.quote(target)}", "mkdir")
        try:
            await self.environment.upload_dir(Path(local_dir), target)
        except Exception as exc:
            raise _infra(exc, "upload failed") from exc

    async def download_dir(self, path: str, local_dir: Path) -> None:
        self._check_open()
        try:
            await self.environment.download_dir(self._path(path), Path(local_dir))
        except Exception as exc:
            raise _infra(exc, "download failed") from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._backend.forget(self)
        try:
            await self.environment.stop(delete=True)
        except Exception as exc:  # a failed stop is logged: the agent did nothing wrong
            log.warning("stopping Harbor environment %s failed: %s", self.environment.session_id, exc)
        await asyncio.to_thread(shutil.rmtree, self._trial_dir, True)


class HarborSandboxBackend(SandboxBackend):
    """Sandboxes as Harbor environments; see the module docstring.

    Settings: `environment` names a Harbor environment type (docker, daytona, modal, e2b, ...)
    or `import_path` gives a `"module:Class"` BaseEnvironment; `environment_options` are passed
    to its constructor; `start_concurrency` bounds environments starting at once; `force_build`
    rebuilds images; `work_dir` holds each sandbox's Harbor trial directory. Harbor has no
    labels, so `reap` stops this process's own open sandboxes whose labels match.
    """

    name = "harbor"

    def __init__(
        self,
        *,
        environment: str = "docker",
        import_path: str | None = None,
        environment_options: Mapping[str, Any] | None = None,
        default_image: str = DEFAULT_IMAGE,
        start_concurrency: int = 8,
        force_build: bool = False,
        work_dir: str | Path | None = None,
        kill_grace_s: float = 1.0,
        exec_margin_s: float = 30.0,
        transfer_timeout_s: float = 600.0,
    ) -> None:
        if start_concurrency < 1:
            raise ConfigError("harbor backend: start_concurrency must be >= 1")
        if import_path is None and environment not in {t.value for t in EnvironmentType}:
            known = ", ".join(sorted(t.value for t in EnvironmentType))
            raise ConfigError(f"unknown Harbor environment {environment!r}; known: {known} (or give import_path)")
        try:
            self.environment_class = EnvironmentFactory.get_environment_class(
                None if import_path else EnvironmentType(environment), import_path
            )
        except Exception as exc:
            raise ConfigError(f"cannot load the Harbor environment {import_path or environment!r}: {exc}") from exc
        self.environment = environment
        self.import_path = import_path
        self.environment_options = dict(environment_options or {})
        self.default_image = default_image
        self.start_concurrency = start_concurrency
        self.force_build = force_build
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.gettempdir())
        self.kill_grace_s = kill_grace_s
        self.exec_margin_s = exec_margin_s
        self.transfer_timeout_s = transfer_timeout_s
        self._starting = asyncio.Semaphore(start_concurrency)
        self._open: set[HarborSandbox] = set()

    def settings(self) -> dict[str, Any]:
        return {
            "environment": self.import_path or self.environment,
            "environment_options": sorted(self.environment_options),
            "default_image": self.default_image,
            "start_concurrency": self.start_concurrency,
            "force_build": self.force_build,
            "work_dir": str(self.work_dir),
            "kill_grace_s": self.kill_grace_s,
            "exec_margin_s": self.exec_margin_s,
            "transfer_timeout_s": self.transfer_timeout_s,
        }

    def forget(self, sandbox: HarborSandbox) -> None:
        self._open.discard(sandbox)

    def _environment_dir(self, spec: SandboxSpec, trial_dir: Path) -> Path:
        env_dir = trial_dir / "environment"
        if spec.dockerfile is not None:
            dockerfile = Path(spec.dockerfile)
            if not dockerfile.is_file():
                raise SandboxStartError(f"Dockerfile {str(dockerfile)!r} does not exist", retryable=False)
            shutil.copytree(dockerfile.parent, env_dir)
            if dockerfile.name != "Dockerfile":
                shutil.copy(dockerfile, env_dir / "Dockerfile")
        else:
            env_dir.mkdir()
            (env_dir / "Dockerfile").write_text(f"FROM {spec.image or self.default_image}\n")
        return env_dir

    async def create(self, spec: SandboxSpec) -> HarborSandbox:
        if spec.workspace is not None and not Path(spec.workspace).is_dir():
            raise SandboxStartError(f"workspace {str(spec.workspace)!r} does not exist or is not a directory")
        trial_dir = Path(tempfile.mkdtemp(prefix="patchgym-harbor-", dir=self.work_dir))
        try:
            env_dir = await asyncio.to_thread(self._environment_dir, spec, trial_dir)
            paths = TrialPaths(trial_dir / "trial")
            paths.trial_dir.mkdir()
            config = EnvironmentConfig(
                docker_image=spec.image,
                cpus=spec.cpus,
                memory_mb=spec.memory_mb,
                env=dict(spec.env),
                workdir=spec.workdir,
                network_mode=NetworkMode.PUBLIC if spec.network else NetworkMode.NO_NETWORK,
            )
            env = self.environment_class(
                environment_dir=env_dir,
                environment_name=trial_dir.name,
                session_id=f"{trial_dir.name}__env",
                trial_paths=paths,
                task_env_config=config,
                logger=log,
                **self.environment_options,
            )
        except InfraError:
            shutil.rmtree(trial_dir, ignore_errors=True)
            raise
        except Exception as exc:
            shutil.rmtree(trial_dir, ignore_errors=True)
            raise SandboxStartError(f"cannot set up the Harbor environment: {exc}", retryable=False) from exc
        sandbox = HarborSandbox(self, env, spec, trial_dir)
        try:
            async with self._starting:
                await env.start(force_build=self.force_build)
            self._open.add(sandbox)
            if spec.workspace is not None:
                await sandbox.upload_dir(Path(spec.workspace), spec.workdir)
            else:
                await sandbox._must(f"mkdir -p {shlex.quote(spec.workdir)}", "mkdir")
        except BaseException as exc:
            await sandbox.close()
            if isinstance(exc, InfraError | asyncio.CancelledError):
                raise
            raise SandboxStartError(f"the Harbor environment did not start: {exc}") from exc
        return sandbox

    async def reap(self, labels: Mapping[str, str]) -> int:
        doomed = [s for s in self._open if all(s.labels.get(k) == v for k, v in labels.items())]
        for sandbox in doomed:
            await sandbox.close()
        return len(doomed)
