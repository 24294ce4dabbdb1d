"""Local sandbox backend: each sandbox is a private copy of the task's workspace on this host.

Commands run with `bash -c` (not a login shell: the sandbox's environment stays as given) in
their own process group; a timeout (or the end of the command) kills the whole group, and
output is capped while it streams. The command's exit is noticed when it happens (asyncio's
child watcher), not by polling. A command also dies when its `exec` is cancelled (even while it
starts) and when its sandbox or the backend is closed (its `exec` then raises `SandboxLostError`).

Isolation (setting `isolation`):
- `bwrap`: commands run under bubblewrap with a read-only view of the host, the workspace
  copy mounted read-write at the spec's `workdir`, a private `/tmp`, their own PID namespace
  (nothing outlives a command) and, unless the spec allows network, no network. They also die
  with the thread that started them (the kernel's parent-death signal), so that not even a
  SIGKILLed driver leaves one running: bwrap runs as PID 1 of a PID namespace of its own
  (util-linux `unshare`), so that whatever ends bwrap ends everything under it
  (`_PID_NAMESPACE_INIT` says why). Task data under a bound directory (an installed patchgym
  package with the `tiny` tasks' gold patches, the task's own folder, `hidden_paths`) is covered
  by an empty read-only tmpfs (`hidden`), for wheel and editable installs alike.
- `none`: commands run directly on the host as the current user, each under a subreaper
  (`reaper`) that kills every descendant when the command ends, setsid and double forks
  included. This is NOT a security boundary: a command can read and write anything the user
  can, and one that kills its subreaper can leave processes behind. Use it only for trusted code, or inside a
  container you treat as the boundary.
- `auto` (default): `bwrap`. Where bubblewrap cannot run, the backend refuses to start with an
  error naming the fix; it never falls back to `none` on its own: `none` must be written.
CPU, memory and PID limits in the spec are not enforced by this backend. A disk quota per sandbox
(`disk_quota_mb`) is: a command that takes the sandbox's folder over it is killed (`disk_quota`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

from patchgym.backends.sandbox.disk_quota import DiskQuota, disk_usage
from patchgym.backends.sandbox.hidden import hidden_host_paths, mask_args
from patchgym.core.errors import ConfigError, SandboxLostError, SandboxStartError
from patchgym.core.output import CappedBuffer
from patchgym.core.sandbox import (
    DEFAULT_MAX_OUTPUT_BYTES,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxPathError,
    SandboxSpec,
    confine_path,
)
from patchgym.process_groups import PARENT_CHECK, killed_with_parent

Isolation = Literal["auto", "none", "bwrap"]
T = TypeVar("T")

REAPER_SOURCE = Path(__file__).with_name("reaper.py").read_text()
"""The `none` subreaper's source, read once at import (a command rewriting the file changes nothing)."""
_ROOT_PREFIX = "patchgym-"
_LABELS_FILE = "labels.json"
_HIDDEN_FROM_BWRAP = {"proc", "dev", "sys", "tmp", "run", "var"}
"""Never bound: /var and /run hold other programs' mounts (Docker's among them), which can
change while bubblewrap binds them; sandboxes get an empty /var/tmp instead."""
BWRAP_HOST_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")
"""Top-level host directories a bwrap sandbox sees (read-only): the system, not the users' files.
Home directories, /srv, /mnt, /work and the like stay hidden, and with them every task's data
(gold patches, hidden tests, oracles) kept on this host."""


_PID_NAMESPACE_INIT = 'exec unshare --user --map-root-user --pid --fork --kill-child -- sh -c "$0" "$$" "$@"'
"""sh: run "$@" (bwrap) as PID 1 of new user and PID namespaces, SIGKILLed when `unshare` dies.

When PID 1 of a namespace dies, the kernel kills every process in it. bwrap's own
`--die-with-parent` arms its sandbox process only once that process is set up: if bwrap died
before (its driver SIGKILLed, or asyncio killing only the process it started when a start is
cancelled), the half-set-up sandbox process was left waiting forever, or ran its command with
no one to stop it (containers/bubblewrap#633). As PID 1 here, bwrap takes it down with it.
`unshare` itself dies with the driver (`killed_with_parent`). unshare's child arms its own
parent-death signal a few instructions after the fork (util-linux 2.38 does not check that its
parent still lives then), so a driver dying in between left that child to start bwrap with no
one to stop it; under load that window was hit. The child therefore runs `PARENT_CHECK` first
($0 is `$$`, the pid this shell keeps when it becomes `unshare`): the host's /proc, still
mounted there, shows its real parent, and a child whose `unshare` is gone runs nothing."""


