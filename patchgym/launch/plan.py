"""What a run starts and where, decided before anything starts: the launch plan.

A `ProcessPlan` is one process: its role, where it runs (`Where`: node, host, pinned GPUs,
resources a scheduler must reserve), its argv and the environment variables it gets on top of
the environment `patchgym run` inherits. The launchers (`engines.plan_sglang`,
`ranks.plan_ranks`) build them with the same pure functions whether they then start them or
only show them (`patchgym run --dry-run`), so the dry run shows what would run. A placement
(`Placer`) decides `Where`: today's, `LocalPlacer`, keeps every process on the machine
`patchgym run` starts on; a cluster placement fills the same fields with its node assignments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from patchgym.backends.trainer.parallel import MegatronLayout

Role = Literal["driver", "trainer", "engine", "router"]
LOCAL = "local"
"""The node name of the machine `patchgym run` runs on."""


@dataclass(frozen=True)
class Where:
    """Where a process runs."""

    node: str = LOCAL
    host: str = "127.0.0.1"
    """The address it listens on or is reached at."""
    gpus: tuple[int, ...] = ()
    """Accelerator ids on `node` it is pinned to (empty: none pinned)."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """What a scheduler reserves for it (Ray-style, e.g. {"GPU": 1}); informational for the local placement."""


@dataclass(frozen=True)
class ProcessPlan:
    """One process of a run."""

    name: str
    role: Role
    where: Where
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set on top of the inherited environment (values as the process will see them)."""
    url: str | None = None
    rank: int | None = None
    """Its trainer rank, if it is one."""
    coords: Mapping[str, int] | None = None
    """Its index in each parallel group (`MegatronLayout.coords`)."""
    runs: tuple[str, ...] = ()
    """What it runs, for a reader (the driver: the rollout loop, sandboxes, in-process parts)."""

    def environ(self, base: Mapping[str, str] = os.environ) -> dict[str, str] | None:
        """The whole environment to start it with (None: inherit `base` unchanged)."""
        return {**base, **self.env} if self.env else None


@dataclass(frozen=True)
class LaunchPlan:
    """Every process of a run, the trainer's parallel layout, and what a reader must know."""

    placement: str
    processes: tuple[ProcessPlan, ...]
    layout: MegatronLayout | None = None
    engine_urls: tuple[str, ...] = ()
    router_url: str | None = None
    notes: tuple[str, ...] = ()

    def nodes(self) -> dict[str, list[str]]:
        """Node -> the processes on it, in plan order."""
        found: dict[str, list[str]] = {}
        for process in self.processes:
            found.setdefault(process.where.node, []).append(process.name)
        return found

    def ranks_by_node(self) -> dict[str, list[int]]:
        """Node -> the trainer ranks on it (which ranks share a node)."""
        found: dict[str, list[int]] = {}
        for process in sorted(self.processes, key=lambda p: -1 if p.rank is None else p.rank):
            if process.rank is not None:
                found.setdefault(process.where.node, []).append(process.rank)
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "layout": None if self.layout is None else self.layout.as_dict(),
            "ranks_by_node": self.ranks_by_node(),
            "engine_urls": list(self.engine_urls),
            "router_url": self.router_url,
            "processes": [_process_dict(p) for p in self.processes],
            "notes": list(self.notes),
        }


def _process_dict(process: ProcessPlan) -> dict[str, Any]:
    data = asdict(process)
    data["argv"] = list(process.argv)
    data["where"] = {**data["where"], "gpus": list(process.where.gpus), "resources": dict(process.where.resources)}
    data["env"] = dict(process.env)
    data["runs"] = list(process.runs)
    return data


class Placer(Protocol):
    """Decides where each planned process runs: fills `Where` (node, host, GPUs, resources)."""

    name: str

    def place(self, plan: LaunchPlan) -> LaunchPlan: ...


class LocalPlacer:
    """Today's placement: every process on the machine `patchgym run` starts on, as the launchers planned it."""

    name = LOCAL

    def place(self, plan: LaunchPlan) -> LaunchPlan:
        return plan


def spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class PlannedPorts:
    """Stand-in ports for a plan that starts nothing: consecutive numbers from `first`, bound by no one.

    `patchgym run` takes a free port on 127.0.0.1 for each instead, when it starts the process."""

    def __init__(self, first: int = 30000) -> None:
        self.next = first
        self.given: list[int] = []

    def __call__(self) -> int:
        self.given.append(self.next)
        self.next += 1
        return self.given[-1]
