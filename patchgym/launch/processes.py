"""Child processes a run starts (engines, router, trainer ranks): started, watched, stopped.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the driver, which then
stops its children in order) and is told by the kernel to die with the driver
(`PR_SET_PDEATHSIG`), so even a SIGKILLed driver leaves nothing behind; SGLang's own workers
die with their server the same way. Every child's pid and process group are written to
`processes.json` in the log directory as they start, for operators and tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from patchgym.core.errors import InfraError

PR_SET_PDEATHSIG = 1


class ProcessDiedError(InfraError):
    """A process the run depends on (an engine, the router, a trainer rank) exited."""

    kind = "process_died"
    retryable = False


def _die_with(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGKILL when the thread that started it ends."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the driver died before the line above ran
            os._exit(1)

    return preexec


@dataclass
class Child:
    """One started process and where its output goes."""

    name: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def describe(self) -> str:
        code = self.process.poll()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"{self.name} (pid {self.pid}) exited ({how}); log {self.log_path}:\n{self.log_tail()}"


class Supervisor:
    """Starts children, reports those that died, and stops them all (also on failure)."""

    def __init__(self, log_dir: Path, *, stop_grace_s: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.stop_grace_s = stop_grace_s
        self.children: list[Child] = []
        self._stopping = False
        if threading.current_thread() is not threading.main_thread():
            # PR_SET_PDEATHSIG fires when the starting *thread* ends, so only the main thread may start children.
            raise RuntimeError("start the Supervisor's children from the main thread")

    def start(self, name: str, command: Sequence[str], env: Mapping[str, str] | None = None) -> Child:
        """Start `command` (its own session, dies with this process), output to `<log_dir>/<name>.log`."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start the Supervisor's children from the main thread")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                start_new_session=True,
                preexec_fn=_die_with(os.getpid()),  # noqa: PLW1509 (started from the main thread, checked above)
            )
        child = Child(name, process, log_path, list(command))
        self.children.append(child)
        self._write_pids()
        return child

    def _write_pids(self) -> None:
        records = [{"name": c.name, "pid": c.pid, "pgid": c.pid, "command": c.command} for c in self.children]
        path = self.log_dir / "processes.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"driver": os.getpid(), "children": records}, indent=1))
        tmp.replace(path)

    def dead(self) -> list[Child]:
        """Children that exited while the run still needed them."""
        if self._stopping:
            return []
        return [c for c in self.children if c.process.poll() is not None]

    def check(self) -> None:
        """Raise `ProcessDiedError` naming the first dead child, if any."""
        dead = self.dead()
        if dead:
            raise ProcessDiedError(dead[0].describe())

    def stop(self, children: Sequence[Child] | None = None) -> None:
        """SIGTERM each child's process group, SIGKILL what is left after `stop_grace_s`."""
        targets = list(self.children if children is None else children)
        if children is None:
            self._stopping = True
        for child in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for child in targets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
            # the group too: a server's workers may outlive its main process
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.process.wait()
        if children is not None:
            self.children = [c for c in self.children if c not in targets]
            self._write_pids()
