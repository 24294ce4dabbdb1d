"""Where every group goes: capacity gating counted from the stage's first version, the group tally
(drawn = trained + set aside + pending) through cancellations, retries and filters, and a resumed
manager that restarts the pending tasks exactly once. Episodes are simulated and held by events,
not by timing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from patchgym.core.rollout import GroupTally, RolloutConfig, RolloutManager
from patchgym.core.tasks import Task
from patchgym.core.trajectory import Trajectory, Turn
from patchgym.pipeline.run import TaskStream
from tests.test_rollout import tasks


class Held:
    """Episodes that end only when released (by task id), with a reward chosen per task."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.reward = lambda task_id, n: float(n % 2)
        self.infra: set[tuple[str, int]] = set()  # (task id, attempt number) that end in an infra error

    def release(self, *task_ids: str) -> None:
        for task_id in task_ids:
            self.gates.setdefault(task_id, asyncio.Event()).set()

    async def __call__(self, task: Task) -> Trajectory:
        n = self.started.count(task.id)
        self.started.append(task.id)
        await self.gates.setdefault(task.id, asyncio.Event()).wait()
        trajectory = Trajectory(task.id, turns=[Turn("a", "o", "command")])
        if (task.id, n) in self.infra:
            trajectory.infra_error, trajectory.termination = {"kind": "sandbox_lost", "message": "gone"}, "infra_error"
        else:
            trajectory.reward, trajectory.termination = self.reward(task.id, n), "submitted"
        return trajectory