def _bwrap_argv(options: list[str], command: list[str]) -> list[str]:
    """`command` under bwrap with `options` (see `_PID_NAMESPACE_INIT`); it runs as this user."""
    user = ["--unshare-user", "--uid", str(os.getuid()), "--gid", str(os.getgid())]  # unshare made bwrap root
    bwrap = ["bwrap", "--die-with-parent", *user, "--unshare-pid", *options, "--", *command]
    return ["sh", "-c", _PID_NAMESPACE_INIT, PARENT_CHECK, *bwrap]


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""Where a sandbox's commands find programs after this interpreter's own directory: the system's
directories, never the caller's `PATH` (a sandbox's environment does not depend on who started the run)."""


def _bwrap_problem() -> str | None:
    """Why bwrap sandboxes cannot run here, or None if they can."""
    missing = [tool for tool in ("bwrap", "unshare", "setpriv") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found"
    probe = subprocess.run(
        killed_with_parent(_bwrap_argv(["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"], ["true"])),
        capture_output=True,
        text=True,
        timeout=30,
    )
    return None if probe.returncode == 0 else f"a test sandbox failed: {probe.stderr.strip()[-500:]}"


def _interpreter_dirs() -> list[str]:
    """This interpreter's installation and environment, wherever they live (a venv, pyenv)."""
    found = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    return sorted({os.path.realpath(path) for path in found} | {sys.prefix, sys.base_prefix})


def _host_root_binds(workdir: str) -> list[str]:
    """bwrap arguments exposing the system directories (`BWRAP_HOST_DIRS`) and this interpreter
    read-only; nothing else of the host."""
    hidden = _HIDDEN_FROM_BWRAP | {workdir.strip("/").split("/")[0]}
    args: list[str] = []
    for entry in sorted(os.scandir("/"), key=lambda e: e.name):
        if entry.name in hidden or entry.name not in BWRAP_HOST_DIRS:
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry.path), entry.path]
        else:
            args += ["--ro-bind", entry.path, entry.path]
    for path in _interpreter_dirs():
        top = Path(path).parts[1] if len(Path(path).parts) > 1 else ""
        if top not in BWRAP_HOST_DIRS and os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _remove_tree(path: Path) -> None:
    """Delete a sandbox's files, even ones a command made read-only."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError:
        subprocess.run(["chmod", "-R", "u+rwX", str(path)], capture_output=True)
        shutil.rmtree(path)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _kill_started(start: asyncio.Future[tuple[asyncio.SubprocessTransport, Any]]) -> None:
    """Done-callback of a cancelled start: kill the command's whole group if it started."""
    if start.cancelled() or start.exception() is not None:
        return
    transport, _ = start.result()
    _kill_group(transport.get_pid())
    transport.close()


