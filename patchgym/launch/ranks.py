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
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from patchgym.core.errors import ConfigError, TransportError
from patchgym.launch.context import log_dir
from patchgym.launch.engines import free_port
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
        env = {**os.environ}
        if specs and specs[0].rendezvous.address.startswith("127."):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        for spec in specs:
            command = [sys.executable, "-m", "patchgym.launch.ranks", spec.to_json()]
            self.supervisor.start(f"trainer-rank-{spec.rank}", command, env)

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
    if rendezvous.address.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would pick the host's outward interface
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


def _check_layout(tp: int, pp: int, dp: int | None, world: int | None) -> int:
    if min(tp, pp, dp or 1) < 1:
        raise ConfigError(f"tp, pp and dp must be >= 1 (got tp={tp}, pp={pp}, dp={dp})")
    if world is not None and dp is not None and tp * pp * dp != world:
        raise ConfigError(f"tp * pp * dp = {tp * pp * dp} but torchrun started {world} ranks")
    return tp * pp * (dp or 1)


def megatron_backend(model: str | Path, *, tp: int = 1, pp: int = 1, dp: int | None = None, **options: Any) -> Any:
    """The registered `megatron` factory: rank 0 of tp * pp * dp ranks, starting the others if needed.

    `options` are `MegatronTrainer`'s (lr, micro_batch_tokens, timeout_s: the collective timeout
    that bounds how long a hung rank can stall the others, ...).
    """
    from patchgym.backends.trainer.megatron import MegatronTrainer

    timeout_s = float(options.get("timeout_s", DEFAULT_TIMEOUT_S))
    world_env = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    world = _check_layout(tp, pp, dp, world_env)
    if world_env is not None or world == 1:
        return MegatronTrainer(model, tp=tp, pp=pp, **options)
    rendezvous = Rendezvous("127.0.0.1", free_port(), world)
    placement = LocalProcesses(Supervisor(log_dir("trainer")))
    trainer_options = {"tp": tp, "pp": pp, **options}
    try:
        placement.start([RankSpec(rendezvous, r, str(model), trainer_options, timeout_s) for r in range(1, world)])
        join_watching(rendezvous, placement, timeout_s)
        trainer = MegatronTrainer(model, **trainer_options)
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
    _check_layout(options.get("tp", 1), options.get("pp", 1), options.pop("dp", None), int(os.environ["WORLD_SIZE"]))
    init_distributed(None, int(os.environ["RANK"]), float(options.get("timeout_s", DEFAULT_TIMEOUT_S)))
    MegatronTrainer(model, **options).follow()


if __name__ == "__main__":
    follow_spec(RankSpec.from_json(sys.argv[1]))
