"""The `harbor` task set: Harbor (Terminal-Bench 2) task folders, run on container backends.

A task folder holds `instruction.md`, `task.toml`, `environment/Dockerfile` (or
`[environment].docker_image`), `tests/test.sh` and optionally `solution/solve.sh`. The sandbox
is built from the Dockerfile (or named image) with `task.toml`'s CPU and memory limits; the
workdir is `[environment].workdir`, else the Dockerfile's last `WORKDIR`, else `/`.

`HarborGrader` does what Harbor's verifier does: it replaces `/tests` with the task's tests,
empties `/logs/verifier`, runs `bash /tests/test.sh` under `[verifier].timeout_sec`, and reads
the reward from `/logs/verifier/reward.json` (a flat object of numbers; its `reward` key, or
its only key) or else `reward.txt` (one number). The script's exit code never grants reward: a
missing, empty or malformed reward file is reward 0 with the reason. The oracle copies
`solution/` to `/solution` and runs `solve.sh`.

A Harbor verifier grades the container's state, so it runs in the agent's sandbox, hardened:
first every process the agent left is stopped (`STOP_OTHERS`), then `test.sh` runs in the clean
grading shell (no profile or rc file, an explicit environment), the processes it starts are
killed when it ends, and the reward file must be a regular file of at most `MAX_REWARD_BYTES`.
On Docker, the container's changes (`docker diff`, read from the engine, not from inside) must
leave the shell start-up files, the interpreters and the whole standard library alone, compared
by real path (`harbor_paths`, less the task's `[verifier].allowed_changes`), and the Python the
agent added or changed passes the static tamper checks (`harbor_static`, under the episode's
`tamper_policy`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import re
import shlex
import tarfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.grading import GradeFailure, ShellGrader
from patchgym.core.grading_shell import GradingRoom, GradingSetupError
from patchgym.core.plugins import Register, hookimpl
from patchgym.core.sandbox import Sandbox, SandboxSpec
from patchgym.core.tasks import LoadedTaskSet, Task, TestStatus, sandbox_limits
from patchgym.core.test_reports import ReportError
from patchgym.plugins.harbor_paths import EXISTING_ONLY, PROTECTED_PATHS, protected_changes
from patchgym.plugins.harbor_static import harbor_findings

VERIFIER_DIR = "/logs/verifier"
MAX_REWARD_BYTES = 65_536
STOP_OTHERS = (
    'case "$(tr "\\0" " " < /proc/1/cmdline)" in *docker-init*|*tini*|sleep*) ;; *) echo 0; exit 0;; esac; '
    'keep=" 1 "; p=$$; while [ "$p" -gt 1 ] 2>/dev/null; do keep="$keep$p "; '
    'p=$(sed -n "s/^PPid:[[:space:]]*//p" /proc/$p/status 2>/dev/null); [ -n "$p" ] || break; done; '
    'main=$(cut -d" " -f1 /proc/1/task/1/children 2>/dev/null); keep="$keep$main "; n=0; '
    "for signal in STOP KILL; do for d in /proc/[0-9]*; do q=${d#/proc/}; "
    'case "$keep" in *" $q "*) continue;; esac; kill -$signal "$q" 2>/dev/null && n=$((n+1)); done; done; echo $((n/2))'
)
"""Bash that stops, then kills, every process but PID 1, the container's main process and its own
ancestors, in a container whose PID 1 is an init (elsewhere it kills nothing): what the agent
left running cannot touch the verifier's files while it runs."""
MAX_ORACLE_BYTES = 96_000
"""The oracle travels inside one command line (a kernel limit of 128 KiB per argument)."""
_WORKDIR = re.compile(r"^\s*WORKDIR\s+(\S+)\s*$", re.I | re.M)