class _Capture(asyncio.SubprocessProtocol):
    """A command's pipes fed into capped buffers; `exited` resolves when the process itself exits.

    The exit is told apart from the pipes closing: a background child can hold the pipes open
    long after the command ended (`Process.wait()` would wait for it too).
    """

    def __init__(self, limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.stdout, self.stderr = CappedBuffer(limit), CappedBuffer(limit)
        self.exited: asyncio.Future[None] = loop.create_future()
        self.drained: asyncio.Future[None] = loop.create_future()
        self._open_pipes = 2

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        (self.stdout if fd == 1 else self.stderr).write(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open_pipes -= 1
        if self._open_pipes == 0 and not self.drained.done():
            self.drained.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


class LocalSandbox(Sandbox):
    """A workspace copy under `root/work` with a private temp dir `root/tmp`."""

    def __init__(self, backend: LocalSandboxBackend, root: Path, spec: SandboxSpec, bwrap: bool) -> None:
        self._backend = backend
        self._root = root
        self._spec = spec
        self._bwrap = bwrap
        self._closed = False
        self._running: set[int] = set()
        """Process groups of the commands running now."""
        self.workdir = spec.workdir if bwrap else str(root / "work")
        self._tmp_view = "/tmp" if bwrap else str(root / "tmp")
        path = spec.env.get("PATH") or os.pathsep.join([os.path.dirname(sys.executable), SYSTEM_PATH])
        self._env = {
            "HOME": f"{self._tmp_view}/home",
            "TMPDIR": self._tmp_view,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            **spec.env,
            "PATH": path,
        }
        self.root = root

    def _host_path(self, path: str) -> Path:
        root, relative = confine_path(path, self.workdir, (self.workdir, self._tmp_view))
        host = self._root / ("work" if root == self.workdir else "tmp")
        resolved = (host / relative).resolve()
        if not resolved.is_relative_to(self._root.resolve()):
            raise SandboxPathError(f"{path!r} leads outside this sandbox through a symbolic link")
        return resolved

    def _argv(self, cmd: str, cwd: str) -> list[str]:
        shell = ["bash", "-c", cmd]
        if not self._bwrap:  # a subreaper that kills whatever the command leaves behind
            return [sys.executable, "-I", "-S", "-c", REAPER_SOURCE, str(os.getpid()), *shell]
        args = ["--unshare-ipc", "--unshare-uts"]
        if not self._spec.network:
            args.append("--unshare-net")
        args += self._backend.root_binds(self._spec.workdir)
        args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/var/tmp"]
        args += ["--bind", str(self._root / "work"), self._spec.workdir, "--bind", str(self._root / "tmp"), "/tmp"]
        if Path(sys.prefix).parts[1] in _HIDDEN_FROM_BWRAP:  # keep this interpreter visible (a venv in /tmp)
            args += ["--ro-bind", sys.prefix, sys.prefix]
        args += self._backend.mask_args(self._spec)
        return killed_with_parent(_bwrap_argv([*args, "--chdir", cwd], shell))

    async def _start(
        self, argv: list[str], env: dict[str, str], cwd: Path, limit: int
    ) -> tuple[asyncio.SubprocessTransport, _Capture]:
        """Start `argv` in a process group of its own.

        A cancelled start still kills the whole group once it has started: asyncio would kill only
        the process it started, then wait for the pipes that the rest of the group holds open.
        """
        starting = asyncio.ensure_future(
            asyncio.get_running_loop().subprocess_exec(
                partial(_Capture, limit),
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        )
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            starting.add_done_callback(_kill_started)
            raise
        except OSError as exc:
            raise SandboxLostError(f"could not start a command in the local sandbox: {exc}") from exc

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
        return await self._backend.quota.run(command, partial(self._backend.run_io, disk_usage, self._root))

    async def _exec(
        self, cmd: str, timeout_s: float, cwd: str | None, env: Mapping[str, str] | None, max_output_bytes: int
    ) -> ExecResult:
        self._check_open()
        view_cwd = posixpath.normpath(posixpath.join(self.workdir, cwd or "."))
        host_cwd = self._host_path(view_cwd)
        if not host_cwd.is_dir():
            return ExecResult(exit_code=1, stdout="", stderr=f"cwd {view_cwd!r} is not a directory in the sandbox\n")
        started = time.perf_counter()
        argv = self._argv(cmd, view_cwd)
        transport, capture = await self._start(argv, {**self._env, **(env or {})}, host_cwd, max_output_bytes)
        group = transport.get_pid()
        self._running.add(group)
        timed_out = False
        try:
            if not self._closed:  # else closed while the command started: it ends here
                done, _ = await asyncio.wait([capture.exited], timeout=timeout_s)
                timed_out = not done
        finally:
            self._running.discard(group)
            if not self._bwrap and not capture.exited.done():  # the reaper sweeps, then exits
                with contextlib.suppress(ProcessLookupError):
                    os.kill(group, signal.SIGTERM)
                await asyncio.wait([capture.exited], timeout=self._backend.drain_timeout_s)
            _kill_group(group)  # also removes background processes the command left behind
            await asyncio.wait([capture.exited, capture.drained], timeout=self._backend.drain_timeout_s)
            transport.close()
        if self._closed:
            raise SandboxLostError("the sandbox was closed while the command ran")
        code = transport.get_returncode()
        code = -signal.SIGKILL if code is None else code
        return ExecResult(
            exit_code=None if timed_out else (128 - code if code < 0 else code),
            stdout=capture.stdout.text(),
            stderr=capture.stderr.text(),
            timed_out=timed_out,
            truncated=capture.stdout.truncated or capture.stderr.truncated,
            duration_s=time.perf_counter() - started,
        )

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        return await self._backend.run_io(self._host_path(path).read_bytes)

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        target = self._host_path(path)
        payload = data.encode() if isinstance(data, str) else data

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(payload)

        await self._backend.run_io(write)

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        self._check_open()
        targets = {self._host_path(path): data for path, data in files.items()}

        def write() -> None:
            for target, data in targets.items():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)

        await self._backend.run_io(write)

    async def upload_dir(self, local_dir: Path, path: str) -> None:
        self._check_open()
        copy = partial(shutil.copytree, local_dir, self._host_path(path), symlinks=True, dirs_exist_ok=True)
        await self._backend.run_io(copy)

    async def download_dir(self, path: str, local_dir: Path) -> None:
        self._check_open()
        copy = partial(shutil.copytree, self._host_path(path), local_dir, symlinks=True, dirs_exist_ok=True)
        await self._backend.run_io(copy)

    def stop_commands(self) -> None:
        """Take no more commands and kill those running (their `exec` raises `SandboxLostError`)."""
        self._closed = True
        for group in self._running:
            if self._bwrap:
                _kill_group(group)
            else:  # the reaper sweeps its descendants and exits; `exec` kills what is left
                with contextlib.suppress(ProcessLookupError):
                    os.kill(group, signal.SIGTERM)

    async def close(self) -> None:
        if self._closed:
            return
        self.stop_commands()
        await self._backend.run_io(_remove_tree, self._root)


class LocalSandboxBackend(SandboxBackend):
    """Sandboxes as workspace copies in temp directories; see the module docstring.

    Args:
        isolation: bwrap: bubblewrap (refused where it cannot run); none: commands run on the host as you, no
            isolation (write it explicitly); auto: bwrap, and a clear error where bubblewrap is missing
        root_dir: where workspace copies are made (default: the temp dir)
        io_workers: threads for file copies and transfers
        drain_timeout_s: seconds to collect a command's remaining output after it exits
    """

    name = "local"

    def __init__(
        self,
        *,
        isolation: Isolation = "auto",
        root_dir: str | Path | None = None,
        io_workers: int = 8,
        drain_timeout_s: float = 2.0,
        hidden_paths: list[str] | tuple[str, ...] = (),
        disk_quota_mb: int | None = 10_240,
        disk_check_interval_s: float = 1.0,
    ) -> None:
        if isolation not in ("auto", "none", "bwrap"):
            raise ConfigError(f"local sandbox isolation must be 'auto', 'none' or 'bwrap', got {isolation!r}")
        problem = _bwrap_problem() if isolation != "none" else None
        if problem:
            raise ConfigError(
                f"the local sandbox isolates commands with bubblewrap, which cannot run here ({problem}): install "
                "bubblewrap and util-linux (apt-get install bubblewrap util-linux) and allow unprivileged user "
                "namespaces, or, for trusted code only, run commands unisolated on this host by writing "
                "isolation: none (sandbox: {name: local, options: {isolation: none}}; --sandbox-option isolation=none)"
            )
        self.isolation = "bwrap" if isolation == "auto" else isolation
        self.root_dir = Path(root_dir) if root_dir else Path(tempfile.gettempdir())
        self.io_workers = io_workers
        self.drain_timeout_s = drain_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="patchgym-local-io")
        self.hidden_paths = [str(p) for p in hidden_paths]
        self.quota = DiskQuota(disk_quota_mb * 2**20 if disk_quota_mb else None, disk_check_interval_s)
        self._root_binds: dict[str, list[str]] = {}
        self._masks: dict[str, list[str]] = {}
        self._sandboxes: weakref.WeakSet[LocalSandbox] = weakref.WeakSet()

    def settings(self) -> dict[str, Any]:
        return {
            "isolation": self.isolation,
            "root_dir": str(self.root_dir),
            "io_workers": self.io_workers,
            "drain_timeout_s": self.drain_timeout_s,
            "hidden_paths": self.hidden_paths,
            "disk_quota_bytes": self.quota.quota_bytes,
            "disk_check_interval_s": self.quota.interval_s,
            "disk_quota_by": "watch" if self.quota.quota_bytes else "none",
            "enforces_resource_limits": False,
        }

    def mask_args(self, spec: SandboxSpec) -> list[str]:
        """bwrap arguments hiding task data and patchgym's own files from a sandbox (see `hidden`)."""
        key = str(spec.workspace)
        if key not in self._masks:
            bound = [f"/{name}" for name in BWRAP_HOST_DIRS] + _interpreter_dirs() + [sys.prefix]
            hidden = hidden_host_paths(spec.workspace, self.hidden_paths)
            self._masks[key] = mask_args(hidden, bound, keep=_interpreter_dirs())
        return self._masks[key]

    def root_binds(self, workdir: str) -> list[str]:
        if workdir not in self._root_binds:
            self._root_binds[workdir] = _host_root_binds(workdir)
        return self._root_binds[workdir]

    async def run_io(self, fn: Any, *args: Any) -> Any:
        """Run blocking file I/O on the backend's own thread pool (sized by `io_workers`)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        if spec.workspace is None:
            image = spec.image or (str(spec.dockerfile) if spec.dockerfile else None)
            hint = f" (it names the image {image!r}: use the docker backend)" if image else ""
            raise SandboxStartError(f"the local sandbox backend needs a task with a workspace directory{hint}")
        workspace = Path(spec.workspace)
        if not workspace.is_dir():
            raise SandboxStartError(f"workspace {str(workspace)!r} does not exist or is not a directory")
        try:
            root = Path(await self.run_io(partial(tempfile.mkdtemp, prefix=_ROOT_PREFIX, dir=self.root_dir)))
        except OSError as exc:
            raise SandboxStartError(f"cannot create a sandbox directory in {self.root_dir}: {exc}") from exc
        sandbox = LocalSandbox(self, root, spec, bwrap=self.isolation == "bwrap")
        try:
            await self.run_io(self._populate, root, workspace, spec)
        except OSError as exc:
            await self.run_io(_remove_tree, root)
            raise SandboxStartError(f"cannot copy workspace {str(workspace)!r} into a sandbox: {exc}") from exc
        self._sandboxes.add(sandbox)
        return sandbox

    @staticmethod
    def _populate(root: Path, workspace: Path, spec: SandboxSpec) -> None:
        shutil.copytree(workspace, root / "work", symlinks=True)
        (root / "tmp" / "home").mkdir(parents=True)
        labels = {"labels": dict(spec.labels), "owner_pid": os.getpid()}
        (root / _LABELS_FILE).write_text(json.dumps(labels))

    async def reap(self, labels: Mapping[str, str]) -> int:
        def sweep() -> int:
            removed = 0
            for root in self.root_dir.glob(f"{_ROOT_PREFIX}*"):
                try:
                    found = json.loads((root / _LABELS_FILE).read_text())["labels"]
                except (OSError, ValueError, KeyError):
                    continue
                if all(found.get(key) == value for key, value in labels.items()):
                    _remove_tree(root)
                    removed += 1
            return removed

        return await self.run_io(sweep)

    async def aclose(self) -> None:
        """Kill the commands still running in this backend's sandboxes (their files stay, for `reap`)."""
        for sandbox in list(self._sandboxes):
            sandbox.stop_commands()
        self._executor.shutdown(wait=False, cancel_futures=True)