async def settle_loop() -> None:
    """Let every ready callback of the event loop run (the producer starts groups in one pass)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until `condition` holds (a bound on iterations, not on time)."""
    for _ in range(100_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def check_identity(tally: GroupTally) -> None:
    assert tally.drawn == tally.trained + sum(tally.discarded.values()) + tally.pending
    assert tally.pending >= 0


WINDOWS = [("sync", 0, 1), ("one_step_off", 0, 2), ("fully_async", 3, 4)]  # mode, max_staleness, batches in flight


@pytest.mark.parametrize("start_version", [0, 1, 21])
@pytest.mark.parametrize(("mode", "max_staleness", "window"), WINDOWS)
async def test_gating_counts_from_the_version_the_stage_starts_at(
    start_version: int, mode: str, max_staleness: int, window: int
) -> None:
    # GRPO after SFT starts at version 1, a resume at the checkpoint's version: the window is the same.
    sim = Held()
    config = RolloutConfig(mode=mode, max_staleness=max_staleness, group_size=2, batch_groups=3, concurrency=1000)
    manager = RolloutManager(iter(tasks(200)), sim, config, version=start_version)
    manager.start()
    await settle_loop()
    assert manager.tally.drawn == window * 3
    sim.release(*{t for t in sim.started})
    batch = await manager.next_batch()
    assert batch is not None and batch.version == start_version
    manager.publish(start_version + 1)
    await settle_loop()
    assert manager.tally.drawn == (window + 1) * 3  # one batch consumed: one batch more admitted
    await manager.aclose()


async def test_a_version_jump_admits_no_more_than_the_groups_consumed() -> None:
    sim = Held()
    config = RolloutConfig(mode="one_step_off", group_size=2, batch_groups=2, concurrency=1000)
    manager = RolloutManager(iter(tasks(100)), sim, config)
    manager.start()
    await settle_loop()
    assert manager.tally.drawn == 4
    manager.publish(5)  # versions published without a batch consumed: too stale now, cancelled ...
    await settle_loop()
    assert manager.tally.discarded == {"groups_cancelled_stale": 4}
    assert manager.tally.pending == 4  # ... and replaced, but the window did not grow with the versions
    await manager.aclose()


async def test_version_set_after_construction_also_starts_the_window() -> None:
    sim = Held()
    manager = RolloutManager(iter(tasks(100)), sim, RolloutConfig(group_size=2, batch_groups=4, max_staleness=1))
    manager.version = 21  # as the pipeline did before managers took `version`
    manager.start()
    await settle_loop()
    assert manager.tally.drawn == 8
    await manager.aclose()


async def test_every_group_is_trained_set_aside_or_pending_through_cancels_retries_and_filters() -> None:
    sim = Held()
    sim.reward = lambda task_id, n: 1.0 if task_id == "t1" else float(n % 2)  # t1: zero variance
    sim.infra = {("t2", 0), ("t2", 1), ("t2", 2)}  # t2: one member excluded, so too few valid
    config = RolloutConfig(
        mode="sync", group_size=2, batch_groups=2, oversample_groups=2, concurrency=100, max_infra_retries=1
    )
    manager = RolloutManager(iter(tasks(50)), sim, config)
    assembling = asyncio.create_task(manager.next_batch())
    await until(lambda: len(sim.started) == 8)
    assert sim.started == ["t0", "t0", "t1", "t1", "t2", "t2", "t3", "t3"]  # B + oversample groups
    sim.release("t0", "t1", "t2")
    await until(lambda: "t5" in sim.started)  # t1 and t2 set aside: their places went to t4 and t5
    sim.release("t4")
    batch = await assembling
    assert batch is not None and [g.task.id for g in batch.groups] == ["t0", "t4"]
    manager.publish(1)  # t3 and t5 still run on version 0: too stale for sync mode, cancelled
    totals = manager.settle(batch)
    reasons = {g.task.id: g.discarded for g in batch.discarded}
    assert reasons == {
        "t1": "groups_zero_variance_drop",
        "t2": "groups_too_few_valid",
        "t3": "groups_cancelled_stale",
        "t5": "groups_cancelled_stale",
    }
    assert batch.metrics["groups_cancelled_stale"] == 2 and batch.metrics["infra_retries"] == 2
    assert batch.metrics["members_excluded"] == 1 and batch.metrics["infra_errors_by_kind"] == {"sandbox_lost": 3}
    # episodes thrown away: t1 2, t2 4 (two retries), t3 and t5 2 each (cancelled midway)
    assert batch.metrics["episodes_discarded"] == 10 == totals["episodes_discarded"]
    check_identity(manager.tally)
    assert totals["trained"] == 2 and totals["discarded"] == {
        "groups_zero_variance_drop": 1,
        "groups_too_few_valid": 1,
        "groups_cancelled_stale": 2,
    }
    await settle_loop()
    assert manager.tally.pending == len(manager.pending_groups()) == 4  # the next batch's window
    await manager.aclose()


async def test_a_resumed_manager_restarts_the_pending_tasks_once_before_new_draws() -> None:
    sim = Held()
    all_tasks = tasks(30)
    config = RolloutConfig(mode="fully_async", max_staleness=1, group_size=2, batch_groups=2, concurrency=100)
    first = RolloutManager(iter(all_tasks), sim, config)
    first.start()
    await settle_loop()
    sim.release("t0", "t1", "t2")
    batch = await first.next_batch()
    assert batch is not None
    first.publish(1)
    first.settle(batch)
    await settle_loop()
    pending = [g.task for g in first.pending_groups()]
    tally = GroupTally.from_state_dict(first.tally.state_dict())
    assert [t.id for t in pending] == ["t2", "t3", "t4", "t5"] and tally.drawn == 6
    await first.aclose()  # killed: t3, t4 and t5 were running, t2 had finished unconsumed

    resumed_sim = Held()
    resumed_sim.release(*(t.id for t in all_tasks))
    second = RolloutManager(iter(all_tasks[6:]), resumed_sim, config, version=1, tally=tally, restart=pending)
    batch = await second.next_batch()
    assert batch is not None
    # the window of the resumed version holds exactly the restarted groups: nothing new was drawn
    assert resumed_sim.started == ["t2", "t2", "t3", "t3", "t4", "t4", "t5", "t5"] and second.tally.drawn == 6
    second.publish(2)
    second.settle(batch)
    await until(lambda: len(resumed_sim.started) == 12)
    assert resumed_sim.started[8:] == ["t6", "t6", "t7", "t7"] and second.tally.drawn == 8
    assert second.tally.restarted == 4  # groups numbered after every group started before, over resumes
    assert [g.serial for g in second.pending_groups()] == list(range(8, 12))
    check_identity(second.tally)
    await second.aclose()


def test_a_tally_that_disagrees_with_the_restarted_tasks_is_refused() -> None:
    with pytest.raises(ValueError, match="pending"):
        RolloutManager(iter([]), Held(), RolloutConfig(), tally=GroupTally(drawn=3, trained=1), restart=tasks(1))


def test_the_task_stream_skips_past_draws_only() -> None:
    pool = tasks(5)
    fresh = TaskStream(pool, seed=7)
    order = [next(fresh).id for _ in range(12)]  # over two epochs
    resumed = TaskStream(pool, seed=7, skip=4)
    assert [next(resumed).id for _ in range(8)] == order[4:]
    assert resumed.drawn == 12
