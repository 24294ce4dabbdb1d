"""`patchgym run --dry-run`: the launch plan of a run configuration, starting nothing.

The plan comes from the same functions the launch uses (`plan_sglang`, `plan_ranks`,
`rank_process`, SGLang's `server_command`), with stand-in ports instead of free ones and the CPU
SGLang venv's path instead of a build; no process, port, download or venv is made, and no GPU is
needed. The placement is an input (`Placer`); today's, `LocalPlacer`, runs every process on the
machine `patchgym run` runs on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from patchgym.backends.trainer.parallel import ModelShape, check_split
from patchgym.core.errors import ConfigError
from patchgym.core.plugins import Kind, LazyFactory, registry
from patchgym.launch.engines import SGLangPlan, plan_sglang, require_router, sglang_backend
from patchgym.launch.plan import LaunchPlan, LocalPlacer, Placer, PlannedPorts, ProcessPlan, Where, spans
from patchgym.launch.ranks import RanksPlan, loopback_env, megatron_backend, plan_ranks, rank_process, torchrun_world
from patchgym.pipeline.config import RunConfig
from patchgym.pipeline.run import check_files, check_parts, model_dir

NO_GPU_PLACEMENT = (
    "the Megatron trainer keeps its model on the CPU: it has no GPU placement yet, so on GPU machines its ranks "
    "do not run (docs/recipes/gpu.md)"
)


def _factory(kind: Kind, name: str) -> Callable[..., Any]:
    factory = registry().registration(kind, name).factory
    return factory.load() if isinstance(factory, LazyFactory) else factory


def plan_run(config: RunConfig, command: Sequence[str], placer: Placer | None = None) -> LaunchPlan:
    """Every process `command` (a `patchgym run` of `config`) would start, after the checks it makes first,
    placed by `placer` (default: `LocalPlacer`, everything on this machine)."""
    placer = placer or LocalPlacer()
    check_parts(config)
    notes: list[str] = []
    try:
        check_files(config)
    except ConfigError as exc:
        notes.append(f"{exc} here: the run would stop on it")
    model = model_dir(config)
    if config.model.path is None:
        notes.append(f"the model is created when the run starts, in {model} (model.init_tiny)")
    ports = PlannedPorts()
    runs = ["rollout loop, evaluation, checkpoints", f"sandboxes: {config.sandbox.name}"]
    processes: list[ProcessPlan] = []
    engines = SGLangPlan((), None, ())
    if _factory("inference", config.inference.name) is sglang_backend:
        engines = plan_sglang(str(model), build=False, ports=ports, **config.inference.options)
        processes += engines.processes
        notes += _engine_notes(engines)
        runs.append(f"inference: SGLang client of {len(engines.engine_urls)} servers")
    else:
        runs.append(f"inference: {config.inference.name}, in this process")
    driver = ProcessPlan("driver", "driver", Where(), tuple(command), runs=tuple(runs))
    layout = None
    if _factory("trainer", config.trainer.name) is megatron_backend:
        ranks = plan_ranks(str(model), ports=ports, world=torchrun_world(), **config.trainer.options)
        layout = ranks.layout
        driver = _rank_zero(driver, ranks)
        processes += [replace(rank_process(spec), coords=layout.coords(spec.rank)) for spec in ranks.followers]
        notes.append(_check_model(model, config.trainer.options))
        notes.append(NO_GPU_PLACEMENT)
        if ranks.torchrun:
            notes.append(f"ranks 1..{layout.world - 1} are torchrun's (WORLD_SIZE is set): this run starts none")
    else:
        driver = replace(driver, runs=(*driver.runs, f"trainer: {config.trainer.name}, in this process"))
    pinned = sorted(gpu for p in processes for gpu in p.where.gpus)
    if pinned:
        where = f"GPUs {spans(pinned)} of this machine ({len(pinned)} GPUs)"
        notes.append(f"the engines pin {where}: today's placement runs every process here")
    if ports.given:
        notes.append(
            f"ports {ports.given[0]}-{ports.given[-1]} stand in for the free ports of 127.0.0.1 that `patchgym run` "
            "takes when it starts each process"
        )
    plan = LaunchPlan(
        placement=placer.name,
        processes=(driver, *processes),
        layout=layout,
        engine_urls=engines.engine_urls,
        router_url=engines.router_url,
        notes=tuple(notes),
    )
    return placer.place(plan)


def _check_model(model: Path, options: dict[str, Any]) -> str:
    """Check the model's shape against the layout when its config.json is here (a bad split is an error)."""
    config_json = model / "config.json"
    if not config_json.is_file():
        return f"the model's shape is not checked against the layout: no {config_json} here"
    try:
        shape = ModelShape.from_hf(json.loads(config_json.read_text()))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read the model's shape from {config_json}: {exc!r}") from None
    tp, pp, ep, etp = options.get("tp", 1), options.get("pp", 1), options.get("ep", 1), options.get("etp")
    check_split(shape, tp=tp, pp=pp, ep=ep, etp=etp)
    return f"the model's shape ({config_json}) splits as the layout needs"


def _rank_zero(driver: ProcessPlan, ranks: RanksPlan) -> ProcessPlan:
    """The driver as trainer rank 0 (and the rendezvous host of the ranks it starts)."""
    env = loopback_env(ranks.rendezvous.address) if ranks.rendezvous else {}
    runs = (*driver.runs, f"trainer: Megatron rank 0 of {ranks.layout.world}")
    return replace(driver, env=env, rank=0, coords=ranks.layout.coords(0), runs=runs)


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
