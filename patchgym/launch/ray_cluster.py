"""The driver's side of Ray cluster mode: connect, place a role's actors, watch them, stop them.

`patchgym run` with `cluster: {backend: ray}` connects here (`RayCluster`: `ray.init(address)`
from a node of the cluster, usually the head) and places two roles, each as one placement group
(`cluster.RayPlacement`): the Megatron trainer ranks (`ray_trainer`) and the SGLang engines
(`ray_engines`). The driver itself (rollout loop, sandboxes, the SGLang router) stays where
`patchgym run` started. Every actor checks on construction that it sees the model and the run
directory at the driver's paths (a filesystem every node mounts at the same path: checkpoints
and logs are written there) and sends its own output to `RUN_DIR/logs/<part>/`.

A role is watched by polling each actor (`poll()`, answered at once by a live actor): an actor
whose process exits or whose node dies stops answering, and is reported with its node, pid and
log (`PlacedRole.dead`). An actor that is unreachable counts as dead once Ray marks its node
dead, after `cluster.unreachable_s`, or at once when a call to it has just failed (`check`).
Nothing here is imported without `cluster:`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from patchgym.core.errors import ConfigError, TransportError
from patchgym.launch.cluster import ClusterSettings, RayPlacement, RolePlacement
from patchgym.launch.processes import ProcessDiedError


def node_address() -> str:
    """This actor's (or driver's) node address, as the cluster knows it."""
    return ray.util.get_node_ip_address()


NOSET_VARIABLES = (
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES",
)


def base_gpu(gpu_ids: Sequence[Any], env: Mapping[str, str]) -> int:
    """An actor's first GPU among those its process sees (an engine's `--base-gpu-id`, a trainer
    rank's `LOCAL_RANK`): 0, as Ray shows each actor only its own GPUs through
    CUDA/HIP_VISIBLE_DEVICES; the first id Ray assigned when told not to (RAY_EXPERIMENTAL_NOSET_*,
    the reference ROCm setup)."""
    if gpu_ids and any(env.get(name) == "1" for name in NOSET_VARIABLES):
        return int(gpu_ids[0])
    return 0


def check_paths(owner: str, paths: Sequence[str]) -> None:
    """In an actor: a `ConfigError` naming the node when it does not see one of the driver's paths."""
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise ConfigError(
            f"{owner} on node {node_address()} does not see {', '.join(missing)}: the model and the run "
            "directory must be on a filesystem every node mounts at the same path as the driver"
        )


