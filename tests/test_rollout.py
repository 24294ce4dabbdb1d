"""The rollout manager with simulated episodes: modes, staleness, retries, filters, stragglers."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from typing import NamedTuple

import pytest

from patchgym.core.rollout import Batch, RolloutConfig, RolloutManager
from patchgym.core.sandbox import Sandbox, SandboxSpec
from patchgym.core.tasks import Grade, Grader, Task
from patchgym.core.trajectory import Trajectory, Turn


class NoGrader(Grader):
    async def grade(self, sandbox: Sandbox) -> Grade:
        raise AssertionError("simulated episodes are not graded")


def tasks(n: int, prefix: str = "t") -> list[Task]:
    return [Task(f"{prefix}{i}", "", SandboxSpec(), NoGrader()) for i in range(n)]


class Sim:
    """A simulated policy + environment: duration and reward decided per task and attempt."""

    def __init__(self, manager_version: Callable[[], int] | None = None) -> None:
        self.running = 0
        self.peak = 0
        self.finished = 0
        self.starts: list[tuple[str, int]] = []
        self.attempts: dict[str, int] = {}
        self.version = manager_version or (lambda: 0)
        self.duration: Callable[[str, int], float] = lambda task_id, attempt: 0.01
        self.reward: Callable[[str, int], float] = lambda task_id, attempt: float(attempt % 2)
        self.infra: Callable[[str, int], bool] = lambda task_id, attempt: False
        self.on_start: Callable[[], None] = lambda: None

    async def __call__(self, task: Task) -> Trajectory:
        attempt = self.attempts[task.id] = self.attempts.get(task.id, -1) + 1
        self.starts.append((task.id, self.version()))
        self.on_start()
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.duration(task.id, attempt))
        finally:
            self.running -= 1
        self.finished += 1
        trajectory = Trajectory(task.id, turns=[Turn("a", "o", "command", policy_version=self.version())])
        if self.infra(task.id, attempt):
            trajectory.infra_error = {"kind": "sandbox_lost", "message": "gone", "retryable": True}
            trajectory.termination = "infra_error"
        else:
            trajectory.reward, trajectory.termination = self.reward(task.id, attempt), "submitted"
        return trajectory


def manager_for(sim: Sim, n_tasks: int, **config: object) -> RolloutManager:
    manager = RolloutManager(iter(tasks(n_tasks)), sim, RolloutConfig(**config))
    sim.version = lambda: manager.version
    return manager


class Step(NamedTuple):
    batch: Batch
    pending: int
    """Groups admitted beyond the batches handed out, while training: generation overlapping training."""
    ended: int
    """Episodes that ended while training."""


async def train_loop(
    manager: RolloutManager, steps: int, train_s: float, sim: Sim, first_version: int = 0
) -> list[Step]:
    """Consume `steps` batches, training `train_s` on each, then publishing the next version."""
    out = []
    for step in range(steps):
        batch = await asyncio.wait_for(manager.next_batch(), 60)
        assert batch is not None
        before = sim.finished
        await asyncio.sleep(train_s)  # no assertion depends on what this leaves time for
        out.append(Step(batch, len(manager.pending_groups()), sim.finished - before))
        manager.publish(first_version + step + 1)
    await manager.aclose()
    return out


async def test_sync_mode_is_on_policy_and_idle_while_training() -> None:
    sim = Sim()
    manager = manager_for(sim, 40, mode="sync", group_size=2, batch_groups=3, concurrency=16)
    for batch, pending, ended_while_training in await train_loop(manager, 3, 0.05, sim):
        assert len(batch.groups) == 3
        assert all(g.start_version == batch.version for g in batch.groups)
        assert batch.metrics["staleness_max"] == 0
        assert pending == 0 and ended_while_training == 0


async def test_one_step_off_generates_during_training_with_staleness_at_most_1() -> None:
    sim = Sim()
    sim.duration = lambda task_id, attempt: 0.03
    manager = manager_for(sim, 40, mode="one_step_off", group_size=2, batch_groups=3, concurrency=16)
    results = await train_loop(manager, 4, 0.06, sim)
    assert all(step.batch.metrics["staleness_max"] <= 1 for step in results)
    assert max(step.batch.metrics["staleness_max"] for step in results) == 1
    assert all(step.pending == 3 for step in results)  # the next batch's groups run during training


async def test_fully_async_respects_staleness_and_concurrency() -> None:
    sim = Sim()
    sim.duration = lambda task_id, attempt: 0.005 * (1 + int(task_id[1:]) % 5)
    manager = manager_for(sim, 200, mode="fully_async", max_staleness=2, group_size=4, batch_groups=2, concurrency=6)
    results = await train_loop(manager, 5, 0.02, sim)
    assert all(step.batch.metrics["staleness_max"] <= 2 for step in results)
    for step in results:
        lags = [step.batch.version - g.start_version for g in step.batch.groups]
        assert step.batch.metrics["staleness_mean"] == pytest.approx(sum(lags) / len(lags))
        rewards = [r for g in step.batch.groups for r in g.rewards]
        assert step.batch.metrics["reward_std"] == pytest.approx(statistics.pstdev(rewards))
    assert sim.peak <= 6
    assert results[-1].batch.metrics["limits"]["concurrency"] == 6


async def test_infra_errors_are_retried_then_excluded_never_scored() -> None:
    sim = Sim()
    sim.reward = lambda task_id, attempt: float(attempt % 2)
    # every task's first attempt fails; task t0 keeps failing for its second member
    sim.infra = lambda task_id, attempt: attempt == 0 or (task_id == "t0" and attempt in (2, 3))
    manager = manager_for(
        sim,
        2,
        mode="sync",
        group_size=2,
        batch_groups=2,
        max_infra_retries=2,
        zero_variance="keep",
        min_valid_members=1,
    )
    batch = await manager.next_batch()
    await manager.aclose()
    assert batch is not None
    by_task = {g.task.id: g for g in batch.groups}
    assert len(by_task["t0"].members) == 1 and len(by_task["t0"].excluded) == 1
    assert by_task["t0"].excluded[0].reward is None
    assert len(by_task["t1"].members) == 2
    assert batch.metrics["infra_errors_by_kind"] == {"sandbox_lost": 4}
    assert batch.metrics["infra_retries"] == 3 and batch.metrics["members_excluded"] == 1
    retried = [t for g in batch.groups for t in g.retried]  # kept, so that every attempt can be logged
    assert len(retried) == 3 and all(t.infra_error and t.reward is None for t in retried)


async def test_infra_errors_are_counted_in_the_batch_they_happened_for() -> None:
    sim = Sim()
    sim.infra = lambda task_id, attempt: task_id == "t0" and attempt == 0
    manager = manager_for(sim, 2, mode="sync", group_size=2, batch_groups=1, zero_variance="keep")
    first = await manager.next_batch()
    manager.publish(1)
    second = await manager.next_batch()
    await manager.aclose()
    assert first is not None and second is not None
    assert first.metrics["infra_errors_by_kind"] == {"sandbox_lost": 1}
    assert second.metrics["infra_errors_by_kind"] == {}


async def test_an_episode_that_raises_fails_the_batch_instead_of_hanging() -> None:
    sim = Sim()

    async def broken(task: Task) -> Trajectory:
        if task.id == "t1":
            raise IndexError("a bug in the episode")
        return await sim(task)

    manager = RolloutManager(iter(tasks(3)), broken, RolloutConfig(mode="sync", group_size=2, batch_groups=3))
    with pytest.raises(IndexError, match="a bug in the episode"):
        await asyncio.wait_for(manager.next_batch(), 10)
    with pytest.raises(IndexError):  # and stays failed
        await asyncio.wait_for(manager.next_batch(), 10)
    await manager.aclose()


async def test_zero_variance_groups_are_dropped_or_resampled() -> None:
    sim = Sim()
    sim.reward = lambda task_id, attempt: 1.0 if task_id in ("t0", "t1") else float(attempt % 2)
    manager = manager_for(sim, 10, mode="sync", group_size=2, batch_groups=2, zero_variance="drop")
    batch = await manager.next_batch()
    await manager.aclose()
    assert batch is not None and {g.task.id for g in batch.groups}.isdisjoint({"t0", "t1"})
    assert batch.metrics["groups_zero_variance_drop"] == 2
    # the dropped groups travel with the batch, so their trajectories are logged rather than lost
    assert sorted(g.task.id for g in batch.discarded) == ["t0", "t1"]
    assert all(g.discarded == "groups_zero_variance_drop" and len(g.members) == 2 for g in batch.discarded)

    sim = Sim()

    def reward(task_id: str, attempt: int) -> float:
        return 1.0 if attempt < 2 else float(attempt % 2)  # t0's first group is uniform, its resample is not

    sim.reward = reward
    manager = manager_for(sim, 1, mode="sync", group_size=2, batch_groups=1, zero_variance="resample")
    batch = await manager.next_batch()
    await manager.aclose()
    assert batch is not None and batch.groups[0].task.id == "t0"
    assert batch.metrics["groups_zero_variance_resample"] == 1 and sim.attempts["t0"] == 3


async def test_oversampling_means_stragglers_never_hold_a_step() -> None:
    sim = Sim()
    sim.duration = lambda task_id, attempt: 3600.0 if task_id == "t0" else 0.01  # t0 never ends in the test
    manager = manager_for(sim, 20, mode="sync", group_size=2, batch_groups=2, oversample_groups=1)
    batch = await asyncio.wait_for(manager.next_batch(), 60)
    assert batch is not None and "t0" not in {g.task.id for g in batch.groups}
    manager.publish(1)
    assert manager._counters["groups_cancelled_stale"] == 1
    await manager.aclose()


async def test_running_out_of_tasks_ends_cleanly() -> None:
    sim = Sim()
    manager = manager_for(sim, 3, mode="fully_async", group_size=2, batch_groups=2, max_staleness=4)
    first = await manager.next_batch()
    manager.publish(1)
    second = await manager.next_batch()
    assert first is not None and second is not None and len(first.groups) + len(second.groups) == 3
    assert await manager.next_batch() is None
    await manager.aclose()


def test_versions_must_increase() -> None:
    manager = RolloutManager(iter([]), Sim(), RolloutConfig())
    with pytest.raises(ValueError, match="must increase"):
        manager.publish(0)


async def test_a_policy_that_never_varies_stalls_with_a_clear_error() -> None:
    from patchgym.core.rollout import RolloutStalledError

    sim = Sim()
    sim.reward = lambda task_id, attempt: 0.0
    manager = RolloutManager(
        (t for i in range(10**6) for t in tasks(1, f"x{i}-")),
        sim,
        RolloutConfig(mode="fully_async", group_size=2, batch_groups=2, max_discards_per_batch=5),
    )
    expected = "5 groups in a row .*always fails, or always succeeds.*zero_variance: keep"
    with pytest.raises(RolloutStalledError, match=expected):
        await manager.next_batch()
    await manager.aclose()


WINDOWS = [("sync", 0, 0), ("sync", 0, 1), ("one_step_off", 1, 0), ("fully_async", 2, 1)]


@pytest.mark.parametrize(("mode", "staleness", "oversample"), WINDOWS)
@pytest.mark.parametrize("first_version", [0, 3])
async def test_a_stage_never_runs_further_ahead_of_the_trainer_than_its_window(
    mode: str, staleness: int, oversample: int, first_version: int
) -> None:
    """Groups started but not yet handed to the trainer never exceed (1 + staleness) batches plus the
    oversampled groups, from the stage's first batch on, whatever version the stage starts at."""
    batch_groups = 2
    window = (1 + staleness) * batch_groups + oversample
    sim = Sim()
    manager = manager_for(
        sim,
        200,
        mode=mode,
        max_staleness=staleness,
        oversample_groups=oversample,
        group_size=2,
        batch_groups=batch_groups,
        concurrency=64,
        zero_variance="keep",
    )
    manager.version = first_version  # where the previous stage (or the run being resumed) left the policy
    ahead: list[int] = []
    sim.on_start = lambda: ahead.append(len(manager.pending_groups()))
    steps = await train_loop(manager, 4, 0.01, sim, first_version)
    assert all(len(step.batch.groups) == batch_groups for step in steps)
    assert max(ahead) <= window and all(step.pending <= window for step in steps)
    assert max(ahead) == window  # and the window is used: generation is not held back either


