"""How a run stops when one of its processes dies: the error names the dead process, whichever part
noticed first (the watcher polling `fatal()`, or the body whose collective failed with its peer)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from patchgym.launch.lifecycle import DEFAULT_SETTLE_S, settle_time, watched
from patchgym.launch.processes import ProcessDiedError

DEATH = "trainer-rank-1 (Ray actor on node 127.0.0.2 (abc), pid 7) died; log rank1.log"


class Part:
    """A part whose process dies when `die()` is called; `fatal()` reports it `delay_s` later (as Ray
    takes a while to mark an actor dead after its peer already saw the socket close)."""

    def __init__(self, delay_s: float = 0.0, settle_s: float | None = None) -> None:
        self.delay_s = delay_s
        self.died_at: float | None = None
        if settle_s is not None:
            self.settle_s = settle_s

    def die(self) -> None:
        self.died_at = asyncio.get_running_loop().time()

    def fatal(self) -> str | None:
        if self.died_at is None or asyncio.get_running_loop().time() < self.died_at + self.delay_s:
            return None
        return DEATH


def test_the_settling_time_is_the_slowest_parts() -> None:
    assert settle_time([Part(), object()]) == DEFAULT_SETTLE_S
    assert settle_time([Part(settle_s=10.0), Part(settle_s=3.0)]) == 10.0


async def test_a_collective_that_fails_first_still_names_the_dead_process() -> None:
    """The body fails at once (its peer's socket closed) while the part reports the death only later,
    after several of the watcher's polls: the error names the death, not the collective's symptom."""
    part = Part(delay_s=0.3, settle_s=30.0)
    with pytest.raises(ProcessDiedError, match="the run stopped: trainer-rank-1") as caught:
        async with watched([part], poll_s=0.01):
            part.die()
            raise RuntimeError("Connection reset by peer")
    assert isinstance(caught.value.__cause__, RuntimeError)
    await asyncio.sleep(0)  # nothing is left pending on this task


async def test_a_death_that_takes_longer_than_the_settling_time_leaves_the_bodys_error() -> None:
    part = Part(delay_s=3600.0, settle_s=0.05)
    with pytest.raises(RuntimeError, match="Connection reset"):
        async with watched([part], poll_s=0.01):
            part.die()
            raise RuntimeError("Connection reset by peer")


async def test_a_cancellation_the_body_turned_into_an_error_does_not_outlive_the_block() -> None:
    """The watcher cancels the body, which wraps the cancellation in an error of its own: the run
    stops naming the death and its clean-up afterwards is not cancelled."""
    part = Part()
    task = asyncio.current_task()
    assert task is not None
    with pytest.raises(ProcessDiedError, match="trainer-rank-1"):
        async with watched([part], poll_s=0.01):
            part.die()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise RuntimeError("the step was interrupted") from None
    assert task.cancelling() == 0
    await asyncio.sleep(0.02)  # clean-up awaits run to completion


async def test_an_error_without_a_death_is_not_delayed_past_the_settling_time() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ValueError, match="bad batch"):
        async with watched([Part(settle_s=0.2)], poll_s=0.01):
            raise ValueError("bad batch")
    assert loop.time() - started < 60  # bounded by settle_s (0.2 s), not waiting on anything else


async def test_a_ray_call_that_failed_because_a_peer_rank_died_names_that_rank() -> None:
    """Rank 0's call fails with its own error (gloo lost its peer), not an actor error: the trainer
    asks the ranks and names the dead one and its node."""
    ray = pytest.importorskip("ray")
    from patchgym.launch.ray_trainer import RayTrainer

    dead_rank = SimpleNamespace(describe=lambda: DEATH)
    asked: list[dict[str, Any]] = []

    def dead(**kwargs: Any) -> list[Any]:
        asked.append(kwargs)
        return [dead_rank]

    trainer = RayTrainer.__new__(RayTrainer)
    trainer.ranks = SimpleNamespace(dead=dead, check_s=7.0)
    trainer.rank0 = SimpleNamespace(describe=lambda: "trainer-rank-0 is running")

    async def failed_call() -> None:
        cause = RuntimeError("[/gloo/transport/tcp/pair.cc] Connection reset by peer")
        raise ray.exceptions.RayTaskError("call", "Traceback ...", cause)

    with pytest.raises(ProcessDiedError, match="a trainer rank is gone: trainer-rank-1.*127.0.0.2"):
        await trainer._guarded(failed_call())
    assert asked == [{"wait_s": 7.0, "strict": True}]
    assert trainer.settle_s == 7.0

    trainer.ranks = SimpleNamespace(dead=lambda **_: [], check_s=7.0)
    with pytest.raises(ray.exceptions.RayTaskError):  # no rank is gone: the call's own error stands
        await trainer._guarded(failed_call())


async def test_every_trainer_call_the_ray_proxy_makes_is_one_rank_0_serves(tmp_path: Any) -> None:
    """A method the proxy forwards that rank 0's actor does not serve fails only on a real cluster
    (the export step did): each proxied call's name must be in `SERVED`, and reach the trainer."""
    pytest.importorskip("ray")
    from patchgym.launch.ray_trainer import SERVED, RankActor, RayTrainer

    forwarded: list[str] = []
    trainer = RayTrainer.__new__(RayTrainer)

    async def call(method: str, *args: Any) -> Any:
        forwarded.append(method)
        return [] if method == "weight_stages" else None

    trainer._call = call  # type: ignore[method-assign]
    trainer._stages = None
    calls = {
        "logprobs": (None,),
        "train_step": (None, None),
        "set_lr": (1e-3,),
        "reset_optimizer": (),
        "weights": (),
        "weight_stages": (),
        "open_weight_groups": ([],),
        "broadcast_weights": ([], []),
        "save": (tmp_path,),
        "load": (tmp_path,),
        "export": (tmp_path,),
    }
    for name, args in calls.items():
        await getattr(trainer, name)(*args)
    assert forwarded and set(forwarded) <= set(SERVED), set(forwarded) - set(SERVED)

    served: list[str] = []

    class Trainer:
        def __getattr__(self, name: str) -> Any:
            async def method(*args: Any) -> str:
                served.append(name)
                return name

            return method

    actor = RankActor.__new__(RankActor)
    actor.trainer = Trainer()
    for name in forwarded:
        assert await actor.call(name) == name
    with pytest.raises(AttributeError, match="does not serve 'aclose'"):
        await actor.call("aclose")
