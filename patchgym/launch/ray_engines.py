"""SGLang engines as Ray actors: each starts its server on its node, the driver keeps the router.

`inference: {name: sglang, options: {launch: {engines: N, ...}}}` under `cluster: {backend:
ray}` places N `EngineActor`s (`cluster.placement.engines`). Each starts one SGLang server
bound to its node's address, on a port free there, with the flags of the local launch
(`engines.server_settings`), under a `Supervisor` of its own (so the server dies with the actor,
and the actor reports a server that exited). The driver attaches to the servers' URLs as to
servers started elsewhere: the SGLang router runs with the driver, bound to 127.0.0.1 (only the
rollout loop talks to it), and control calls go to each server directly. `options: {urls:
[...]}` attaches to servers started elsewhere, as without a cluster. `RayEngineGroup` is what
`SGLangEngine` calls its supervisor: it reports dead engine actors (their node, pid and log) and
stops them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from patchgym.launch.context import log_dir
from patchgym.launch.engines import (
    engine_process,
    engine_runtime,
    free_port,
    launch_settings,
    server_settings,
    sglang_backend,
)
from patchgym.launch.processes import Supervisor
from patchgym.launch.ray_cluster import (
    Member,
    PlacedRole,
    RayCluster,
    base_gpu,
    check_paths,
    node_address,
    redirect_output,
)


class EngineActor:
    """One SGLang server on this actor's node. Synchronous: its methods run on the worker's main
    thread, which the `Supervisor` needs (a child dies when the thread that started it ends)."""

    def __init__(self, name: str, logs: str, paths: list[str]) -> None:
        self.name = name
        self.logs = Path(logs)
        check_paths(name, paths)
        redirect_output(str(self.logs / "actor.log"))
        self.supervisor: Supervisor | None = None

    def node(self) -> dict[str, Any]:
        return {"address": node_address(), "pid": os.getpid()}

    def launch(self, model: str, launch: dict[str, Any], max_context: int) -> str:
        """Start the server on this node's address; its URL."""
        settings = launch_settings(launch)
        host = node_address()
        runtime = engine_runtime(settings, build=True)
        base = server_settings(Path(model), settings, max_context=max_context, runtime=runtime)
        gpu = base_gpu(ray.get_gpu_ids(), os.environ)
        process = engine_process(self.name, base, settings, host=host, port=free_port(host), gpus=(), base_gpu=gpu)
        self.supervisor = Supervisor(self.logs, stop_grace_s=settings.stop_grace_s)
        self.supervisor.start(self.name, list(process.argv), process.environ())
        assert process.url is not None
        return process.url

    def poll(self) -> str | None:
        """None while the server runs; how it ended otherwise."""
        dead = self.supervisor.dead() if self.supervisor is not None else []
        return f"lost its server: {dead[0].describe()}" if dead else None

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()


class RayEngineGroup:
    """The engines' actors (and the router the driver runs), as `SGLangEngine` sees its supervisor."""

    def __init__(self, engines: PlacedRole, router: Supervisor | None, stop_timeout_s: float) -> None:
        self.engines = engines
        self.router = router
        self.stop_timeout_s = stop_timeout_s

    @property
    def children(self) -> list[Any]:
        return [*self.engines.members, *(self.router.children if self.router is not None else [])]

    @property
    def settle_s(self) -> float:
        """How long an engine's death may take to show (the cluster's `check_timeout_s`)."""
        return self.engines.check_s

    def dead(self) -> list[Any]:
        return [*self.engines.dead(), *(self.router.dead() if self.router is not None else [])]

    def check(self) -> None:
        """Raise `ProcessDiedError` naming a gone engine (asked afresh) or a dead router."""
        self.engines.check()
        if self.router is not None:
            self.router.check()

    def stop(self) -> None:
        """The router, then each engine's server (bounded), then the actors and their placement group."""
        if self.router is not None:
            self.router.stop()
        self.engines.stop(lambda actor: actor.stop.remote(), self.stop_timeout_s)


def ray_sglang(
    cluster: RayCluster,
    model: str | Path,
    *,
    urls: str | Sequence[str] | None = None,
    launch: dict[str, Any] | None = None,
    router: str | None = None,
    router_options: Mapping[str, Any] | None = None,
    **client: Any,
) -> Any:
    """The `sglang` backend on a cluster: `launch` starts its engines as actors, `urls` attaches."""
    routing = {"router": router, "router_options": router_options}
    if launch is None:
        return sglang_backend(model, urls=urls, **routing, **client)  # nothing to place
    settings = launch_settings(launch)
    role = cluster.placement.engines
    group, nodes = cluster.place(role)
    addresses = cluster.addresses()
    remote = ray.remote(EngineActor)
    members = []
    for i in range(role.count):
        name = f"sglang-engine-{i}"
        logs = log_dir(name)
        logs.mkdir(parents=True, exist_ok=True)
        actor = remote.options(**cluster.actor_options(role, group, i)).remote(name, str(logs), [str(model), str(logs)])
        members.append(Member(name, actor, i, nodes[i], addresses.get(nodes[i], "?"), str(logs / f"{name}.log")))
    placed = PlacedRole(role, group, members, cluster.config)
    cluster.roles["engines"] = placed
    try:
        infos = cluster.wait([m.actor.node.remote() for m in members], "the SGLang engines' actors")
        for member, info in zip(members, infos, strict=True):
            member.address, member.pid = info["address"], info["pid"]
        started = [m.actor.launch.remote(str(model), settings.model_dump(), client.get("max_context")) for m in members]
        server_urls = cluster.wait(started, "the SGLang engines' actors")
        # The servers are reached as if started elsewhere; the router (if any) starts here.
        routing["router"] = router or "cache_aware"
        engine = sglang_backend(model, urls=server_urls, **routing, **client)
    except BaseException:
        placed.stop()
        raise
    engine.supervisor = RayEngineGroup(placed, engine.supervisor, cluster.config.stop_timeout_s)
    engine.ranks_per_engine = [settings.tp] * role.count
    engine.start_timeout_s = settings.health_timeout_s
    engine.launch = settings.model_dump()
    return engine
