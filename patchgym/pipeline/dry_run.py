"""`patchgym run --dry-run`: the launch plan of a run configuration, starting nothing.

The plan comes from the same functions the launch uses (`plan_sglang`, `plan_ranks`,
`rank_process`, `engine_process`, `plan_placement`, SGLang's `server_command`), with stand-in
ports instead of free ones and the CPU SGLang venv's path instead of a build; no process, port,
download or venv is made, and no GPU is needed. Without `cluster:` every process runs on the
machine `patchgym run` runs on (`LocalPlacer`): on a GPU machine trainer rank r binds GPU r, the
engines their `launch.gpus`. With `cluster:` the trainer ranks and engines are Ray actors, placed
on the nodes `cluster.nodes` lists (`launch.placement.place_roles`). Each trainer rank and engine
gets a GPU memory estimate (`launch.memory`) when the model's shape is known (its config.json, or
`model.hf_config`); the plan refuses GPUs given twice or missing and estimates beyond a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from patchgym.backends.inference.sglang_launch import SERVER_CONTEXT_HEADROOM
from patchgym.backends.trainer.parallel import MegatronLayout, check_split
from patchgym.core.errors import ConfigError
from patchgym.core.plugins import Kind, LazyFactory, registry
from patchgym.launch.cluster import ClusterNode, plan_placement, rank_order
from patchgym.launch.engines import (
    EngineLaunch,
    SGLangPlan,
    engine_process,
    engine_runtime,
    launch_settings,
    plan_sglang,
    require_router,
    router_process,
    server_settings,
    sglang_backend,
)
from patchgym.launch.memory import (
    ESTIMATE_DEFAULTS,
    GB,
    MemoryEstimate,
    ModelDims,
    TrainerMemorySettings,
    engine_memory,
    trainer_memory,
)
from patchgym.launch.placement import Slot, place_roles
from patchgym.launch.plan import LOCAL, LaunchPlan, LocalPlacer, Placer, PlannedPorts, ProcessPlan, Where, spans
from patchgym.launch.ranks import RanksPlan, loopback_env, megatron_backend, plan_ranks, rank_process, torchrun_world
from patchgym.pipeline.checks import check_files, check_parts, model_dir
from patchgym.pipeline.config import RunConfig
from patchgym.pipeline.model_source import is_hub_id


def _factory(kind: Kind, name: str) -> Callable[..., Any]:
    factory = registry().registration(kind, name).factory
    return factory.load() if isinstance(factory, LazyFactory) else factory


@dataclass(frozen=True)
class Device:
    """The GPUs of a node as the estimates see them: how many, and each one's memory (None: unknown)."""

    count: int | None = None
    memory: float | None = None

    @classmethod
    def here(cls) -> Device:
        """This machine's GPUs (torch's view), unknown without any."""
        import torch

        if not torch.cuda.is_available() or not torch.cuda.device_count():
            return cls()
        return cls(torch.cuda.device_count(), float(torch.cuda.get_device_properties(0).total_memory))

    @classmethod
    def of(cls, node: ClusterNode) -> Device:
        return cls(node.gpus, None if node.gpu_memory_gb is None else node.gpu_memory_gb * GB)


class Estimator:
    """Memory estimates of a run's trainer ranks and engines (none where the model's shape is unknown)."""

    def __init__(self, config: RunConfig, dims: ModelDims | None) -> None:
        self.dims = dims
        self.trainer = TrainerMemorySettings.from_options(config.trainer.options)
        self.max_context = int(config.inference.options.get("max_context") or 0)

    def rank(self, layout: MegatronLayout | None, rank: int, device: Device) -> MemoryEstimate | None:
        if self.dims is None or layout is None:
            return None
        return trainer_memory(self.dims, layout, self.trainer, rank, device.memory)

    def engine(self, launch: EngineLaunch, device: Device) -> MemoryEstimate | None:
        if self.dims is None or launch.cpu_venv:
            return None
        context = (launch.context_length or self.max_context) + SERVER_CONTEXT_HEADROOM
        return engine_memory(
            self.dims,
            tp=launch.tp,
            dtype=launch.dtype,
            mem_fraction_static=launch.mem_fraction_static,
            context_length=context,
            device_bytes=device.memory,
        )

    def notes(self, config: RunConfig) -> list[str]:
        if self.dims is None:
            return []
        assumed = [f"{k}={v}" for k, v in ESTIMATE_DEFAULTS.items() if config.trainer.options.get(k) is None]
        notes = [
            "memory estimates are arithmetic on the model's shape and the settings (balanced expert routing; "
            "approximate, tens of percent), per GPU"
        ]
        if assumed and _factory("trainer", config.trainer.name) is megatron_backend:
            notes.append(
                "the trainer ranks' estimates take the defaults for settings the config leaves out: "
                + ", ".join(assumed)
            )
        return notes