def _tar(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(str(path), arcname=str(path.relative_to(folder)), recursive=False)
    return buffer.getvalue()


def read_reward(name: str, text: str) -> tuple[float | None, str]:
    """(reward, reason) from the content of reward.json or reward.txt; reward None if unusable."""
    if not text.strip():
        return None, f"reward_file_empty: {name} is empty"
    try:
        value: Any = json.loads(text) if name.endswith(".json") else float(text.strip())
    except ValueError:
        return None, f"reward_unreadable: {name} does not hold a number: {text.strip()[:200]!r}"
    if isinstance(value, dict):
        if not value or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
            return None, f"reward_unreadable: {name} must be a flat object of numbers"
        if "reward" not in value and len(value) != 1:
            return None, f"reward_unreadable: {name} has several keys and no 'reward'"
        value = value.get("reward", next(iter(value.values())))
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None, f"reward_unreadable: {name} does not hold a finite number"
    return float(value), "rewarded"


@dataclass(frozen=True)
class HarborGrader(ShellGrader):
    """Runs a Harbor task's `tests/test.sh` and reads the reward file; see the module docstring."""

    tests_tar: bytes
    timeout_s: float = 600.0
    env: Mapping[str, str] = field(default_factory=dict)
    max_log_bytes: int = 1_000_000
    stop_agent_processes: bool = True
    protected_paths: tuple[str, ...] = PROTECTED_PATHS
    existing_only_paths: tuple[str, ...] = EXISTING_ONLY
    allowed_changes: tuple[str, ...] = ()
    tamper_policy: str = "zero"
    max_static_bytes: int = 50_000_000
    grades_container_state = True  # type: ignore[misc]

    async def _grade(self, sandbox: Sandbox, details: dict[str, Any]) -> tuple[float, Mapping[str, TestStatus]]:
        if self.stop_agent_processes:
            stopped = await sandbox.exec(STOP_OTHERS, timeout_s=60)
            details["agent_processes_stopped"] = stopped.stdout.strip()
        changed = await container_diff(sandbox)
        if changed is not None:
            touched = protected_changes(changed, self.protected_paths, self.existing_only_paths, self.allowed_changes)
            details["protected_changes"] = touched[:20]
            if touched:
                raise GradeFailure("verifier_environment_changed", f"the agent changed {', '.join(touched[:5])}")
        room = await GradingRoom.open(sandbox)
        if changed is not None and self.tamper_policy != "off":
            findings, checked = await harbor_findings(room, changed, self.max_static_bytes)
            details.update(tamper=[f.as_dict() for f in findings[:20]], static_files_checked=checked)
            if findings and self.tamper_policy == "zero":
                raise GradeFailure("tamper_suspected", findings[0].what)
        archive = await room.write("tests.tar", self.tests_tar)
        staged = await room.run(
            f"rm -rf /tests {VERIFIER_DIR} && mkdir -p /tests {VERIFIER_DIR} "
            f"&& tar -xf {shlex.quote(archive)} -C /tests",
            timeout_s=120,
        )
        if not staged.ok:
            raise GradingSetupError("cannot stage the verifier's tests", staged.output)
        run = await room.run(
            "bash --noprofile --norc /tests/test.sh",
            timeout_s=self.timeout_s,
            env=dict(self.env),
            max_output_bytes=self.max_log_bytes,
            sweep=True,
        )
        details.update(exit_code=run.exit_code, test_duration_s=round(run.duration_s, 3), log_tail=run.output[-2000:])
        if run.timed_out:
            raise GradeFailure("tests_timed_out")
        for name in ("reward.json", "reward.txt"):
            try:
                text = await room.read_report(f"{VERIFIER_DIR}/{name}", max_bytes=MAX_REWARD_BYTES)
            except FileNotFoundError:
                continue
            except ReportError as exc:
                raise GradeFailure("reward_unreadable", str(exc)) from None
            reward, problem = read_reward(name, text.decode("utf-8", "replace"))
            if reward is None:
                raise GradeFailure(problem.split(":")[0], problem.partition(": ")[2])
            details.update(reason="rewarded", reward_file=name)
            return reward, {}
        raise GradeFailure("no_reward_file", f"tests/test.sh wrote neither {VERIFIER_DIR}/reward.json nor reward.txt")

    def _protected(self, path: str, kind: int = 0) -> bool:
        """Whether changing `path` (a `docker diff` kind: 0 changed, 1 added, 2 deleted) is refused."""
        return bool(
            protected_changes([(path, kind)], self.protected_paths, self.existing_only_paths, self.allowed_changes)
        )


async def container_diff(sandbox: Sandbox) -> list[tuple[str, int]] | None:
    """(path, kind) of what the container's filesystem changed since its image (`docker diff`:
    kind 0 changed, 1 added, 2 deleted), as the Docker engine sees them; None for sandboxes that
    are not Docker containers."""
    container = getattr(sandbox, "container", None)
    if not callable(getattr(container, "diff", None)):
        return None
    assert container is not None
    changes = await asyncio.to_thread(container.diff)
    return sorted((str(change["Path"]), int(change.get("Kind", 0))) for change in changes or [])


async def container_changes(sandbox: Sandbox) -> list[str] | None:
    """The paths of `container_diff`."""
    changes = await container_diff(sandbox)
    return None if changes is None else [path for path, _ in changes]


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "task.toml"
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"invalid Harbor task file {path}: {exc}") from exc


