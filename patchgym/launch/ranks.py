"""Trainer ranks: the driver is rank 0, the pipeline starts the others and they follow it.

`trainer: {name: megatron, options: {tp, pp, dp}}` asks for tp * pp * dp ranks. Outside
torchrun the driver places ranks 1..N-1 itself (`LocalProcesses`: one process each on this
machine, started with `python -m patchgym.launch.ranks SPEC`), all meeting at a TCP rendezvous
on 127.0.0.1 (`Rendezvous`), and joins the group as rank 0 while watching them: a rank that
exits while the group forms is reported with its log at once. Each follower builds the same
trainer and runs `follow()` until rank 0 closes it. A `Placement` only has to start ranks from
`RankSpec`s and report the dead ones, so placing them as Ray actors later is another class
running the same `follow_spec`.

Under torchrun (WORLD_SIZE set) nothing is started: the ranks torchrun made meet through its
environment, and `torchrun_follower()` tells a `patchgym run` on ranks other than 0 to follow.

`plan_ranks` checks the layout (`MegatronLayout`) and decides the followers before anything
starts, and `rank_process` renders a follower's process; `patchgym run --dry-run` shows the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from patchgym.backends.trainer.parallel import MegatronLayout
from patchgym.core.errors import ConfigError, TransportError
from patchgym.launch.context import log_dir
from patchgym.launch.engines import free_port
from patchgym.launch.plan import ProcessPlan, Where
from patchgym.launch.processes import Child, Supervisor

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one process group meet: `address:port`, `world_size` ranks."""

    address: str
    port: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 < self.port < 65536:
            raise ConfigError(f"bad rendezvous {self}: world_size >= 1 and a port in 1..65535")

    @property
    def init_method(self) -> str:
        return f"tcp://{self.address}:{self.port}"


@dataclass(frozen=True)
class RankSpec:
    """Everything a follower rank needs: the rendezvous, its rank, and the trainer to build."""

    rendezvous: Rendezvous
    rank: int
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        data = json.loads(text)
        return cls(**{**data, "rendezvous": Rendezvous(**data["rendezvous"])})


class Placement(Protocol):
    """Starts follower ranks somewhere and watches them."""

    def start(self, specs: list[RankSpec]) -> None: ...

    def dead(self) -> list[Child]: ...

    def check(self) -> None: ...

    def stop(self) -> None: ...


class LocalProcesses:
    """One process per follower rank on this machine, under a `Supervisor`."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def start(self, specs: list[RankSpec]) -> None:
        for spec in specs:
            process = rank_process(spec)
            self.supervisor.start(process.name, list(process.argv), process.environ())

    def dead(self) -> list[Child]:
        return self.supervisor.dead()

    def check(self) -> None:
        self.supervisor.check()

    def stop(self) -> None:
        self.supervisor.stop()


def init_distributed(rendezvous: Rendezvous | None, rank: int, timeout_s: float) -> None:
    """Join the default process group: at `rendezvous`, or from torchrun's environment when None."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if rendezvous is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    os.environ.update(loopback_env(rendezvous.address))
    dist.init_process_group(
        backend, init_method=rendezvous.init_method, rank=rank, world_size=rendezvous.world_size, timeout=timeout
    )


