"""Cluster mode: the `cluster:` settings of a run and the placement they describe, without Ray.

```yaml
cluster:
  backend: ray
  address: 10.0.0.1:6379             # the head's GCS (`ray start --head --port 6379`); auto: a local cluster
  nccl_socket_ifname: ens50f0        # pinned interface for NCCL (a duplicate Docker address hung a sync)
  gloo_socket_ifname: ens50f0
  env: {HIP_FORCE_DEV_KERNARG: "1"}  # for every trainer rank and engine started on the cluster
  trainer: {num_gpus: 1, resources: {trainer_node: 1}}   # each trainer rank's bundle
  engines: {num_gpus: 1}                                 # each engine's bundle (default: its tp GPUs)
  nodes:                             # the cluster's nodes, for `patchgym run --dry-run` to place on
    - {name: trainer, address: 10.0.0.1, gpus: 8, gpu_memory_gb: 288, resources: {trainer_node: 8}}
    - {name: inference, count: 3, gpus: 8, gpu_memory_gb: 288, resources: {engine_node: 8}}
```

`ClusterSettings` is that block; `RayPlacement` is what it asks of the cluster for one run: a
bundle per trainer rank (tp * pp * dp of them) and one per launched engine, each role in one
placement group with its strategy, checked on construction. Which rank sits on which node is
decided once the groups are placed (`rank_order`: a node's bundles take consecutive ranks, so a
tensor-parallel group stays on one node). `patchgym.launch.ray_cluster` starts the actors; this
module imports no Ray, so it can be checked and shown anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from patchgym.core.errors import ConfigError

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
RAY_START_PREFIX = "RAY_EXPERIMENTAL_NOSET_"
"""Variables Ray reads where `ray start` runs (which GPUs a worker sees), not from a run's actors."""


class RoleResources(BaseModel):
    """What Ray reserves for each member of a role (a trainer rank, an engine), and how they are spread."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(1.0, ge=0, description="logical CPUs per member")
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs per member (default: 1 per trainer rank, tp per engine, 0 for CPU engines)"
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources per member, e.g. {node1: 1} to pin it to a node"
    )
    strategy: Strategy = Field("PACK", description="placement group strategy of the role's bundles")


class ClusterNode(BaseModel):
    """A node of the cluster (or `count` alike), as `patchgym run --dry-run` places on it: Ray places the
    real run on the nodes it has, by the same resources (pin roles to nodes with custom resources)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="its name in the plan (with count > 1: NAME-0, NAME-1, ...)")
    count: int = Field(1, ge=1, description="how many nodes alike")
    address: str | None = Field(None, description="its address (count 1; default: its name)")
    gpus: int = Field(0, ge=0, description="GPUs on the node")
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="memory of each GPU in GB (10^9 bytes; MI355X 288, H200 141, H100 80): the dry run "
        "checks each process's memory estimate against it"
    )  # fmt: skip
    cpus: float | None = Field(None, gt=0, description="logical CPUs Ray offers (default: not checked)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources (ray start --resources)")

    def expand(self) -> list[ClusterNode]:
        """One `ClusterNode` per node (names NAME-i when count > 1)."""
        if self.count == 1:
            return [self.model_copy(update={"address": self.address or self.name})]
        if self.address is not None:
            raise ConfigError(f"cluster.nodes {self.name!r}: address names one node, but count is {self.count}")
        names = [f"{self.name}-{i}" for i in range(self.count)]
        return [self.model_copy(update={"name": name, "count": 1, "address": name}) for name in names]