def plan_run(config: RunConfig, command: Sequence[str], placer: Placer | None = None) -> LaunchPlan:
    """Every process `command` (a `patchgym run` of `config`) would start, after the checks it makes first,
    placed by `placer` (default: `LocalPlacer`, everything on this machine), or with `cluster:` on its nodes."""
    check_parts(config)
    notes: list[str] = []
    try:
        check_files(config)
    except ConfigError as exc:
        notes.append(f"{exc} here: the run would stop on it")
    model = model_dir(config)
    if config.model.path is not None and is_hub_id(config.model.path):
        notes.append(
            f"model.path {config.model.path!r} is a Hub id: the run downloads it into the Hugging Face cache when "
            "it starts, and every part loads that folder (the dry run downloads nothing)"
        )
    if config.model.path is None:
        notes.append(f"the model is created when the run starts, in {model} (model.init_tiny)")
    dims = _model_dims(model, config, notes)
    estimator = Estimator(config, dims)
    notes += estimator.notes(config)
    ports = PlannedPorts()
    if config.cluster is not None:
        plan = _cluster_plan(config, command, model, ports, estimator, notes)
    else:
        placer = placer or LocalPlacer()
        plan = placer.place(_local_plan(config, command, model, ports, estimator, notes, placer.name))
    if ports.given:
        plan = replace(plan, notes=(*plan.notes, _ports_note(ports)))
    return plan


def _local_plan(
    config: RunConfig,
    command: Sequence[str],
    model: Path,
    ports: PlannedPorts,
    estimator: Estimator,
    notes: list[str],
    placement: str,
) -> LaunchPlan:
    """Every process on this machine: the driver as trainer rank 0, the ranks it starts, the engines."""
    device = Device.here()
    runs = ["rollout loop, evaluation, checkpoints", f"sandboxes: {config.sandbox.name}"]
    processes: list[ProcessPlan] = []
    engines = SGLangPlan((), None, ())
    if _factory("inference", config.inference.name) is sglang_backend:
        engines = plan_sglang(str(model), build=False, ports=ports, **config.inference.options)
        if engines.launch is not None:
            engines = replace(
                engines,
                processes=tuple(
                    replace(p, memory=estimator.engine(engines.launch, device)) if p.role == "engine" else p
                    for p in engines.processes
                ),
            )
        processes += engines.processes
        notes += _engine_notes(engines)
        runs.append(f"inference: SGLang client of {len(engines.engine_urls)} servers")
    else:
        runs.append(f"inference: {config.inference.name}, in this process")
    driver = ProcessPlan("driver", "driver", Where(), tuple(command), runs=tuple(runs))
    layout = None
    gpu_machine = device.count is not None or (engines.runtime is not None and engines.runtime.device == "cuda")
    if _factory("trainer", config.trainer.name) is megatron_backend:
        ranks = plan_ranks(str(model), ports=ports, world=torchrun_world(), **config.trainer.options)
        layout = ranks.layout
        followers = [replace(rank_process(spec), coords=layout.coords(spec.rank)) for spec in ranks.followers]
        ours = [_rank_zero(driver, ranks), *followers]
        if gpu_machine:  # each rank binds GPU LOCAL_RANK = its rank (`bind_device`)
            ours = [_on_gpu(p, (p.rank or 0,), estimator.rank(layout, p.rank or 0, device)) for p in ours]
            notes.append(f"the trainer ranks bind GPUs {spans([p.rank or 0 for p in ours])} of this machine")
        driver, followers = ours[0], ours[1:]
        processes += followers
        notes.append(_check_model(estimator.dims, config.trainer.options))
        if ranks.torchrun:
            notes.append(f"ranks 1..{layout.world - 1} are torchrun's (WORLD_SIZE is set): this run starts none")
    else:
        driver = replace(driver, runs=(*driver.runs, f"trainer: {config.trainer.name}, in this process"))
    if gpu_machine and device.count is None:
        notes.append(
            "this machine shows no GPU: the plan's GPUs are not checked against a count, nor the estimates against "
            "a GPU's memory; on a machine with too few GPUs the run stops (list the nodes under cluster: to check)"
        )
    return LaunchPlan(
        placement=placement,
        processes=(driver, *processes),
        layout=layout,
        engine_urls=engines.engine_urls,
        router_url=engines.router_url,
        notes=tuple(notes),
        gpu_counts={LOCAL: device.count},
    )


