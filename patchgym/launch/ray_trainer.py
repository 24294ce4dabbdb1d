"""Megatron trainer ranks as Ray actors; the driver drives rank 0 through a thin proxy.

Every rank, rank 0 included, is a `RankActor` on a bundle of the trainer's placement group: the
driver node may have no GPU, and the node that holds rank 0 is the one whose address the weight
group's engines must reach. The ranks meet by env-var-free TCP rendezvous at rank 0's node
address (no torchrun); ranks 1..N-1 run `follow_spec` (as local rank processes do) and rank 0
builds the same `MegatronTrainer` and serves the driver's calls. `RayTrainer` is the `Trainer`
the pipeline holds: each call is one actor call to rank 0 (batches and results travel through
Ray's object store), and the weight broadcast to the engines runs inside the rank-0 actor (each
pipeline stage's leader hosts its weight group on its own node: `weight_group_endpoint`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import traceback
from pathlib import Path
from typing import Any

import ray

from patchgym.launch.context import log_dir
from patchgym.launch.engines import free_port
from patchgym.launch.processes import ProcessDiedError
from patchgym.launch.ranks import DEFAULT_TIMEOUT_S, RankSpec, Rendezvous, follow_spec, init_distributed
from patchgym.launch.ray_cluster import (
    Member,
    PlacedRole,
    RayCluster,
    base_gpu,
    check_paths,
    node_address,
    redirect_output,
)

SERVED = ("logprobs", "train_step", "set_lr", "reset_optimizer", "weights", "weight_stages")
SERVED += ("open_weight_groups", "broadcast_weights", "save", "load", "export")
"""The trainer methods the driver may call on rank 0."""


class RankActor:
    """One trainer rank (see the module docstring); async, so `poll` answers while the rank works."""

    def __init__(self, name: str, log: str, paths: list[str]) -> None:
        self.name = name
        check_paths(name, paths)
        redirect_output(log)
        os.environ["LOCAL_RANK"] = str(base_gpu(ray.get_gpu_ids(), os.environ))  # the GPU this rank trains on
        self.trainer: Any = None
        self.failure: str | None = None
        self.follower: threading.Thread | None = None

    async def node(self) -> dict[str, Any]:
        return {"address": node_address(), "pid": os.getpid()}

    async def free_port(self) -> int:
        """A free port on this node's address (the rendezvous and weight groups this rank hosts)."""
        return free_port(node_address())

    async def follow(self, spec: RankSpec) -> None:
        """Start following rank 0 (in a thread: this returns at once, `poll` reports its end)."""

        def run() -> None:
            try:
                follow_spec(spec)
            except BaseException:  # reported through poll()
                self.failure = f"failed:\n{traceback.format_exc(limit=8)}"
            else:
                self.failure = "stopped following rank 0"

        self.follower = threading.Thread(target=run, name="patchgym-follower", daemon=True)
        self.follower.start()

    async def lead(self, spec: RankSpec) -> dict[str, Any]:
        """Join as rank 0 and build the trainer; its settings."""
        from patchgym.backends.trainer.megatron import MegatronTrainer

        def build() -> Any:
            init_distributed(spec.rendezvous, 0, spec.timeout_s)
            return MegatronTrainer(spec.model, **spec.options)

        self.trainer = await asyncio.to_thread(build)
        return self.trainer.settings()

    async def call(self, method: str, *args: Any) -> Any:
        if method not in SERVED:
            raise AttributeError(f"rank 0 does not serve {method!r}")
        return await getattr(self.trainer, method)(*args)

    async def poll(self) -> str | None:
        """None while this rank works; why it stopped otherwise."""
        return self.failure

    async def close(self) -> None:
        """Rank 0: release the followers (bounded by the trainer's stop_timeout_s)."""
        if self.trainer is not None:
            await self.trainer.aclose()