def join_watching(rendezvous: Rendezvous, placement: Placement, timeout_s: float) -> None:
    """Join as rank 0 while watching the followers: one that exits fails this at once, with its log,
    and a cancelled run (Ctrl-C) stops waiting."""
    failure: list[BaseException] = []

    def join() -> None:
        try:
            init_distributed(rendezvous, 0, timeout_s)
        except BaseException as exc:  # reported by the caller
            failure.append(exc)

    try:  # called from a coroutine (patchgym run), Ctrl-C cancels its task: stop waiting then
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    thread = threading.Thread(target=join, name="patchgym-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        placement.check()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        thread.join(0.5)
    if failure:
        raise TransportError(
            f"the trainer ranks did not meet at {rendezvous.init_method} within {timeout_s:.0f} s: {failure[0]}"
        )


def torchrun_rank() -> int | None:
    """This process's rank under torchrun (or another env:// launcher), None outside one."""
    return int(os.environ.get("RANK", "0")) if "WORLD_SIZE" in os.environ else None


def torchrun_follower() -> bool:
    """Whether this is a rank other than 0 under torchrun: it follows rank 0 instead of running the pipeline."""
    return (torchrun_rank() or 0) > 0


def torchrun_world() -> int | None:
    """The world size a launcher such as torchrun set (WORLD_SIZE), None outside one."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def loopback_env(address: str, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a rank meeting at `address` adds to `base`: gloo on loopback for a 127.* rendezvous
    (it would pick the host's outward interface), unless `base` names an interface."""
    if address.startswith("127.") and "GLOO_SOCKET_IFNAME" not in base:
        return {"GLOO_SOCKET_IFNAME": "lo"}
    return {}


def rank_process(spec: RankSpec, base: Mapping[str, str] = os.environ) -> ProcessPlan:
    """The process of follower rank `spec.rank` on this machine: `python -m patchgym.launch.ranks SPEC`
    (gloo on loopback unless `base` already names an interface; on a GPU machine, GPU `rank`)."""
    env = loopback_env(spec.rendezvous.address, base) | {"LOCAL_RANK": str(spec.rank)}
    argv = (sys.executable, "-m", "patchgym.launch.ranks", spec.to_json())
    where = Where(host=spec.rendezvous.address)
    return ProcessPlan(f"trainer-rank-{spec.rank}", "trainer", where, argv, env, rank=spec.rank)


@dataclass(frozen=True)
class RanksPlan:
    """The megatron backend's ranks: its layout, and the followers this process starts (none under
    torchrun or for a single rank)."""

    layout: MegatronLayout
    trainer_options: dict[str, Any]
    rendezvous: Rendezvous | None = None
    followers: tuple[RankSpec, ...] = ()
    torchrun: bool = False


def plan_ranks(
    model: str | Path,
    *,
    ports: Callable[[], int],
    world: int | None,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    **options: Any,
) -> RanksPlan:
    """The ranks `megatron_backend` runs for these options, checked, starting nothing; `world` is the
    world size of a launcher that started them (torchrun), and `ports` gives the rendezvous port."""
    ep, etp = options.get("ep", 1), options.get("etp")
    layout = MegatronLayout.from_options(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, world=world)
    trainer_options = {"tp": tp, "pp": pp, **options}
    if world is not None or layout.world == 1:
        return RanksPlan(layout, trainer_options, torchrun=world is not None)
    timeout_s = float(options.get("timeout_s", DEFAULT_TIMEOUT_S))
    # ranks on one machine share its cores: torch's default (every core each) makes them spin in each other's way
    trainer_options.setdefault("threads", max(1, (os.cpu_count() or 1) // layout.world))
    rendezvous = Rendezvous("127.0.0.1", ports(), layout.world)
    followers = tuple(RankSpec(rendezvous, r, str(model), trainer_options, timeout_s) for r in range(1, layout.world))
    return RanksPlan(layout, trainer_options, rendezvous, followers)


def megatron_backend(model: str | Path, *, tp: int = 1, pp: int = 1, dp: int | None = None, **options: Any) -> Any:
    """The registered `megatron` factory: rank 0 of tp * pp * dp ranks, starting the others if needed.

    `options` are `MegatronTrainer`'s (lr, micro_batch_tokens, ep, etp, timeout_s: the collective
    timeout that bounds how long a hung rank can stall the others, ...).

    Args:
        model: the policy's Hugging Face folder (the pipeline passes model.path); converted to Megatron on load
        tp: tensor-parallel size
        pp: pipeline-parallel size
        dp: data-parallel size (null: the ranks left over); also takes MegatronTrainer's options (lr,
            micro_batch_tokens, ep, etp, timeout_s, ...)
    """
    from patchgym.backends.trainer.megatron import MegatronTrainer

    plan = plan_ranks(model, ports=free_port, world=torchrun_world(), tp=tp, pp=pp, dp=dp, **options)
    if plan.rendezvous is None:
        return MegatronTrainer(model, **plan.trainer_options)
    placement = LocalProcesses(Supervisor(log_dir("trainer")))
    timeout_s = plan.followers[0].timeout_s
    try:
        placement.start(list(plan.followers))
        join_watching(plan.rendezvous, placement, timeout_s)
        trainer = MegatronTrainer(model, **plan.trainer_options)
    except BaseException:
        placement.stop()
        raise
    trainer.placement = placement
    return trainer


def follow_spec(spec: RankSpec) -> None:
    """A follower rank: join the group, build the trainer, run rank 0's calls until it stops."""
    from patchgym.backends.trainer.megatron import MegatronTrainer

    init_distributed(spec.rendezvous, spec.rank, spec.timeout_s)
    MegatronTrainer(spec.model, **spec.options).follow()


def follow_torchrun(model: str | Path, options: dict[str, Any]) -> None:
    """A torchrun rank other than 0 of `patchgym run`: join (rank 0 joins once the model exists), then follow."""
    from patchgym.backends.trainer.megatron import MegatronTrainer

    options = dict(options)
    dp = options.pop("dp", None)
    MegatronLayout.from_options(
        tp=options.get("tp", 1), pp=options.get("pp", 1), dp=dp, ep=options.get("ep", 1), etp=options.get("etp"),
        world=int(os.environ["WORLD_SIZE"]),
    )  # fmt: skip
    init_distributed(None, int(os.environ["RANK"]), float(options.get("timeout_s", DEFAULT_TIMEOUT_S)))
    MegatronTrainer(model, **options).follow()


if __name__ == "__main__":
    follow_spec(RankSpec.from_json(sys.argv[1]))
