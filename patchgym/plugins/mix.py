"""The `mix` task set: several registered task sets interleaved, e.g. a ladder from `easy` to `locate`.

    tasks:
      train: {name: mix, options: {sets: [{name: easy, options: {count: 128}}, {name: locate, options: {count:
          384}}]}}

Each member's tasks are spread evenly over the mix (1 easy task, then 3 locate tasks, ... above),
so `eval.limit` or a short run sees every family. Task ids must be unique across the members.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.plugins import registry
from patchgym.core.tasks import LoadedTaskSet, Task, TaskSet


class MixedTaskSet(LoadedTaskSet):
    """The tasks of `members`, interleaved in proportion to their sizes."""

    def __init__(self, members: Sequence[TaskSet], name: str = "mix") -> None:
        if not members:
            raise ConfigError("a mix needs at least one task set")
        self.members = list(members)
        self.name = name

    def load(self) -> list[Task]:
        placed: list[tuple[float, int, Task]] = []
        for rank, member in enumerate(self.members):
            tasks = list(member)
            placed += [((i + 0.5) / len(tasks), rank, task) for i, task in enumerate(tasks)]
        tasks = [task for _, _, task in sorted(placed, key=lambda p: (p[0], p[1]))]
        seen: dict[str, int] = {}
        for task in tasks:
            seen[task.id] = seen.get(task.id, 0) + 1
        duplicates = sorted(i for i, n in seen.items() if n > 1)
        if duplicates:
            raise ConfigError(f"task ids occur in more than one mixed task set: {', '.join(duplicates[:5])}")
        return tasks


def mixed_task_set(sets: Sequence[Mapping[str, Any]]) -> MixedTaskSet:
    """A mix of registered task sets, each given as {name, options}.

    Args:
        sets: the task sets to interleave, each {name: ..., options: {...}}
    """
    if not isinstance(sets, Sequence) or isinstance(sets, str) or not sets:
        raise ConfigError("mix: `sets` must be a non-empty list of {name: ..., options: {...}}")
    members = []
    for entry in sets:
        if not isinstance(entry, Mapping) or "name" not in entry or set(entry) - {"name", "options"}:
            raise ConfigError(f"mix: each set is {{name: ..., options: {{...}}}}, got {entry!r}")
        members.append(registry().create("task_set", entry["name"], **dict(entry.get("options") or {})))
    return MixedTaskSet(members, name="mix(" + ",".join(m.name for m in members) + ")")
