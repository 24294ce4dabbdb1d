"""A clean shell for grading commands, in a grader-owned directory of the sandbox.

Grading commands never run in the sandbox's own shell set-up: each starts as
`/usr/bin/env -i ... /bin/bash --noprofile --norc -c CMD`, so no profile or rc file, no
`BASH_ENV`/`ENV`, no exported function and no variable the sandbox's shell would set reaches
them. The environment is explicit: `HOME` and `TMPDIR` inside the grading directory, `PATH`
as the sandbox started with it (minus relative entries and the workdir), `LANG`. The
interpreter is found once, in that shell, and given to commands by absolute path (`{python}`).

`GradingRoom.open` makes the directory (`mktemp -d`, so its name cannot be guessed) and probes
`PATH` and the interpreter. It must run before the agent's changes are applied (the
fresh-sandbox grader does so); in a sandbox the agent used, the probe is only as honest as
that sandbox. Reports are read back through `read_report`: a regular file of bounded size,
read under a timeout (a FIFO, a symbolic link or a directory in its place is a `ReportError`).
`SWEEP` kills every process a grading run left behind (see `GradingRoom.run`).
"""

from __future__ import annotations

import base64
import binascii
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from patchgym.core.sandbox import ExecResult, Sandbox
from patchgym.core.test_reports import ReportError

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""PATH of the grading shell when the sandbox's own cannot be read."""

RUN_MARK = "PATCHGYM_GRADE_RUN"
"""Environment variable naming one grading run: every process it starts inherits it."""

SWEEP = (
    'for f in $(grep -lzF "$mark" /proc/[0-9]*/environ 2>/dev/null); do p=${f#/proc/}; p=${p%/environ}; '
    '[ "$p" = "$$" ] || kill -KILL "$p" 2>/dev/null; done'
)
"""Bash that kills every process whose environment holds `$mark` (this grading run's token)."""


class GradingSetupError(Exception):
    """The grading directory or shell could not be set up: the sandbox is broken (grade 0)."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


def _clean_path(path: str, workdir: str) -> str:
    """Absolute PATH entries outside the workdir, in order, without repeats."""
    kept: list[str] = []
    for entry in path.split(":"):
        inside = entry == workdir or entry.startswith(workdir.rstrip("/") + "/")
        if entry.startswith("/") and not inside and entry not in kept:
            kept.append(entry)
    return ":".join(kept) or DEFAULT_PATH


@dataclass(frozen=True)
class GradingRoom:
    """A grader-owned directory in a sandbox and the clean shell that runs grading commands."""

    sandbox: Sandbox
    root: str
    path: str
    python: str

    @classmethod
    async def open(cls, sandbox: Sandbox, *, interpreter: str = "python3") -> GradingRoom:
        """Make the directory and probe PATH and `interpreter`; `GradingSetupError` if impossible."""
        probe = (
            'd=$(mktemp -d "${TMPDIR:-/tmp}/patchgym-grade.XXXXXXXXXX") && mkdir -m 700 "$d/home" "$d/tmp" '
            '&& printf "%s\\n%s\\n" "$d" "$PATH"'
        )
        made = await sandbox.exec(probe, timeout_s=60)
        lines = made.stdout.splitlines()
        if not made.ok or len(lines) < 2 or not lines[0].startswith("/"):
            raise GradingSetupError("cannot make a grading directory in the sandbox", made.output)
        room = cls(sandbox, lines[0], _clean_path(lines[1], sandbox.workdir), "")
        found = await room.run(f"command -v {shlex.quote(interpreter)}", timeout_s=60)
        python = found.stdout.strip()
        return cls(sandbox, room.root, room.path, python if found.ok and python.startswith("/") else "")

    def command(self, cmd: str, env: Mapping[str, str] | None = None) -> str:
        """`cmd` as a command line that starts it in the clean shell."""
        assignments = {
            "HOME": f"{self.root}/home",
            "TMPDIR": f"{self.root}/tmp",
            "PATH": self.path,
            "LANG": "C.UTF-8",
            **(env or {}),
        }
        pairs = " ".join(shlex.quote(f"{key}={value}") for key, value in assignments.items())
        return f"exec /usr/bin/env -i {pairs} /bin/bash --noprofile --norc -c {shlex.quote(cmd)}"

    async def run(
        self,
        cmd: str,
        *,
        timeout_s: float,
        max_output_bytes: int = 1_000_000,
        env: Mapping[str, str] | None = None,
        sweep: bool = False,
    ) -> ExecResult:
        """Run `cmd` in the clean shell. With `sweep`, every process it started is killed when it
        ends (daemons included, unless they clear their environment), keeping its exit code."""
        if sweep:
            mark = secrets.token_hex(8)
            env = {**(env or {}), RUN_MARK: mark}
            cmd = f"( {cmd} ); rc=$?; mark={shlex.quote(f'{RUN_MARK}={mark}')}; {SWEEP}; exit $rc"
        return await self.sandbox.exec(self.command(cmd, env), timeout_s=timeout_s, max_output_bytes=max_output_bytes)

    async def write(self, name: str, data: bytes | str) -> str:
        """Write a file into the grading directory; returns its path."""
        path = f"{self.root}/{name}"
        await self.sandbox.write_file(path, data)
        return path

    async def read_report(self, path: str, *, max_bytes: int, timeout_s: float = 60.0) -> bytes:
        """The bytes of a report the test run wrote. `FileNotFoundError` if absent; `ReportError`
        if it is not a regular file, is larger than `max_bytes`, or cannot be read in time."""
        quoted = shlex.quote(path)
        script = (
            f"f={quoted}; if [ -L \"$f\" ]; then echo 'is a symbolic link'; exit 4; fi; "
            '[ -e "$f" ] || exit 3; [ -f "$f" ] || { echo \'is not a regular file\'; exit 4; }; '
            'size=$(stat -c %s "$f") || exit 4; '
            f'[ "$size" -le {max_bytes} ] || {{ echo "holds $size bytes"; exit 4; }}; '
            f'head -c {max_bytes} "$f" | base64 -w0'
        )
        limit = max_bytes * 4 // 3 + 1024
        done = await self.run(script, timeout_s=timeout_s, max_output_bytes=limit)
        if done.exit_code == 3:
            raise FileNotFoundError(f"no report at {path}")
        if done.timed_out:
            raise ReportError(f"reading the report {path} took longer than {timeout_s:g} s")
        if not done.ok:
            raise ReportError(f"the report {path} {done.stdout.strip() or 'cannot be read'} (limit {max_bytes} bytes)")
        try:
            return base64.b64decode(done.stdout.strip(), validate=True)
        except binascii.Error as exc:
            raise ReportError(f"the report {path} came back garbled: {exc}") from exc
