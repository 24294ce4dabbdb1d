"""Run a test command under the grader's supervisor and read back its verdict.

`run_supervised` writes one control file into the grading directory (the nonce, the key, and
the recorder under a random module name with this run's channel descriptors set in it, for the
supervisor to write first), which the supervisor deletes before the command starts,
then starts the supervisor (its source on its command line: one file write and one command
per grading) as the sandbox's own shell would start a command: with the sandbox's
environment, user and working directory, exactly as the agent's commands get them, so that code
under test cannot tell grading from the agent's runs by `HOME`, `PATH` or the like. The
supervisor prints one line, the nonce and the verdict; any other output is ignored, and a run
without that line has no verdict.
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from patchgym.core.grading_shell import GradingRoom
from patchgym.core.verdict.canaries import Canary

INSIDE = Path(__file__).with_name("inside")
SUPERVISOR = INSIDE / "supervisor.py"
RECORDER = INSIDE / "recorder.py"
Mode = Literal["pytest", "unittest", "plain"]
RECORD_OVERHEAD_BYTES = 64_000_000
"""Room for the records beside the log in the supervisor's one line of output."""


class NoVerdict(Exception):
    """The supervisor printed no verdict (it could not start, or crashed): the grade is 0."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class Verdict:
    """What the supervisor saw: each recorded outcome as (test id, phase, outcome)."""

    exit_code: int | None
    timed_out: bool
    began: bool
    ended: bool
    outcomes: list[tuple[str, str, str]]
    problems: list[str]
    killed: int
    xfail_files: list[str]
    log: str
    log_bytes: int
    duration_s: float
    mode: Mode = "plain"
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """What grade details keep of it."""
        return {
            "mode": self.mode,
            "runner_exit_code": self.exit_code,
            "began": self.began,
            "ended": self.ended,
            "records": len(self.outcomes),
            "problems": self.problems[:20],
            "killed_processes": self.killed,
            "supervised_s": self.duration_s,
        }


@dataclass(frozen=True)
class Prepared:
    """The recorder's place in one run: the path to run it from (unittest), the environment that
    loads it (pytest), and the files the supervisor writes first (the recorder, the canary)."""

    recorder: str
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)


def _recorder_source(channel: tuple[int, int], canary: str | None) -> str:
    source = RECORDER.read_text()
    for old, new in (("_CHANNEL = None", f"_CHANNEL = {channel!r}"), ("_CANARY = None", f"_CANARY = {canary!r}")):
        if old not in source:
            raise RuntimeError(f"the recorder lost its {old!r} line")
        source = source.replace(old, new, 1)
    return source


def prepare(room: GradingRoom, mode: Mode, channel: tuple[int, int], canary: Canary | None) -> Prepared:
    """The recorder for `mode` under a random module name, and where the supervisor writes it."""
    files: dict[str, str] = {}
    if mode == "plain":
        return Prepared("", {}, files)
    module = f"_{secrets.token_hex(6)}"
    canary_path = f"{room.sandbox.workdir}/{canary.path}" if canary and mode == "pytest" else None
    path = f"{room.root}/lib/{module}.py"
    files[path] = _recorder_source(channel, canary_path)
    env = {"PYTHONPATH": f"{room.root}/lib", "PYTEST_ADDOPTS": f"-p {module}"} if mode == "pytest" else {}
    return Prepared(path, env, files)


def channel_fds() -> tuple[int, int]:
    """Two distinct descriptor numbers for the key and the records, drawn per run."""
    first = 20 + secrets.randbelow(180)
    second = 20 + (first - 20 + 1 + secrets.randbelow(179)) % 180
    return first, second


async def run_supervised(
    room: GradingRoom,
    command: str,
    *,
    mode: Mode,
    prepared: Prepared,
    channel: tuple[int, int],
    timeout_s: float,
    max_log_bytes: int,
    xfail_files: list[str] | None = None,
    remove_after: tuple[str, ...] = (),
) -> Verdict:
    """Run `command` under the supervisor (see the module docstring); `NoVerdict` if none came."""
    nonce, key = secrets.token_hex(16), secrets.token_hex(32)
    control = {
        "nonce": nonce,
        "key": key,
        "fds": list(channel),
        "command": command,
        "env": prepared.env,
        "cwd": room.sandbox.workdir,
        "timeout_s": timeout_s,
        "max_log_bytes": max_log_bytes,
        "xfail_files": xfail_files or [],
        "files": prepared.files,
        "remove_after": list(remove_after or ()),
    }
    control_path = await room.write(f"{secrets.token_hex(8)}.json", json.dumps(control))
    run = await room.sandbox.exec(
        f"exec {shlex.quote(room.python)} -I -S -c {shlex.quote(SUPERVISOR.read_text())} {shlex.quote(control_path)}",
        timeout_s=timeout_s + 120,
        max_output_bytes=2 * max_log_bytes + RECORD_OVERHEAD_BYTES,
    )
    marker = nonce + " "
    lines = [line for line in run.stdout.splitlines() if line.startswith(marker)]
    if len(lines) != 1:
        raise NoVerdict(f"the supervisor printed {len(lines)} verdicts (exit {run.exit_code})", run.output[-2000:])
    try:
        data = json.loads(lines[0][len(marker) :])
    except ValueError as exc:
        raise NoVerdict(f"the supervisor's verdict is not JSON: {exc}", run.output[-2000:]) from None
    if "error" in data:
        raise NoVerdict(f"the supervisor failed: {data['error']}", run.output[-2000:])
    return Verdict(
        exit_code=data["exit_code"],
        timed_out=bool(data["timed_out"]),
        began=bool(data["began"]),
        ended=bool(data["ended"]),
        outcomes=[(str(a), str(b), str(c)) for a, b, c in data["outcomes"]],
        problems=[str(problem) for problem in data["problems"]],
        killed=int(data["killed"]),
        xfail_files=[str(path) for path in data["xfail_files"]],
        log=str(data["log"]),
        log_bytes=int(data["log_bytes"]),
        duration_s=float(data["duration_s"]),
        mode=mode,
    )