class ClusterSettings(BaseModel):
    """`cluster:` of a run: where trainer ranks and engines run (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["ray"] = Field(description="the cluster manager (ray)")
    address: str = Field("auto", description="Ray's address: the head's GCS host:port, or auto")
    namespace: str = Field("patchgym", description="Ray namespace of the run's actors")
    nccl_socket_ifname: str | None = Field(None, description="NCCL_SOCKET_IFNAME of every rank and engine")
    gloo_socket_ifname: str | None = Field(None, description="GLOO_SOCKET_IFNAME of every rank and engine")
    env: dict[str, str] = Field(default_factory=dict, description="environment of every rank and engine")
    trainer: RoleResources = Field(default_factory=RoleResources, description="each trainer rank's bundle")
    engines: RoleResources = Field(default_factory=RoleResources, description="each launched engine's bundle")
    start_timeout_s: float = Field(
        600.0, gt=0, description="for the placement groups to be placed and every actor to be up"
    )
    stop_timeout_s: float = Field(60.0, ge=0, description="for actors to stop cleanly before they are killed")
    unreachable_s: float = Field(
        30.0, gt=0, description="an actor unreachable this long counts as dead (Ray may declare it dead sooner)"
    )
    check_timeout_s: float = Field(
        10.0, gt=0, description="how long a liveness check (before each weight sync, after a failed call) waits"
    )
    nodes: list[ClusterNode] = Field(
        default_factory=list,
        description="the cluster's nodes, for `--dry-run` to place trainer ranks and engines on (Ray places the "
        "real run); none: the dry run shows the placement groups without nodes",
    )

    @field_validator("env")
    @classmethod
    def _not_ray_start_settings(cls, env: dict[str, str]) -> dict[str, str]:
        misplaced = sorted(name for name in env if name.startswith(RAY_START_PREFIX))
        if misplaced:
            raise ValueError(
                f"{', '.join(misplaced)} belong in the environment of `ray start` on every node, not in cluster.env "
                "(Ray decides which GPUs its workers see where `ray start` runs; an actor's environment comes too "
                f"late): e.g. `{misplaced[0]}=1 ray start ...` (deploy/Dockerfile.rocm sets it), and drop it here"
            )
        return env

    def node_list(self) -> list[ClusterNode]:
        """`nodes`, one entry per node; names must be unique."""
        found = [node for spec in self.nodes for node in spec.expand()]
        names = [node.name for node in found]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ConfigError(f"cluster.nodes names {', '.join(twice)} more than once")
        return found

    def actor_env(self) -> dict[str, str]:
        """The environment every rank and engine gets: the pinned interfaces, then `env`."""
        pinned = {"NCCL_SOCKET_IFNAME": self.nccl_socket_ifname, "GLOO_SOCKET_IFNAME": self.gloo_socket_ifname}
        return {**{k: v for k, v in pinned.items() if v is not None}, **self.env}


def _bundle(role: RoleResources, gpus: float) -> dict[str, float]:
    bundle = {"CPU": role.num_cpus, "GPU": gpus, **role.resources}
    return {k: float(v) for k, v in bundle.items() if v}


@dataclass(frozen=True)
class RolePlacement:
    """`count` members of one role, each reserving `bundle`, placed as one group with `strategy`."""

    role: str
    count: int
    bundle: Mapping[str, float]
    strategy: Strategy = "PACK"

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ConfigError(f"{self.role}: {self.count} members")
        negative = {k: v for k, v in self.bundle.items() if v < 0}
        if negative:
            raise ConfigError(f"cluster.{self.role}: resources must be >= 0, not {negative}")
        if self.count and not any(self.bundle.values()):
            raise ConfigError(
                f"cluster.{self.role} reserves nothing per member: Ray places only bundles that ask for some "
                "resource; set num_cpus, num_gpus or a custom resource"
            )

    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in range(self.count)]


@dataclass(frozen=True)
class RayPlacement:
    """The run's demands on the cluster: trainer ranks as tp x dp x pp, and the launched engines."""

    trainer: RolePlacement
    engines: RolePlacement
    tp: int = 1
    pp: int = 1
    dp: int = 1
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise ConfigError(f"tp, pp and dp must be >= 1 (got tp={self.tp}, pp={self.pp}, dp={self.dp})")
        if self.trainer.count != self.world:
            raise ConfigError(f"{self.trainer.count} trainer bundles for tp*pp*dp = {self.world} ranks")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def of(
        cls,
        settings: ClusterSettings,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        engines: int = 0,
        engine_tp: int = 1,
        engine_gpus: bool = True,
    ) -> RayPlacement:
        """The placement for a Megatron trainer of tp * pp * dp ranks and `engines` launched engines
        (`engine_gpus` False: CPU engines, which reserve no GPU unless the settings say so)."""
        t, e = settings.trainer, settings.engines
        trainer_gpus = 1.0 if t.num_gpus is None else t.num_gpus
        engine_default = float(engine_tp) if engine_gpus else 0.0
        engine_gpu = engine_default if e.num_gpus is None else e.num_gpus
        return cls(
            trainer=RolePlacement("trainer", tp * pp * dp, _bundle(t, trainer_gpus), t.strategy),
            engines=RolePlacement("engines", engines, _bundle(e, engine_gpu), e.strategy),
            tp=tp,
            pp=pp,
            dp=dp,
            env=settings.actor_env(),
        )

    def rank_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """What each rank actor's `MegatronTrainer` gets from the megatron backend's `options`: all but dp
        (the ranks' world says it), with `threads` (unless given) the CPUs each rank's bundle reserves,
        at least 1: torch's default, every core of the node, makes the ranks on a node spin in each
        other's way."""
        threads = max(1, int(self.trainer.bundle.get("CPU", 1)))
        return {"threads": threads, **{k: v for k, v in options.items() if k != "dp"}}

    def stage_leader(self, stage: int) -> int:
        """The rank that sends pipeline stage `stage`'s weights (tensor and data-parallel rank 0).

        Megatron orders ranks tp first, then dp, then pp: rank = tp_rank + tp * (dp_rank + dp * pp_rank).
        """
        if not 0 <= stage < self.pp:
            raise ConfigError(f"pipeline stage {stage} of {self.pp}")
        return stage * self.tp * self.dp

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "env": sorted(self.env), "world": self.world}


def rank_order(bundle_nodes: Sequence[str]) -> list[int]:
    """The bundle each rank takes, given the node of each placed bundle: a node's bundles take
    consecutive ranks (nodes in the order their first bundle appears), so the tp ranks of a
    tensor-parallel group share a node whenever a node holds a multiple of tp bundles."""
    first: dict[str, int] = {}
    for index, node in enumerate(bundle_nodes):
        first.setdefault(node, index)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first[bundle_nodes[i]], i))


def plan_placement(
    settings: ClusterSettings, trainer_options: Mapping[str, Any], inference_options: Mapping[str, Any]
) -> RayPlacement:
    """The placement of a run's megatron trainer and sglang engines (checked; nothing is started).

    Engines attached by `urls` take no bundle. Under Ray, Ray assigns each engine its GPUs: a
    `launch.gpus` list is refused."""
    from patchgym.launch.engines import launch_settings

    tp, pp, dp = (int(trainer_options.get(k) or 1) for k in ("tp", "pp", "dp"))
    launch = inference_options.get("launch")
    if launch is None:
        return RayPlacement.of(settings, tp=tp, pp=pp, dp=dp)
    engines = launch_settings(launch)
    if engines.gpus is not None:
        raise ConfigError(
            "inference.options.launch.gpus pins GPUs on one machine; under cluster: ray, Ray assigns each engine "
            "its GPUs (cluster.engines.num_gpus, default tp): drop launch.gpus"
        )
    return RayPlacement.of(
        settings, tp=tp, pp=pp, dp=dp, engines=engines.engines, engine_tp=engines.tp, engine_gpus=not engines.cpu_venv
    )
