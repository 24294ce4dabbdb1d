"""The sandbox contract: where an agent's commands run.

A `SandboxBackend` creates `Sandbox`es from a `SandboxSpec`. A command that fails or times
out is data (`ExecResult`), never an exception; every fault of the infrastructure raises an
`InfraError` subclass (see `patchgym.core.errors`).
"""

from __future__ import annotations

import abc
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Self

from patchgym.core.errors import SandboxLostError

DEFAULT_MAX_OUTPUT_BYTES = 1_000_000
"""Default cap on captured stdout and on captured stderr of one command, each."""


def _frozen(mapping: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class SandboxSpec:
    """How to build one sandbox.

    `workspace` is a local directory copied into the sandbox at `workdir`; `image` (or
    `dockerfile`) names a container image for backends that run images. Resource limits are
    applied by backends that can enforce them; `network=False` means no network at all.
    `user` is who commands run as in container backends (`uid:gid` or a name; the workdir is
    made theirs); None keeps the image's user.
    """

    workspace: Path | None = None
    image: str | None = None
    dockerfile: Path | None = None
    workdir: str = "/workspace"
    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = None
    network: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    lease_s: float | None = None
    user: str | None = None

    def __post_init__(self) -> None:
        if not self.workdir.startswith("/"):
            raise ValueError(f"SandboxSpec.workdir must be an absolute path, got {self.workdir!r}")
        object.__setattr__(self, "env", _frozen(self.env))
        object.__setattr__(self, "labels", _frozen(self.labels))


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command: `exit_code` is None when it was killed by the timeout."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def output(self) -> str:
        """stdout followed by stderr, as an agent would see them in a terminal."""
        if self.stdout and self.stderr and not self.stdout.endswith("\n"):
            return f"{self.stdout}\n{self.stderr}"
        return self.stdout + self.stderr


class SandboxPathError(ValueError):
    """A file path given to a sandbox lies outside the area it exposes."""


def confine_path(path: str, workdir: str, roots: Sequence[str]) -> tuple[str, str]:
    """Split `path` (absolute, or relative to `workdir`) into (the root it lies under, the rest).

    Raises `SandboxPathError` if it lies under none of `roots`; `..` cannot climb out.
    """
    view = posixpath.normpath(path if path.startswith("/") else posixpath.join(workdir, path))
    for root in roots:
        if view == root or view.startswith(root.rstrip("/") + "/"):
            return root, posixpath.relpath(view, root)
    raise SandboxPathError(f"{path!r} is outside this sandbox: file operations are limited to {', '.join(roots)}")


class Sandbox(abc.ABC):
    """A running, isolated copy of a task's environment.

    Relative paths are relative to `workdir`. `close()` is idempotent; using a closed
    sandbox raises `SandboxLostError`.
    """

    workdir: str
    _closed: bool = False

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxLostError("this sandbox is closed; create a new one")

    def _path(self, path: str) -> str:
        """`path` made absolute; it must lie under the workdir or /tmp (what remote sandboxes expose)."""
        root, relative = confine_path(path, self.workdir, (self.workdir, "/tmp"))
        return posixpath.normpath(posixpath.join(root, relative))

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str,
        *,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        """Run `cmd` with bash; on timeout kill its whole process tree."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """The bytes of a file; `FileNotFoundError` if it does not exist."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace a file, creating parent directories."""

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        """Write many files (path to bytes) as `write_file` would; backends with a costly round trip
        per file (Docker) write them in one."""
        for path, data in files.items():
            await self.write_file(path, data)

    @abc.abstractmethod
    async def upload_dir(self, local_dir: Path, path: str) -> None:
        """Copy a local directory's contents into the sandbox at `path`."""

    @abc.abstractmethod
    async def download_dir(self, path: str, local_dir: Path) -> None:
        """Copy a sandbox directory's contents to `local_dir`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the sandbox and free everything it holds. Safe to call twice."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class SandboxBackend(abc.ABC):
    """Creates sandboxes of one provider (local processes, Docker, E2B, ...)."""

    name: str

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox; raise `SandboxStartError` (or another InfraError) if it cannot."""

    @abc.abstractmethod
    async def reap(self, labels: Mapping[str, str]) -> int:
        """Remove leaked sandboxes whose labels include all of `labels`; return how many."""

    def settings(self) -> dict[str, object]:
        """The backend's limits and options, reported in run metrics."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release backend-wide resources (thread pools, clients)."""