def _number(section: Mapping[str, Any], key: str, where: str) -> float | None:
    value = section.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    return value


def _oracle(solution: Path) -> str | None:
    if not (solution / "solve.sh").is_file():
        return None
    payload = base64.b64encode(_tar(solution)).decode()
    if len(payload) > MAX_ORACLE_BYTES:
        raise ConfigError(
            f"{solution} is too large for the oracle ({len(payload)} bytes in base64, at most {MAX_ORACLE_BYTES})"
        )
    return (
        "rm -rf /solution && mkdir -p /solution && "
        f"echo {payload} | base64 -d | tar -x -C /solution && bash /solution/solve.sh"
    )


def load_harbor_task(folder: Path) -> Task:
    """One Harbor task folder; a malformed one is a `ConfigError` naming what is wrong."""
    config = _config(folder)
    where = str(folder / "task.toml")
    agent, verifier, environment = (config.get(k, {}) for k in ("agent", "verifier", "environment"))
    for name in ("instruction.md", "tests/test.sh"):
        if not (folder / name).is_file():
            raise ConfigError(f"Harbor task {folder} has no {name}")
    dockerfile = folder / "environment" / "Dockerfile"
    image = environment.get("docker_image")
    if not dockerfile.is_file() and not image:
        raise ConfigError(f"Harbor task {folder} has neither environment/Dockerfile nor [environment].docker_image")
    workdirs = _WORKDIR.findall(dockerfile.read_text()) if dockerfile.is_file() else []
    workdir = environment.get("workdir") or (workdirs[-1] if workdirs and workdirs[-1].startswith("/") else "/")
    memory = _number(environment, "memory_mb", where)
    spec = SandboxSpec(
        image=image,
        dockerfile=dockerfile if dockerfile.is_file() else None,
        workdir=workdir,
        **sandbox_limits(_number(environment, "cpus", where), int(memory) if memory else None),
        network=bool(environment.get("allow_internet", False)),
        env={str(k): str(v) for k, v in environment.get("env", {}).items()},
        labels={"task_id": folder.name},
    )
    grader = HarborGrader(
        tests_tar=_tar(folder / "tests"),
        timeout_s=_number(verifier, "timeout_sec", where) or 600.0,
        env={str(k): str(v) for k, v in verifier.get("env", {}).items()},
        allowed_changes=tuple(str(p) for p in verifier.get("allowed_changes", [])),
    )
    return Task(
        id=folder.name,
        instruction=(folder / "instruction.md").read_text(),
        sandbox=spec,
        grader=grader,
        oracle=_oracle(folder / "solution"),
        metadata={"source": str(folder), "agent_timeout_s": _number(agent, "timeout_sec", where)},
    )


class HarborTaskSet(LoadedTaskSet):
    """Harbor task folders under `path` (or `path` itself when it is one task), in name order.

    Args:
        path: a folder of Harbor tasks (folders with a task.toml), or one such task folder
        limit: only the first N tasks in name order (null: all)
    """

    def __init__(self, path: str | Path, limit: int | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"Harbor task set {str(self.path)!r} is not a directory")
        self.name = self.path.name
        self.limit = None if limit in (None, "") else int(limit)

    def load(self) -> list[Task]:
        if (self.path / "task.toml").is_file():
            folders = [self.path]
        else:
            folders = sorted(p for p in self.path.iterdir() if (p / "task.toml").is_file())
        if not folders:
            raise ConfigError(f"{self.path} holds no Harbor tasks (folders with a task.toml)")
        return [load_harbor_task(folder) for folder in folders[: self.limit]]


@hookimpl
def register_task_sets(register: Register) -> None:
    register("harbor", HarborTaskSet, "Harbor task folders: task.toml, Dockerfile, tests/test.sh (option: path)")
