"""Task folders: patchgym's own simple task format, and the built-in `tiny` task set.

A task set is a directory with one sub-directory per task::

    <task-id>/
      task.json    {"id", "fail_to_pass", "pass_to_pass", "test_files", optional settings,
                    "image" or "dockerfile" (relative path) for container backends, "user"
                    (default nobody; null: the image's), "cpus"/"memory_mb"/"pids" limits}
      issue.md     the issue text the agent reads
      gold.patch   the reference fix (unified diff, paths relative to repo/)
      solution.sh  optional: a short bash command with the same effect (the task's oracle);
                   task.json's optional "oracle_turns" splits it into one command per turn
      repo/        the project in its buggy state, tests included

Each sandbox starts from a copy of `repo/` made into a git repository, so `git diff` shows the
agent's change. Tests run with the bundled unittest runner unless `test_command` says otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from patchgym.core.errors import ConfigError
from patchgym.core.grading import PROTECTED_FILE_NAMES, UNITTEST_COMMAND, TestCommandGrader
from patchgym.core.plugins import LazyFactory, Register, hookimpl
from patchgym.core.sandbox import SandboxSpec
from patchgym.core.tasks import AGENT_USER, LoadedTaskSet, Task, sandbox_limits

TINY_TASKS = Path(__file__).with_name("tiny") / "tasks"

GIT_SNAPSHOT = (
    "git init -q && git add -A && "
    "git -c user.name=patchgym -c user.email=patchgym@localhost commit -q -m 'initial state'"
)


class TaskFile(BaseModel):
    """The schema of `task.json`."""

    model_config = ConfigDict(extra="forbid")

    id: str
    fail_to_pass: list[str]
    pass_to_pass: list[str] = []
    test_files: list[str] = ["tests"]
    test_command: str = UNITTEST_COMMAND
    report_format: Literal["junit", "pytest", "unittest"] = "junit"
    test_timeout_s: float = 600.0
    setup_commands: list[str] = [GIT_SNAPSHOT]
    oracle_turns: list[str] = []
    image: str | None = None
    dockerfile: str | None = None
    user: str | None = AGENT_USER
    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = None


def _protected_files(repo: Path, test_files: list[str]) -> dict[str, bytes]:
    """The pristine bytes of every test file and protected file, keyed by relative path."""
    found = {path for name in PROTECTED_FILE_NAMES for path in repo.rglob(name)}
    for entry in test_files:
        path = repo / entry
        if path.is_dir():
            found.update(path.rglob("*"))
        else:
            found.add(path)
    return {
        str(p.relative_to(repo)): p.read_bytes() for p in sorted(found) if p.is_file() and "__pycache__" not in p.parts
    }


def load_task(folder: Path) -> Task:
    """Read one task folder; a malformed one is a `ConfigError` that names the file."""
    spec_path = folder / "task.json"
    try:
        spec = TaskFile.model_validate(json.loads(spec_path.read_text()))
    except (OSError, ValueError, ValidationError) as exc:
        raise ConfigError(f"invalid task file {spec_path}: {exc}") from exc
    repo = folder / "repo"
    if not repo.is_dir():
        raise ConfigError(f"task folder {folder} has no repo/ directory with the project")
    gold, solution = folder / "gold.patch", folder / "solution.sh"
    grader = TestCommandGrader(
        test_command=spec.test_command,
        fail_to_pass=tuple(spec.fail_to_pass),
        pass_to_pass=tuple(spec.pass_to_pass),
        test_paths=tuple(spec.test_files),
        original_files=_protected_files(repo, spec.test_files),
        report_format=spec.report_format,
        timeout_s=spec.test_timeout_s,
    )
    return Task(
        id=spec.id,
        instruction=(folder / "issue.md").read_text(),
        sandbox=SandboxSpec(
            workspace=repo,
            image=spec.image,
            dockerfile=folder / spec.dockerfile if spec.dockerfile else None,
            labels={"task_id": spec.id},
            user=spec.user,
            **sandbox_limits(spec.cpus, spec.memory_mb, spec.pids),
        ),
        grader=grader,
        setup_commands=tuple(spec.setup_commands),
        gold_patch=gold.read_text() if gold.exists() else None,
        oracle=solution.read_text() if solution.exists() else None,
        oracle_turns=tuple(spec.oracle_turns),
        metadata={"source": str(folder)},
    )


class FolderTaskSet(LoadedTaskSet):
    """Every task folder under `path`, in name order.

    Args:
        path: the folder holding one sub-folder (with a task.json) per task
        name: the set's name in events and reports (default: the folder's name)
    """

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"task folder set {str(self.path)!r} is not a directory")
        self.name = name or self.path.name

    def load(self) -> list[Task]:
        folders = sorted(p for p in self.path.iterdir() if (p / "task.json").is_file())
        if not folders:
            raise ConfigError(f"{self.path} holds no task folders (sub-directories with a task.json)")
        return [load_task(folder) for folder in folders]


class EasyOptions(BaseModel):
    """Options of the `easy` task set (patchgym/plugins/easy.py)."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(64, ge=1, description="tasks to generate")
    seed: int = Field(0, description="generator seed")
    split: Literal["train", "eval"] = Field("train", description="train and eval never share a task")
    cache_dir: str | None = Field(
        None, description="where tasks are generated (default: $PATCHGYM_CACHE or the temp dir)"
    )


def tiny_task_set() -> FolderTaskSet:
    """Six small real Python projects with one bug each, shipped with patchgym."""
    return FolderTaskSet(TINY_TASKS, name="tiny")


@hookimpl
def register_task_sets(register: Register) -> None:
    register("tiny", tiny_task_set, "six tiny Python projects with one bug each (built in, offline)")
    register("folder", FolderTaskSet, "task folders on disk (option: path)")
    register(
        "easy",
        LazyFactory("patchgym.plugins.easy:easy_task_set"),
        "generated one-line bugs spelled out in the issue (the quickstart's)",
        options=EasyOptions,
    )
    register(
        "locate",
        LazyFactory("patchgym.plugins.locate:locate_task_set"),
        "generated one-line bugs found by a command's output, fixed in a second (options: count, seed, split)",
    )
    register(
        "mix",
        LazyFactory("patchgym.plugins.mix:mixed_task_set"),
        "task sets interleaved, e.g. easy and locate (option: sets, a list of {name, options})",
    )
