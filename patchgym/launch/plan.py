"""What a run starts and where, decided before anything starts: the launch plan.

A `ProcessPlan` is one process: its role, where it runs (`Where`: node, host, pinned GPUs,
resources a scheduler must reserve), its argv and the environment variables it gets on top of
the environment `patchgym run` inherits, and its GPU memory estimate (`launch.memory`). The
launchers (`engines.plan_sglang`, `ranks.plan_ranks`) build them with the same pure functions
whether they then start them or only show them (`patchgym run --dry-run`), so the dry run shows
what would run. A placement (`Placer`) decides `Where`: `LocalPlacer` keeps every process on the
machine `patchgym run` starts on; with `cluster:` the dry run places them on the listed nodes
(`launch.placement`). A `LaunchPlan` is checked on construction: no GPU of a node given twice or
beyond the node's count, and no process whose memory estimate exceeds its GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from patchgym.backends.trainer.parallel import MegatronLayout
from patchgym.core.errors import ConfigError
from patchgym.launch.memory import MemoryEstimate, check_fits

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
    memory: MemoryEstimate | None = None
    """Its GPU memory per GPU (None: no GPU, or the model's shape is unknown)."""

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
    gpu_counts: Mapping[str, int | None] = field(default_factory=dict)
    """Node -> how many GPUs it has (None or absent: unknown, not checked)."""

    def __post_init__(self) -> None:
        check_gpus(self.processes, self.gpu_counts)
        for process in self.processes:
            if process.memory is not None:
                check_fits(process.name, process.memory, process.role)

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

    def gpus_by_node(self) -> dict[str, dict[str, Any]]:
        """Node -> its GPU count (None: unknown) and which process holds each GPU."""
        found: dict[str, dict[str, Any]] = {}
        for process in self.processes:
            node = found.setdefault(process.where.node, {"gpus": self.gpu_counts.get(process.where.node), "held": {}})
            for gpu in process.where.gpus:
                node["held"][str(gpu)] = process.name
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "layout": None if self.layout is None else self.layout.as_dict(),
            "ranks_by_node": self.ranks_by_node(),
            "gpus_by_node": self.gpus_by_node(),
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
    data["memory"] = None if process.memory is None else process.memory.as_dict()
    return data


def check_gpus(processes: tuple[ProcessPlan, ...], counts: Mapping[str, int | None]) -> None:
    """No GPU of a node is given to two processes, nor one the node lacks (`counts`: node -> its GPUs,
    None or absent where unknown); a `ConfigError` names them all."""
    holders: dict[tuple[str, int], list[str]] = {}
    for process in processes:
        for gpu in process.where.gpus:
            holders.setdefault((process.where.node, gpu), []).append(process.name)
    problems = []
    shared = {key: names for key, names in holders.items() if len(names) > 1}
    for node in sorted({node for node, _ in shared}):
        gpus = sorted(gpu for n, gpu in shared if n == node)
        pairs = ", ".join(f"GPU {gpu}: {' and '.join(shared[node, gpu])}" for gpu in gpus)
        problems.append(f"GPUs {spans(gpus)} of node {node} are given twice ({pairs})")
    for node in sorted({node for node, _ in holders}):
        count = counts.get(node)
        missing = sorted(gpu for n, gpu in holders if n == node and count is not None and gpu >= count)
        if missing:
            names = sorted({name for gpu in missing for name in holders[node, gpu]})
            problems.append(f"GPUs {spans(missing)} of node {node} do not exist (it has {count}): {', '.join(names)}")
    if problems:
        raise ConfigError(
            "; ".join(problems) + ": give each process GPUs of its own (the trainer ranks take GPUs 0..world-1 of the "
            "machine they start on; inference.options.launch.gpus pins the engines'), or place them on a cluster's "
            "nodes (cluster: with nodes)"
        )


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