def _cluster_plan(
    config: RunConfig, command: Sequence[str], model: Path, ports: PlannedPorts, estimator: Estimator, notes: list[str]
) -> LaunchPlan:
    """Trainer ranks and engines as Ray actors on `cluster.nodes` (engines placed first, as the run does);
    the driver and the router on the machine `patchgym run` starts on."""
    cluster = config.cluster
    assert cluster is not None
    trainer_options, inference_options = config.trainer.options, config.inference.options
    placement = plan_placement(cluster, trainer_options, inference_options)
    nodes = cluster.node_list()
    slots = place_roles([placement.engines, placement.trainer], nodes) if nodes else {}
    devices = {node.name: Device.of(node) for node in nodes}
    unplaced = Where(node="(Ray's choice)", host="?")
    processes: list[ProcessPlan] = []
    urls: list[str] = []
    launch = inference_options.get("launch")
    if launch is not None:
        settings = launch_settings(launch)
        runtime = engine_runtime(settings, build=False)
        max_context = inference_options["max_context"]
        base = server_settings(model, settings, max_context=max_context, runtime=runtime)
        for i in range(placement.engines.count):
            slot = slots["engines"][i] if slots else None
            host = (slot.node.address or slot.node.name) if slot else "NODE"
            process = engine_process(f"sglang-engine-{i}", base, settings, host=host, port=ports(), gpus=(), base_gpu=0)
            where = _actor_where(slot, placement.engines.bundle) if slot else replace(unplaced, host=host)
            device = devices[slot.node.name] if slot else Device()
            memory = estimator.engine(settings, device) if slot and slot.gpus else None
            runs = ("Ray actor (launch.ray_engines.EngineActor): starts this SGLang server on its node",)
            env = {**placement.env, **process.env}
            processes.append(replace(process, where=where, env=env, runs=runs, memory=memory))
            urls.append(process.url or "")
        router = inference_options.get("router") or "cache_aware"
        if router != "none":
            processes.append(router_process(urls, router, ports, inference_options.get("router_options")))
    else:  # servers started elsewhere, attached by URL (and their router, if any)
        attached = plan_sglang(str(model), build=False, ports=ports, **inference_options)
        urls = list(attached.engine_urls)
        processes += attached.processes
    layout = MegatronLayout.from_options(
        **{k: trainer_options[k] for k in ("tp", "pp", "dp", "ep", "etp") if k in trainer_options}
    )
    order = rank_order([slot.node.name for slot in slots["trainer"]]) if slots else list(range(layout.world))
    threads = placement.rank_options(trainer_options)["threads"]
    for rank, bundle in enumerate(order):
        slot = slots["trainer"][bundle] if slots else None
        role = "builds the trainer and serves the driver's calls" if rank == 0 else "follows rank 0"
        runs = (
            f"Ray actor (launch.ray_trainer.RankActor): Megatron rank {rank} of {layout.world}, {role}",
            f"{threads} torch threads",
        )
        where = _actor_where(slot, placement.trainer.bundle) if slot else unplaced
        device = devices[slot.node.name] if slot else Device()
        memory = estimator.rank(layout, rank, device) if slot and slot.gpus else None
        processes.append(
            ProcessPlan(f"trainer-rank-{rank}", "trainer", where, (), dict(placement.env), rank=rank,
                        coords=layout.coords(rank), runs=runs, memory=memory)
        )  # fmt: skip
    runs = ["rollout loop, evaluation, checkpoints", f"sandboxes: {config.sandbox.name}"]
    runs += [f"inference: SGLang client of {len(urls)} servers", "trainer: drives rank 0's actor through a proxy"]
    driver = ProcessPlan("driver", "driver", Where(), tuple(command), runs=tuple(runs))
    notes.append(_check_model(estimator.dims, trainer_options))
    if nodes:
        notes.append(
            "Ray places the run by the same bundles on the nodes it has: with custom resources that pin each role to "
            "its nodes (cluster.trainer/engines.resources) the nodes are these, and which GPU ids of a node is Ray's "
            "choice; each actor sees only its own GPUs (its engine's --base-gpu-id and its rank's LOCAL_RANK are 0) "
            "unless RAY_EXPERIMENTAL_NOSET_*=1 is set where `ray start` runs"
        )
    else:
        notes.append(
            "cluster.nodes lists no node: Ray places the actors when the run starts; list the nodes to see where"
        )
    return LaunchPlan(
        placement="ray",
        processes=(driver, *processes),
        layout=layout,
        engine_urls=tuple(urls),
        router_url=next((p.url for p in processes if p.role == "router"), None),
        notes=tuple(notes),
        gpu_counts={name: device.count for name, device in devices.items()},
    )