def redirect_output(path: str) -> None:
    """In an actor: its stdout and stderr (and those of what it starts) go to `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@dataclass(eq=False)
class Member:
    """One actor of a role: where it runs and, once it is gone, why (compared by identity)."""

    name: str
    actor: Any
    bundle: int
    node_id: str
    address: str
    log: str
    pid: int = 0
    death: str | None = None
    unreachable_since: float | None = None
    unreachable: str = ""
    poll_ref: Any = field(default=None, repr=False)

    def describe(self) -> str:
        where = f"Ray actor on node {self.address} ({self.node_id[:12]}), pid {self.pid}"
        return f"{self.name} ({where}) {self.death or 'is running'}; log {self.log}"


def _first_line(exc: BaseException, limit: int = 240) -> str:
    """The exception's type and first line, cut to `limit` characters (Ray's messages run long)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PlacedRole:
    """The actors of one role in their placement group: reports the dead ones, stops them all."""

    def __init__(self, placement: RolePlacement, group: Any, members: list[Member], settings: ClusterSettings) -> None:
        self.placement = placement
        self.group = group
        self.members = members
        self.unreachable_s = settings.unreachable_s
        self.check_s = settings.check_timeout_s
        self.stopping = False
        self._asking = threading.Lock()  # one thread at a time asks the members

    @property
    def children(self) -> list[Member]:
        return self.members

    def _collect(self, member: Member) -> None:
        """Read the member's finished poll into its state."""
        try:
            problem = ray.get(member.poll_ref)
        except ray.exceptions.ActorUnavailableError as exc:
            # its node or process may be gone, or the network hiccupped: see _verdict
            member.unreachable_since = member.unreachable_since or time.monotonic()
            member.unreachable = _first_line(exc)
        except ray.exceptions.RayActorError as exc:
            member.death = f"died ({_first_line(exc)})"
        except ray.exceptions.RayError as exc:
            member.death = f"failed ({_first_line(exc)})"
        else:
            member.unreachable_since = None
            member.death = problem
        member.poll_ref = None

    def _verdict(self, member: Member, alive_nodes: set[str], strict: bool) -> None:
        """An unreachable member is dead once Ray marks its node dead, or after `unreachable_s`
        (at once when `strict`: a call to it has just failed)."""
        if member.death is not None or member.unreachable_since is None:
            return
        waited = time.monotonic() - member.unreachable_since
        if member.node_id not in alive_nodes:
            member.death = f"lost its node: Ray marked node {member.address} dead ({member.unreachable})"
        elif strict:
            member.death = f"does not answer ({member.unreachable})"
        elif waited >= self.unreachable_s:
            member.death = f"has not answered for {waited:.0f} s ({member.unreachable})"

    def dead(self, *, wait_s: float = 0.0, strict: bool = False) -> list[Member]:
        """Members whose process or node is gone (none once the role is being stopped): each live
        member is asked once more, and its answer read if it comes within `wait_s`. A quick look
        (`wait_s` 0) while another thread waits for answers returns what is known so far."""
        if self.stopping:
            return []
        if not self._asking.acquire(blocking=wait_s > 0):
            return [m for m in self.members if m.death is not None]
        try:
            self._ask(wait_s, strict)
        finally:
            self._asking.release()
        return [m for m in self.members if m.death is not None]

    def _ask(self, wait_s: float, strict: bool) -> None:
        live = [m for m in self.members if m.death is None]
        for member in live:
            if member.poll_ref is None:
                member.poll_ref = member.actor.poll.remote()
        if live:
            ready, _ = ray.wait([m.poll_ref for m in live], num_returns=len(live), timeout=wait_s)
            for member in live:
                if member.poll_ref in ready:
                    self._collect(member)
        if any(m.unreachable_since is not None and m.death is None for m in live):
            alive_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            for member in live:
                self._verdict(member, alive_nodes, strict)

    def check(self) -> None:
        """After a failed call or before one that needs every member (the weight sync): a fresh answer
        from each member within `check_s`; one that is gone or unreachable is a `ProcessDiedError`."""
        dead = self.dead(wait_s=self.check_s, strict=True)
        if dead:
            raise ProcessDiedError(dead[0].describe())

    def stop(self, stop_call: Callable[[Any], Any] | None = None, timeout_s: float = 0.0) -> None:
        """Ask each live member to stop (`stop_call(actor)` gives the ref, bounded by `timeout_s`),
        then kill every actor and remove the placement group."""
        self.stopping = True
        live = [m for m in self.members if m.death is None]
        if stop_call is not None and live:
            refs = [stop_call(m.actor) for m in live]
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for member in self.members:
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(member.actor, no_restart=True)
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            remove_placement_group(self.group)

    def as_dict(self) -> list[dict[str, Any]]:
        return [
            {"name": m.name, "node_id": m.node_id, "address": m.address, "pid": m.pid, "log": m.log}
            for m in self.members
        ]