class RayTrainer:
    """The pipeline's `Trainer`: Megatron rank 0 in a Ray actor, the other ranks following it."""

    def __init__(
        self, cluster: RayCluster, ranks: PlacedRole, model: str, options: dict[str, Any], timeout_s: float
    ) -> None:
        self.cluster = cluster
        self.ranks = ranks
        self.model = model
        self.options = options
        self.timeout_s = timeout_s
        self.rank0 = ranks.members[0]
        self._settings: dict[str, Any] = {}
        self._stages: Any = None

    @property
    def micro_batch_tokens(self) -> int:
        """The trainer's token budget per micro-batch (the SFT trace cap uses it)."""
        return int(self._settings.get("micro_batch_tokens", self.options.get("micro_batch_tokens", 8192)))

    async def start(self) -> None:
        """The ranks meet at rank 0's node address and build the model; a rank that dies meanwhile
        stops this at once, naming it."""
        port = await self.rank0.actor.free_port.remote()
        rendezvous = Rendezvous(self.rank0.address, port, len(self.ranks.members))
        specs = [
            RankSpec(rendezvous, r, self.model, self.options, self.timeout_s) for r in range(rendezvous.world_size)
        ]
        await asyncio.gather(
            *(m.actor.follow.remote(s) for m, s in zip(self.ranks.members[1:], specs[1:], strict=True))
        )
        lead = asyncio.ensure_future(self._guarded(self.rank0.actor.lead.remote(specs[0])))
        while not lead.done():
            self.ranks.check()
            await asyncio.wait([lead], timeout=1.0)
        self._settings = lead.result()

    @property
    def settle_s(self) -> float:
        """How long a rank's death may take to show after a call failed (the cluster's `check_timeout_s`)."""
        return self.ranks.check_s

    async def _guarded(self, ref: Any) -> Any:
        """Await a call to rank 0. When it fails and a rank is gone (rank 0 itself, or a peer whose
        death broke rank 0's collective first), the error is a `ProcessDiedError` naming that rank."""
        try:
            return await ref
        except ray.exceptions.RayError as exc:
            dead = await asyncio.to_thread(self.ranks.dead, wait_s=self.ranks.check_s, strict=True)
            if dead:
                raise ProcessDiedError(f"a trainer rank is gone: {dead[0].describe()}") from exc
            if isinstance(exc, ray.exceptions.RayActorError):
                raise ProcessDiedError(f"a trainer rank is gone: {self.rank0.describe()}: {exc}") from None
            raise

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._guarded(self.rank0.actor.call.remote(method, *args))

    # -- the Trainer protocol (and what WeightSync asks of a Megatron trainer) -----------------
    async def logprobs(self, batch: Any) -> Any:
        return await self._call("logprobs", batch)

    async def train_step(self, batch: Any, loss: Any) -> dict[str, float]:
        return await self._call("train_step", batch, loss)

    async def set_lr(self, lr: float) -> None:
        await self._call("set_lr", lr)

    async def reset_optimizer(self) -> None:
        await self._call("reset_optimizer")

    async def weights(self, export_to: Path | None = None) -> Any:
        return await self._call("weights", export_to)

    async def weight_stages(self) -> Any:
        if self._stages is None:
            self._stages = await self._call("weight_stages")
        return self._stages

    async def open_weight_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return await self._call("open_weight_groups", groups)

    async def broadcast_weights(self, groups: list[dict[str, Any]], buckets: list[list[list[str]]]) -> Any:
        return await self._call("broadcast_weights", groups, buckets)

    async def weight_group_endpoint(self, stage: int) -> tuple[str, int]:
        """Where pipeline stage `stage`'s weight group meets: its leader rank's node, a port free there."""
        leader = self.ranks.members[self.cluster.placement.stage_leader(stage)]
        return leader.address, await self._guarded(leader.actor.free_port.remote())

    async def save(self, directory: Path) -> None:
        await self._call("save", Path(directory))

    async def load(self, directory: Path) -> None:
        await self._call("load", Path(directory))

    async def export(self, directory: Path) -> Path:
        return await self._call("export", Path(directory))

    def settings(self) -> dict[str, Any]:
        ranks = [{"rank": r, "address": m.address, "node_id": m.node_id} for r, m in enumerate(self.ranks.members)]
        return {**self._settings, "ranks_started_by": "ray", "ranks": ranks}

    def fatal(self) -> str | None:
        """Why training cannot go on: a rank's actor, process or node is gone (else None)."""
        dead = self.ranks.dead()
        return dead[0].describe() if dead else None

    async def aclose(self) -> None:
        """Rank 0 releases the followers (bounded), then every rank's actor is killed."""
        stop_s = self.cluster.config.stop_timeout_s
        if self.fatal() is None and self._settings:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                await asyncio.wait_for(self.rank0.actor.close.remote(), stop_s)
        await asyncio.to_thread(self.ranks.stop)


def ray_megatron(cluster: RayCluster, model: str | Path, **options: Any) -> RayTrainer:
    """Place the trainer's ranks (`cluster.placement.trainer`) and start their actors (not the group:
    `RayTrainer.start` forms it); `options` are the megatron backend's (tp, pp, dp, lr, ...)."""
    from patchgym.launch.cluster import rank_order

    options = cluster.placement.rank_options(options)
    role = cluster.placement.trainer
    logs = log_dir("trainer")
    logs.mkdir(parents=True, exist_ok=True)
    group, nodes = cluster.place(role)
    addresses = cluster.addresses()
    remote = ray.remote(RankActor)
    members = []
    for rank, bundle in enumerate(rank_order(nodes)):
        name, log = f"trainer-rank-{rank}", str(logs / f"trainer-rank-{rank}.log")
        actor = remote.options(**cluster.actor_options(role, group, bundle)).remote(name, log, [str(model), str(logs)])
        members.append(Member(name, actor, bundle, nodes[bundle], addresses.get(nodes[bundle], "?"), log))
    placed = PlacedRole(role, group, members, cluster.config)
    cluster.roles["trainer"] = placed
    try:
        infos = cluster.wait([m.actor.node.remote() for m in members], "the trainer ranks' actors")
    except BaseException:
        placed.stop()
        raise
    for member, info in zip(members, infos, strict=True):
        member.address, member.pid = info["address"], info["pid"]
    timeout_s = float(options.get("timeout_s", DEFAULT_TIMEOUT_S))
    return RayTrainer(cluster, placed, str(model), options, timeout_s)
