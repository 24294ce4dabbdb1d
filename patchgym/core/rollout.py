"""The rollout manager: runs GRPO groups of episodes and hands finished groups to the trainer.

One event loop drives every trajectory. Which groups may start is decided by one rule, capacity
gating on policy versions (as in AReaL): with `B` groups per batch and policy version `v`, at
most `(v + 1 + max_staleness) * B + oversample_groups` groups may have been started in total,
and at most `concurrency` trajectories run at once. So:

- `sync` is `max_staleness = 0`: the next batch starts only after the trainer published the
  weights it trained on the last one;
- `one_step_off` is `max_staleness = 1`: the next batch generates while the trainer trains;
- `fully_async` uses the configured `max_staleness`.

`oversample_groups` extra groups run alongside each batch so that the slowest groups never hold a
step: the first `B` groups to finish form the batch; when a new version is published, groups
still running that could no longer be used (too stale) are cancelled. A group member that ends
in an infrastructure error is retried up to `max_infra_retries` times and otherwise excluded
from the group (never scored 0). Groups whose valid members all got the same reward are handled
by `zero_variance` (keep, drop, or resample the task).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from patchgym.core.errors import PatchgymError
from patchgym.core.tasks import Task
from patchgym.core.trajectory import Trajectory

Mode = Literal["sync", "one_step_off", "fully_async"]
EpisodeFn = Callable[[Task], Awaitable[Trajectory]]
"""Runs one episode of a task with the current policy and returns its trajectory."""


class RolloutStalledError(PatchgymError):
    """No usable group could be assembled into a batch (see `max_discards_per_batch`)."""


class RolloutConfig(BaseModel):
    """Rollout settings; every limit is here and reported with each batch."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode = "fully_async"
    concurrency: int = Field(64, gt=0, description="trajectories running at once")
    group_size: int = Field(8, gt=0, description="attempts per task (GRPO group)")
    batch_groups: int = Field(4, gt=0, description="groups per training step")
    max_staleness: int = Field(1, ge=0, description="policy versions a group may lag (fully_async)")
    oversample_groups: int = Field(0, ge=0, description="extra groups started per batch")
    max_infra_retries: int = Field(2, ge=0, description="retries of a member that hit an infra error")
    min_valid_members: int = Field(2, gt=0, description="a group with fewer valid members is dropped")
    zero_variance: Literal["keep", "drop", "resample"] = "drop"
    max_discards_per_batch: int = Field(
        256, gt=0, description="unusable groups tolerated while assembling one batch before giving up"
    )

    @property
    def staleness(self) -> int:
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


@dataclass
class Group:
    """G attempts at one task. `members` holds the valid ones; `excluded` the members lost to infra
    errors after their last retry; `retried` the failed attempts that were replaced by a retry."""

    task: Task
    start_version: int
    members: list[Trajectory] = field(default_factory=list)
    excluded: list[Trajectory] = field(default_factory=list)
    retried: list[Trajectory] = field(default_factory=list)
    started_at: float = 0.0
    finished_at: float = 0.0
    finish_times: list[float] = field(default_factory=list)
    discarded: str | None = None
    """Why the group was not trained on (a `groups_*` counter name), if it was not."""

    @property
    def rewards(self) -> list[float]:
        return [t.reward or 0.0 for t in self.members]

    @property
    def zero_variance(self) -> bool:
        return len(set(self.rewards)) <= 1


@dataclass
class Batch:
    """What the trainer consumes for one step, with the rollout metrics of that step."""

    groups: list[Group]
    version: int
    metrics: dict[str, Any]
    discarded: list[Group] = field(default_factory=list)
    """Groups set aside since the previous batch (see `Group.discarded`), so that they can be logged."""