class RayCluster:
    """The run's connection to a Ray cluster; places the roles of `placement` (see the module docstring)."""

    def __init__(self, settings: ClusterSettings, placement: RayPlacement) -> None:
        self.config = settings
        self.placement = placement
        self.roles: dict[str, PlacedRole] = {}
        # Ray's own logging goes to the run's library.log (stderr there); actors' output to their log files.
        try:
            ray.init(
                address=settings.address,
                namespace=settings.namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
                configure_logging=False,
            )
        except ConnectionError as exc:
            raise TransportError(
                f"cannot join the Ray cluster at cluster.address={settings.address!r} ({exc}): run patchgym on a "
                "node of a running cluster (ray start --head, or ray start --address HEAD:PORT)"
            ) from None

    # -- placing a role ------------------------------------------------------------------------
    def place(self, role: RolePlacement) -> tuple[Any, list[str]]:
        """A placement group for `role`, once Ray has placed it; and the node id of each bundle."""
        group = placement_group(role.bundles(), strategy=role.strategy)
        try:
            ray.get(group.ready(), timeout=self.config.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise TransportError(
                f"Ray could not place the {role.role} ({role.count} x {dict(role.bundle)}, {role.strategy}) within "
                f"cluster.start_timeout_s={self.config.start_timeout_s:.0f} s; the cluster has "
                f"{_resources(ray.cluster_resources())}, of which {_resources(ray.available_resources())} are free: "
                f"start nodes with those resources (ray start --resources ...) or change cluster.{role.role}"
            ) from None
        nodes = placement_group_table(group)["bundles_to_node_id"]
        return group, [nodes[i] for i in range(role.count)]

    def actor_options(self, role: RolePlacement, group: Any, bundle: int) -> dict[str, Any]:
        """Ray options of the actor on `bundle` of `group`: the bundle's resources, the run's environment."""
        custom = {k: v for k, v in role.bundle.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": role.bundle.get("CPU", 0),
            "num_gpus": role.bundle.get("GPU", 0),
            "resources": custom,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
            "runtime_env": {"env_vars": dict(self.placement.env)},
            "max_restarts": 0,
        }

    def addresses(self) -> dict[str, str]:
        """Node id -> node address, for every node the cluster has known."""
        return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}

    def wait(self, refs: Sequence[Any], what: str) -> list[Any]:
        """`ray.get(refs)` within `start_timeout_s`, as a clear error otherwise."""
        try:
            return ray.get(list(refs), timeout=self.config.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TransportError(
                f"{what} did not answer within cluster.start_timeout_s={self.config.start_timeout_s:.0f} s"
            ) from None
        except ray.exceptions.RayActorError as exc:  # e.g. an actor refused its node in __init__
            raise ProcessDiedError(f"{what} could not start: {exc}") from None

    # -- the run's parts -------------------------------------------------------------------------
    def sglang(self, model: str | Path, **options: Any) -> Any:
        """The `sglang` inference backend with its engines as actors (or attached by URL)."""
        from patchgym.launch.ray_engines import ray_sglang

        return ray_sglang(self, model, **options)

    def megatron(self, model: str | Path, **options: Any) -> Any:
        """The `megatron` trainer with every rank, rank 0 included, as an actor."""
        from patchgym.launch.ray_trainer import ray_megatron

        return ray_megatron(self, model, **options)

    def settings(self) -> dict[str, Any]:
        """The cluster settings, every node, and where each role's actors run (the run's launch event)."""
        nodes = [
            {
                "node_id": n["NodeID"],
                "address": n["NodeManagerAddress"],
                "alive": n["Alive"],
                "resources": n["Resources"],
            }
            for n in ray.nodes()
        ]
        return {
            **self.config.model_dump(),
            "gcs_address": ray.get_runtime_context().gcs_address,
            "driver_address": node_address(),
            "placement": self.placement.as_dict(),
            "nodes": nodes,
            "actors": {name: role.as_dict() for name, role in self.roles.items()},
        }

    async def aclose(self) -> None:
        """Disconnect; Ray then ends every actor this driver started (the parts stop theirs first)."""

        def close() -> None:
            for role in self.roles.values():
                role.stop()
            ray.shutdown()

        await asyncio.to_thread(close)


def _resources(values: dict[str, float]) -> str:
    shown = {k: v for k, v in values.items() if not k.startswith(("node:", "memory", "object_store_memory"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"