def _actor_where(slot: Slot, bundle: Mapping[str, float]) -> Where:
    return Where(node=slot.node.name, host=slot.node.address or slot.node.name, gpus=slot.gpus, resources=dict(bundle))


def _on_gpu(process: ProcessPlan, gpus: tuple[int, ...], memory: MemoryEstimate | None) -> ProcessPlan:
    return replace(process, where=replace(process.where, gpus=gpus), memory=memory)


def _model_dims(model: Path, config: RunConfig, notes: list[str]) -> ModelDims | None:
    """The model's shape: its config.json here, else `model.hf_config`; both: they must agree."""
    config_json = model / "config.json"
    given = config.model.hf_config
    if config_json.is_file():
        try:
            found = json.loads(config_json.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the model's shape from {config_json}: {exc!r}") from None
        differ = sorted(k for k, v in (given or {}).items() if found.get(k) != v)
        if differ:
            shown = ", ".join(f"{k}: {given[k]!r} vs {found.get(k)!r}" for k in differ if given)
            raise ConfigError(f"model.hf_config disagrees with {config_json} ({shown}): fix or drop model.hf_config")
        return ModelDims.from_hf(found)
    if given is not None:
        return ModelDims.from_hf(given)
    notes.append(f"no {config_json} here and no model.hf_config: the layout's split and memory are not checked")
    return None


def _check_model(dims: ModelDims | None, options: dict[str, Any]) -> str:
    """Check the model's shape against the layout (a bad split is an error)."""
    if dims is None:
        return "the model's shape is not checked against the layout (no config.json here, no model.hf_config)"
    tp, pp, ep, etp = options.get("tp", 1), options.get("pp", 1), options.get("ep", 1), options.get("etp")
    check_split(dims.shape, tp=tp, pp=pp, ep=ep, etp=etp)
    return "the model's shape splits as the layout needs"


def _rank_zero(driver: ProcessPlan, ranks: RanksPlan) -> ProcessPlan:
    """The driver as trainer rank 0 (and the rendezvous host of the ranks it starts)."""
    env = loopback_env(ranks.rendezvous.address) if ranks.rendezvous else {}
    runs = (*driver.runs, f"trainer: Megatron rank 0 of {ranks.layout.world}")
    return replace(driver, env=env, rank=0, coords=ranks.layout.coords(0), runs=runs)


def _ports_note(ports: PlannedPorts) -> str:
    return (
        f"ports {ports.given[0]}-{ports.given[-1]} stand in for the free ports that `patchgym run` takes when it "
        "starts each process (on 127.0.0.1, or an actor's node address)"
    )


def _engine_notes(plan: SGLangPlan) -> list[str]:
    notes = []
    if plan.runtime is not None and not plan.runtime.ready:
        notes.append(
            f"the CPU SGLang venv is not built yet ({plan.runtime.python.parent.parent}): `patchgym run` builds it "
            "first (a few minutes), or run `python -m patchgym.backends.inference.sglang_venv`"
        )
    if plan.router_url is not None:
        try:
            require_router()
        except ConfigError as exc:
            notes.append(f"{exc} (here, where `patchgym run` starts it)")
    return notes