async def test_tail_share_is_the_time_the_last_tenth_of_episodes_held_the_batch() -> None:
    """10 episodes: the last one alone far behind the others gives a share near 1; the last two
    finishing together (the 90th percentile is the 9th episode) give a share near 0."""

    async def tail_share(slow: int) -> float:
        loop = asyncio.get_running_loop()
        begin, fast_done = loop.time(), 0
        release = asyncio.Event()

        async def episode(task: Task) -> Trajectory:
            nonlocal fast_done
            attempt = sum(1 for _ in started)
            started.append(attempt)
            if attempt >= 10 - slow:
                await release.wait()
            else:
                await asyncio.sleep(0)
                fast_done += 1
                if fast_done == 10 - slow:  # the fast ones took `fast` s: hold the slow ones 20 times as long
                    loop.call_later(max(1.0, 20 * (loop.time() - begin)), release.set)
            return Trajectory(task.id, reward=float(attempt % 2), termination="submitted")

        started: list[int] = []
        config = RolloutConfig(mode="sync", group_size=10, batch_groups=1, concurrency=10)
        manager = RolloutManager(iter(tasks(1)), episode, config)
        batch = await asyncio.wait_for(manager.next_batch(), 120)
        await manager.aclose()
        assert batch is not None
        return batch.metrics["tail_share_after_90pct"]

    assert await tail_share(slow=1) > 0.9
    assert await tail_share(slow=2) < 0.5


async def test_a_new_version_cancels_only_the_groups_it_makes_too_stale() -> None:
    """With max_staleness 1 a straggler started at version 1 outlives version 2, not version 3."""
    sim = Sim()
    sim.duration = lambda task_id, attempt: 3600.0 if task_id == "t4" else 0.01  # t4 never ends in the test
    manager = manager_for(sim, 40, mode="fully_async", max_staleness=1, group_size=2, batch_groups=2)
    assert await asyncio.wait_for(manager.next_batch(), 60) is not None  # t0-t3 started at version 0
    manager.publish(1)  # admits t4 and t5
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 60
    while ("t4", 1) not in sim.starts:
        assert loop.time() < give_up, "t4 did not start at version 1"
        await asyncio.sleep(0.005)
    manager.publish(2)
    assert "t4" in {g.task.id for g in manager.pending_groups()}
    manager.publish(3)
    assert "t4" not in {g.task.id for g in manager.pending_groups()}
    await manager.aclose()