class RolloutManager:
    """Schedules groups under capacity gating and yields batches; see the module docstring."""

    def __init__(self, tasks: Iterator[Task], run_episode: EpisodeFn, config: RolloutConfig | None = None) -> None:
        self.config = config or RolloutConfig()
        self._tasks = tasks
        self._resample: deque[Task] = deque()
        self._run_episode = run_episode
        self.version = 0
        self._started_groups = 0
        self._slots = asyncio.Semaphore(self.config.concurrency)
        # None: no group will come any more; an exception: an episode failed other than by an infra error
        self._ready: asyncio.Queue[Group | Exception | None] = asyncio.Queue()
        self._running: dict[asyncio.Task[None], Group] = {}
        self._unconsumed: dict[int, Group] = {}  # started, not yet handed out or discarded
        self._wake = asyncio.Event()
        self._producer: asyncio.Task[None] | None = None
        self._tasks_done = False
        self._counters: Counter[str] = Counter()
        self._infra_kinds: Counter[str] = Counter()
        self._discarded: list[Group] = []

    # -- producer ------------------------------------------------------------------------
    def _capacity(self) -> int:
        c = self.config
        budget = (self.version + 1 + c.staleness) * c.batch_groups + c.oversample_groups
        return budget - self._started_groups

    def _next_task(self) -> Task | None:
        if self._resample:
            return self._resample.popleft()
        task = next(self._tasks, None)
        self._tasks_done = task is None
        return task

    async def _produce(self) -> None:
        while True:
            while self._capacity() > 0 and (task := self._next_task()) is not None:
                group = Group(task, start_version=self.version, started_at=time.perf_counter())
                self._started_groups += 1
                self._unconsumed[id(group)] = group
                runner = asyncio.create_task(self._run_group(group))
                self._running[runner] = group
            self._signal_if_finished()
            self._wake.clear()
            await self._wake.wait()

    def _signal_if_finished(self) -> None:
        if self._tasks_done and not self._resample and not self._running:
            self._ready.put_nowait(None)

    async def _run_group(self, group: Group) -> None:
        try:
            results = await asyncio.gather(*(self._run_member(group) for _ in range(self.config.group_size)))
        except Exception as exc:  # a bug, not an infra fault (those are data): the consumer raises it
            self._ready.put_nowait(exc)
            return
        finally:
            self._running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        for trajectory in results:
            (group.excluded if trajectory.infra_error else group.members).append(trajectory)
        group.finished_at = time.perf_counter()
        self._ready.put_nowait(group)
        self._signal_if_finished()

    async def _run_member(self, group: Group) -> Trajectory:
        for attempt in range(self.config.max_infra_retries + 1):
            async with self._slots:
                trajectory = await self._run_episode(group.task)
            group.finish_times.append(time.perf_counter())
            if trajectory.infra_error is None:
                return trajectory
            self._infra_kinds[str(trajectory.infra_error.get("kind", "infra"))] += 1
            if attempt < self.config.max_infra_retries:
                self._counters["infra_retries"] += 1
                group.retried.append(trajectory)
        self._counters["members_excluded"] += 1
        return trajectory

    # -- consumer ------------------------------------------------------------------------
    def start(self) -> None:
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce())

    async def next_batch(self) -> Batch | None:
        """The next `batch_groups` usable groups, or None once the tasks ran out."""
        self.start()
        waited = time.perf_counter()
        groups: list[Group] = []
        counters_before = Counter(self._counters)
        infra_before = Counter(self._infra_kinds)
        discarded = 0
        while len(groups) < self.config.batch_groups:
            group = await self._ready.get()
            if group is None or isinstance(group, Exception):
                self._ready.put_nowait(group)  # stays finished (or failed) for later calls
                if group is None:
                    break
                raise group
            if self._usable(group):
                self._unconsumed.pop(id(group), None)
                groups.append(group)
                continue
            discarded += 1
            if discarded >= self.config.max_discards_per_batch:
                reasons = {k: v - counters_before[k] for k, v in self._counters.items() if k.startswith("groups_")}
                raise RolloutStalledError(
                    f"{discarded} groups in a row could not be used ({reasons}); when every attempt at a "
                    "task gets the same reward (the policy always fails, or always succeeds) GRPO has "
                    "nothing to learn from: use tasks of the right difficulty, or set zero_variance: keep"
                )
        if not groups:
            return None
        metrics = self._metrics(groups, time.perf_counter() - waited, counters_before, infra_before)
        discarded, self._discarded = self._discarded, []
        return Batch(groups, self.version, metrics, discarded)

    def _usable(self, group: Group) -> bool:
        if self.version - group.start_version > self.config.staleness:
            return self._discard(group, "groups_stale")
        if len(group.members) < self.config.min_valid_members:
            return self._discard(group, "groups_too_few_valid")
        if group.zero_variance and self.config.zero_variance != "keep":
            if self.config.zero_variance == "resample":
                self._resample.append(group.task)
            return self._discard(group, f"groups_zero_variance_{self.config.zero_variance}")
        return True

    def _discard(self, group: Group, reason: str) -> bool:
        """Count why a group is not used and give its place back to a new group."""
        self._unconsumed.pop(id(group), None)
        self._counters[reason] += 1
        group.discarded = reason
        self._discarded.append(group)
        self._started_groups -= 1
        self._wake.set()
        return False

    def pending_groups(self) -> list[Group]:
        """Groups started but not handed to the trainer yet (running, or finished and waiting).

        A checkpoint records their tasks so that a resumed run starts them again.
        """
        return list(self._unconsumed.values())

    def publish(self, version: int) -> None:
        """The trainer has published `version`: admit new groups and cancel hopeless stragglers."""
        if version <= self.version:
            raise ValueError(f"policy versions must increase: {version} after {self.version}")
        self.version = version
        for runner, group in list(self._running.items()):
            if version - group.start_version > self.config.staleness:
                runner.cancel()
                del self._running[runner]
                self._discard(group, "groups_cancelled_stale")
        self._wake.set()

    async def aclose(self) -> None:
        """Cancel the producer and every running group."""
        runners = [*self._running, *([self._producer] if self._producer else [])]
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)

    # -- metrics -------------------------------------------------------------------------
    def _metrics(
        self, groups: list[Group], wait_s: float, counters_before: Counter[str], infra_before: Counter[str]
    ) -> dict[str, Any]:
        trajectories = [t for g in groups for t in g.members]
        finishes = sorted(f for g in groups for f in g.finish_times)
        begin = min(g.started_at for g in groups)
        end = finishes[-1]
        t90 = finishes[max(0, math.ceil(0.9 * len(finishes)) - 1)]
        rewards = [r for g in groups for r in g.rewards]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        return {
            "version": self.version,
            "rollout_wait_s": wait_s,
            "groups": len(groups),
            "trajectories": len(trajectories),
            "reward_mean": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else 0.0,
            "staleness_mean": sum(self.version - g.start_version for g in groups) / len(groups),
            "staleness_max": max(self.version - g.start_version for g in groups),
            "tail_share_after_90pct": (end - t90) / (end - begin) if end > begin else 0.0,
            "terminations": dict(Counter(t.termination or "none" for t in trajectories)),
            "infra_errors_by_kind": dict(self._infra_kinds - infra_before),  # since the previous batch
            **{k: self._counters[k] - counters_before[k] for k in self._counters},
            "limits": self.config.model_dump(),
        }
