"""The rollout manager: runs GRPO groups of episodes and hands finished groups to the trainer.

One event loop drives every trajectory. Which groups may start is decided by one rule, capacity
gating on policy versions (as in AReaL), counted from the version `v0` the manager started at
(the stage's first version, or the resumed one): with `B` groups per batch and policy version
`v`, at most `(v - v0 + 1 + max_staleness) * B + oversample_groups` groups may have been started
since (groups set aside give their place back), never more than the window
`(1 + max_staleness) * B + oversample_groups` beyond the groups consumed (a jump of several
versions admits no more than one batch does), and at most `concurrency` trajectories run at
once. So, whatever version a stage or a resume starts at:

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

Every group drawn ends in exactly one place (`GroupTally`): trained, set aside with its reason
(`groups_cancelled_stale`: still running when it became too stale; `groups_stale`: finished too
stale; `groups_too_few_valid`; `groups_zero_variance_*`), or pending (running, or finished and
not yet consumed). A checkpoint records the tally and the pending tasks, and a resumed manager
restarts those tasks first without counting them as new draws.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
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

    mode: Mode = Field(
        "fully_async",
        description="sync: a batch starts after the last update; one_step_off: one version behind; fully_async: "
        "groups keep running, up to max_staleness versions behind",
    )
    concurrency: int = Field(64, gt=0, description="trajectories running at once")
    group_size: int = Field(8, gt=0, description="attempts per task (GRPO group)")
    batch_groups: int = Field(4, gt=0, description="groups per training step")
    max_staleness: int = Field(1, ge=0, description="policy versions a group may lag (fully_async)")
    oversample_groups: int = Field(0, ge=0, description="extra groups started per batch")
    max_infra_retries: int = Field(2, ge=0, description="retries of a member that hit an infra error")
    min_valid_members: int = Field(2, gt=0, description="a group with fewer valid members is dropped")
    zero_variance: Literal["keep", "drop", "resample"] = Field(
        "drop",
        description="a group whose members all earn the same reward (no GRPO signal): train on it, drop it, or "
        "drop it and try its task again later",
    )
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
    serial: int = 0
    """Unique within a run (a resumed run continues the count): names the group in the event log."""
    members: list[Trajectory] = field(default_factory=list)
    excluded: list[Trajectory] = field(default_factory=list)
    retried: list[Trajectory] = field(default_factory=list)
    started_at: float = 0.0
    finished_at: float = 0.0
    finish_times: list[float] = field(default_factory=list)
    discarded: str | None = None
    """Why the group was not trained on (a `groups_*` counter name), if it was not."""
    episodes: int = 0
    """Episodes started for this group (retries included): the work lost if it is set aside."""

    @property
    def rewards(self) -> list[float]:
        return [t.reward or 0.0 for t in self.members]

    @property
    def zero_variance(self) -> bool:
        return len(set(self.rewards)) <= 1


@dataclass
class GroupTally:
    """Where every group drawn went: `drawn == trained + sum(discarded.values()) + pending`."""

    drawn: int = 0
    trained: int = 0
    discarded: Counter[str] = field(default_factory=Counter)
    """Groups set aside, by reason (a `groups_*` name)."""
    episodes_discarded: int = 0
    """Episodes started for the groups set aside: rollout compute thrown away."""
    restarted: int = 0
    """Pending groups started again by a resumed run (not new draws)."""

    @property
    def pending(self) -> int:
        """Groups drawn and not yet trained on or set aside (running, or finished and waiting)."""
        return self.drawn - self.trained - sum(self.discarded.values())

    def as_dict(self) -> dict[str, Any]:
        """The running totals, as each step event carries them."""
        return {**self.state_dict(), "pending": self.pending}

    def state_dict(self) -> dict[str, Any]:
        return {
            "drawn": self.drawn,
            "trained": self.trained,
            "discarded": dict(self.discarded),
            "episodes_discarded": self.episodes_discarded,
            "restarted": self.restarted,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> GroupTally:
        counts = (state["drawn"], state["trained"], Counter(state["discarded"]), state["episodes_discarded"])
        return cls(*counts, state.get("restarted", 0))

    def next_serial(self) -> int:
        """A number for the next group started: one more than all groups started so far, over resumes."""
        return self.drawn + self.restarted


@dataclass
class Batch:
    """What the trainer consumes for one step, with the rollout metrics of that step."""

    groups: list[Group]
    version: int
    metrics: dict[str, Any]
    discarded: list[Group] = field(default_factory=list)
    """Groups set aside since the previous batch (see `Group.discarded`), so that they can be logged;
    `RolloutManager.settle` adds those set aside while the batch was trained on."""


class RolloutManager:
    """Schedules groups under capacity gating and yields batches; see the module docstring."""

    def __init__(
        self,
        tasks: Iterator[Task],
        run_episode: EpisodeFn,
        config: RolloutConfig | None = None,
        *,
        version: int = 0,
        tally: GroupTally | None = None,
        restart: Iterable[Task] = (),
        resample: Iterable[Task] = (),
    ) -> None:
        """`version`: the policy version generation starts at. A resumed manager takes the `tally`
        of the checkpoint, the tasks of its pending groups (`restart`: started first, already
        counted as drawn) and the tasks still queued for `zero_variance: resample`."""
        self.config = config or RolloutConfig()
        self._tasks = tasks
        self._restart: deque[Task] = deque(restart)
        self._resample: deque[Task] = deque(resample)
        self._run_episode = run_episode
        self.version = version
        self._base_version: int | None = None  # fixed when generation starts: gating counts from it
        self.tally = tally or GroupTally(drawn=len(self._restart))
        if self.tally.pending != len(self._restart):
            raise ValueError(f"the tally has {self.tally.pending} pending groups but {len(self._restart)} restart")
        self._started_groups = 0  # since the base version, less those set aside
        self._consumed = 0  # groups handed to the trainer since the base version
        self._slots = asyncio.Semaphore(self.config.concurrency)
        # None: no group will come any more; an exception: an episode failed other than by an infra error
        self._ready: asyncio.Queue[Group | Exception | None] = asyncio.Queue()
        self._running: dict[asyncio.Task[None], Group] = {}
        self._unconsumed: dict[int, Group] = {}  # started, not yet handed out or discarded
        self._wake = asyncio.Event()
        self._producer: asyncio.Task[None] | None = None
        self._tasks_done = False
        self._counters = self.tally.discarded  # groups set aside, by reason
        self._discarded: list[Group] = []

    # -- producer ------------------------------------------------------------------------
    def _capacity(self) -> int:
        c = self.config
        assert self._base_version is not None
        window = (1 + c.staleness) * c.batch_groups + c.oversample_groups
        by_version = (self.version - self._base_version) * c.batch_groups + window - self._started_groups
        by_consumption = window - (self._started_groups - self._consumed)
        return min(by_version, by_consumption)

    def _next_task(self) -> Task | None:
        if self._restart:
            self.tally.restarted += 1  # drawn by the run that started it first
            return self._restart.popleft()
        task = self._resample.popleft() if self._resample else next(self._tasks, None)
        self._tasks_done = task is None
        self.tally.drawn += task is not None
        return task

    async def _produce(self) -> None:
        while True:
            while self._capacity() > 0:
                serial = self.tally.next_serial()
                task = self._next_task()
                if task is None:
                    break
                group = Group(task, self.version, serial, started_at=time.perf_counter())
                self._started_groups += 1
                self._unconsumed[id(group)] = group
                runner = asyncio.create_task(self._run_group(group))
                self._running[runner] = group
            self._signal_if_finished()
            self._wake.clear()
            await self._wake.wait()

    def _signal_if_finished(self) -> None:
        if self._tasks_done and not self._restart and not self._resample and not self._running:
            self._ready.put_nowait(None)

    async def _run_group(self, group: Group) -> None:
        try:
            await asyncio.gather(*(self._run_member(group) for _ in range(self.config.group_size)))
        except Exception as exc:  # a bug, not an infra fault (those are data): the consumer raises it
            self._ready.put_nowait(exc)
            return
        finally:
            self._running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        group.finished_at = time.perf_counter()
        self._ready.put_nowait(group)
        self._signal_if_finished()

    async def _run_member(self, group: Group) -> None:
        """One member, retried after infra errors; it joins the group as it ends (so a group cancelled
        midway still shows the episodes it finished)."""
        for attempt in range(self.config.max_infra_retries + 1):
            async with self._slots:
                group.episodes += 1
                trajectory = await self._run_episode(group.task)
            group.finish_times.append(time.perf_counter())
            if trajectory.infra_error is None:
                group.members.append(trajectory)
                return
            if attempt < self.config.max_infra_retries:
                group.retried.append(trajectory)
        group.excluded.append(trajectory)

    # -- consumer ------------------------------------------------------------------------
    def start(self) -> None:
        if self._producer is None:
            self._base_version = self.version
            self._producer = asyncio.create_task(self._produce())

    async def next_batch(self) -> Batch | None:
        """The next `batch_groups` usable groups, or None once the tasks ran out."""
        self.start()
        waited = time.perf_counter()
        groups: list[Group] = []
        counters_before = Counter(self._counters)
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
                self.tally.trained += 1
                self._consumed += 1
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
        set_aside, self._discarded = self._discarded, []
        metrics = self._metrics(groups, time.perf_counter() - waited)
        batch = Batch(groups, self.version, metrics, set_aside)
        batch.metrics.update(_outcomes(batch))
        return batch

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
        self.tally.episodes_discarded += group.episodes
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

    def queued_tasks(self) -> list[Task]:
        """Tasks waiting for a group of their own: a checkpoint records them beside the pending groups."""
        return [*self._restart, *self._resample]

    def settle(self, batch: Batch) -> dict[str, Any]:
        """Close the books of `batch`'s step, after `publish`: the groups set aside meanwhile (cancelled
        stragglers) join `batch.discarded`, so the step logs every group it closed, and `batch.metrics`
        counts them. Returns the running totals (`GroupTally.as_dict`)."""
        batch.discarded += self._discarded
        self._discarded = []
        batch.metrics.update(_outcomes(batch))
        return self.tally.as_dict()

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
    def _metrics(self, groups: list[Group], wait_s: float) -> dict[str, Any]:
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
            "grade_reasons": dict(Counter(t.grade_reason for t in trajectories)),
            "canary_failures": sum(t.grade_reason == "canary" for t in trajectories),
            "limits": self.config.model_dump(),
        }


def _outcomes(batch: Batch) -> dict[str, Any]:
    """What happened to the groups of one step (trained and set aside): counts by reason, and the
    episodes lost to the infrastructure, exactly those the step logs."""
    groups = [*batch.groups, *batch.discarded]
    lost = [t for g in groups for t in (*g.retried, *g.excluded)]
    return {
        **Counter(g.discarded for g in batch.discarded if g.discarded),
        "episodes_discarded": sum(g.episodes for g in batch.discarded),
        "infra_retries": sum(len(g.retried) for g in groups),
        "members_excluded": sum(len(g.excluded) for g in groups),
        "infra_errors_by_kind": dict(Counter(str((t.infra_error or {}).get("kind", "infra")) for t in lost)),
    }
