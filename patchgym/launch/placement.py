"""Which node and GPUs each process of a plan gets, decided before anything starts, and checked.

- `place_roles`: the trainer ranks' and the engines' placement groups on the nodes a `cluster:`
  block lists (`cluster.nodes`), bundle by bundle in the order the run asks Ray (engines first),
  by each bundle's resources (CPU, GPU, custom) and its group's strategy, with the GPU ids of each
  node handed out in order. Ray places the real run on the nodes it has by the same resources:
  where custom resources pin each role to its nodes (as the reference does), its nodes are
  these; the GPU ids within a node are Ray's to choose.

The plan built on them checks itself (`plan.LaunchPlan`: no GPU of a node given twice or beyond
its count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from patchgym.core.errors import ConfigError
from patchgym.launch.cluster import ClusterNode, RolePlacement


@dataclass(frozen=True)
class Slot:
    """Where one bundle of a role landed: its node and the GPU ids it holds there."""

    node: ClusterNode
    gpus: tuple[int, ...]


@dataclass
class _Free:
    """What is left on one node while bundles are placed."""

    node: ClusterNode
    cpus: float
    resources: dict[str, float]
    gpus: list[float] = field(default_factory=list)
    """The unreserved fraction of each GPU, by id."""

    @classmethod
    def of(cls, node: ClusterNode) -> _Free:
        return cls(node, math.inf if node.cpus is None else node.cpus, dict(node.resources), [1.0] * node.gpus)

    def take(self, bundle: Mapping[str, float]) -> tuple[int, ...] | None:
        """Reserve `bundle` here: the GPU ids it holds, or None (nothing reserved) if it does not fit."""
        if bundle.get("CPU", 0.0) > self.cpus + 1e-9:
            return None
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        if any(v > self.resources.get(k, 0.0) + 1e-9 for k, v in custom.items()):
            return None
        ask = bundle.get("GPU", 0.0)
        if ask >= 1:
            if ask != int(ask):
                raise ConfigError(f"a bundle asks for {ask:g} GPUs: Ray takes whole GPUs above 1")
            ids = [i for i, free in enumerate(self.gpus) if free >= 1.0][: int(ask)]
            if len(ids) < ask:
                return None
        elif ask > 0:  # a share of one GPU: the most used GPU it fits on
            fits = [i for i, free in enumerate(self.gpus) if free >= ask - 1e-9]
            if not fits:
                return None
            ids = [min(fits, key=lambda i: (self.gpus[i], i))]
        else:
            ids = []
        for i in ids:
            self.gpus[i] -= min(ask, 1.0)
        self.cpus -= bundle.get("CPU", 0.0)
        for k, v in custom.items():
            self.resources[k] -= v
        return tuple(ids)

    def describe(self) -> str:
        gpus = sum(1 for free in self.gpus if free >= 1.0)
        custom = ", ".join(f"{k} {v:g}" for k, v in sorted(self.resources.items()))
        cpus = "" if math.isinf(self.cpus) else f", {self.cpus:g} CPUs"
        return f"{self.node.name}: {gpus} of {self.node.gpus} GPUs free{cpus}" + (f", {custom}" if custom else "")


def place_roles(roles: Sequence[RolePlacement], nodes: Sequence[ClusterNode]) -> dict[str, list[Slot]]:
    """Each role's bundles on `nodes`, roles placed in order and sharing the nodes' resources (see the
    module docstring); a bundle that fits nowhere is a `ConfigError` saying what is free."""
    if not nodes:
        raise ConfigError("cluster.nodes lists no node to place on")
    free = [_Free.of(node) for node in nodes]
    return {role.role: _place(role, free) for role in roles}


def _place(role: RolePlacement, free: list[_Free]) -> list[Slot]:
    if role.strategy == "STRICT_PACK":
        for target in free:
            trial = _Free(target.node, target.cpus, dict(target.resources), list(target.gpus))
            taken = [trial.take(role.bundle) for _ in range(role.count)]
            if all(ids is not None for ids in taken):
                target.cpus, target.resources, target.gpus = trial.cpus, trial.resources, trial.gpus
                return [Slot(target.node, ids) for ids in taken if ids is not None]
        raise _no_room(role, 0, free, "all on one node (STRICT_PACK)")
    slots: list[Slot] = []
    for index in range(role.count):
        used = [slot.node.name for slot in slots]
        if role.strategy == "PACK":  # the nodes already holding the group first
            order = sorted(free, key=lambda f: f.node.name not in used)
        elif role.strategy == "SPREAD":  # the least used by the group first
            order = sorted(free, key=lambda f: used.count(f.node.name))
        else:  # STRICT_SPREAD: never a node the group holds
            order = [f for f in free if f.node.name not in used]
        for target in order:
            ids = target.take(role.bundle)
            if ids is not None:
                slots.append(Slot(target.node, ids))
                break
        else:
            strict = role.strategy == "STRICT_SPREAD"
            raise _no_room(role, index, free, "each on its own node (STRICT_SPREAD)" if strict else "")
    return slots


def _no_room(role: RolePlacement, index: int, free: list[_Free], how: str) -> ConfigError:
    member = "trainer rank" if role.role == "trainer" else "engine"
    what = f"{member} {index} of {role.count}" if not how.startswith("all") else f"the {role.count} {role.role}"
    return ConfigError(
        f"cluster.{role.role}: {what} ({dict(role.bundle)}{', ' + how if how else ''}) fits on no node of "
        f"cluster.nodes ({'; '.join(f.describe() for f in free)}): add nodes or GPUs there, or change "
        f"cluster.{role.role} (num_gpus, resources) or the number of {role.role}"
    )
