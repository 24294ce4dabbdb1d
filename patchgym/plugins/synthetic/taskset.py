"""The `synthetic` task set: a generated SWE-smith-style directory turned into tasks.

Each task's sandbox starts from the clean snapshot; setup commits it, applies the bug patch
and commits again, so the agent sees the buggy repository with a clean `git status`. The gold
patch is the reverse of the bug patch; grading restores the snapshot's test files and runs
its test command (JUnit report via the bundled unittest runner).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.grading import TestCommandGrader
from patchgym.core.plugins import Register, hookimpl
from patchgym.core.sandbox import SandboxSpec
from patchgym.core.tasks import AGENT_USER, LoadedTaskSet, Task, sandbox_limits
from patchgym.core.validation import apply_patch_command
from patchgym.plugins.folder import GIT_SNAPSHOT, _protected_files
from patchgym.plugins.synthetic.generate import INSTANCES_FILE, SNAPSHOTS_DIR
from patchgym.plugins.synthetic.patches import reverse_patch

COMMIT_BUG = "git add -A && git -c user.name=patchgym -c user.email=patchgym@localhost commit -q -m 'current state'"
REQUIRED_FIELDS = ("instance_id", "repo", "patch", "FAIL_TO_PASS", "PASS_TO_PASS", "problem_statement")


def _tests(value: Any) -> tuple[str, ...]:
    return tuple(json.loads(value) if isinstance(value, str) else value)


class SyntheticTaskSet(LoadedTaskSet):
    """The instances in `path/instances.jsonl`, each on its snapshot in `path/snapshots/`.

    Args:
        path: the folder `patchgym tasks generate` wrote (instances.jsonl and snapshots/)
        name: the set's name in events and reports (default: the folder's name)
        test_timeout_s: seconds the test command of one grading may run
    """

    def __init__(self, path: str | Path, name: str | None = None, test_timeout_s: float = 600.0) -> None:
        self.path = Path(path)
        if not (self.path / INSTANCES_FILE).is_file():
            raise ConfigError(
                f"{self.path} has no {INSTANCES_FILE}: create one with `patchgym tasks generate SOURCE --out {path}`"
            )
        self.name = name or self.path.name
        self.test_timeout_s = test_timeout_s
        self._protected: dict[tuple[str, tuple[str, ...]], dict[str, bytes]] = {}

    def load(self) -> list[Task]:
        tasks = []
        for number, line in enumerate((self.path / INSTANCES_FILE).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                instance = json.loads(line)
                missing = [name for name in REQUIRED_FIELDS if name not in instance]
                if missing:
                    raise ValueError(f"missing fields {missing}")
                tasks.append(self._task(instance))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{self.path / INSTANCES_FILE} line {number}: invalid instance: {exc}") from exc
        return tasks

    def _task(self, instance: dict[str, Any]) -> Task:
        snapshot = self.path / SNAPSHOTS_DIR / instance["repo"]
        if not snapshot.is_dir():
            raise ValueError(f"its snapshot {snapshot} does not exist")
        test_paths = tuple(instance.get("test_paths") or ("tests",))
        key = (instance["repo"], test_paths)
        if key not in self._protected:  # shared by every task on the same snapshot
            self._protected[key] = _protected_files(snapshot, list(test_paths))
        grader = TestCommandGrader(
            test_command=instance["test_command"],
            fail_to_pass=_tests(instance["FAIL_TO_PASS"]),
            pass_to_pass=_tests(instance["PASS_TO_PASS"]),
            test_paths=test_paths,
            original_files=self._protected[key],
            timeout_s=self.test_timeout_s,
        )
        return Task(
            id=instance["instance_id"],
            instruction=instance["problem_statement"],
            sandbox=SandboxSpec(
                workspace=snapshot,
                image=instance.get("image_name"),
                labels={"task_id": instance["instance_id"]},
                user=AGENT_USER,
                **sandbox_limits(),
            ),
            grader=grader,
            setup_commands=(GIT_SNAPSHOT, apply_patch_command(instance["patch"]), COMMIT_BUG),
            gold_patch=reverse_patch(instance["patch"]),
            metadata={
                "source": str(self.path),
                **{k: instance[k] for k in ("repo", "modifier", "file", "function") if k in instance},
            },
        )


@hookimpl
def register_task_sets(register: Register) -> None:
    register("synthetic", SyntheticTaskSet, "bugs made by `patchgym tasks generate` (option: path)")
