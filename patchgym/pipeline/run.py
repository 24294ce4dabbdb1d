"""`patchgym run`: evaluate the base policy, SFT on traces, GRPO, evaluate after each stage.

SFT traces are oracle replays (each train task's solution run through the env) and/or trace
files (mini-swe-agent trajectories, OpenAI message lists, SWE-smith JSONL: pipeline/traces.py),
tokenised the way the agent loop tokenises a rollout.

Everything goes through the registry (sandbox, inference and trainer backends, task sets) and
the run directory holds the event log, checkpoints and `state.json`; `--resume` continues a
run after a crash or SIGKILL from its last checkpoint: finished stages are skipped, GRPO
continues at the checkpointed step with the same task order, groups that were running at the
checkpoint are started again, and events written after the checkpoint are dropped before the
work is redone: no trajectory is trained on twice or lost, and none is logged twice. A resume
first removes the sandboxes the killed process left (found by the run's label, see
pipeline/sandboxes.py). Every name and option of the configuration is checked (`check_config`)
before anything is written.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from patchgym.backends.inference.recording_endpoint import RecordingEndpoint
from patchgym.core.batch import Sample, TrainBatch
from patchgym.core.chat import assistant_text, text_generation
from patchgym.core.errors import ConfigError
from patchgym.core.inference import Generation, SamplingParams
from patchgym.core.losses import GRPOLoss, SFTLoss, group_advantages
from patchgym.core.metrics import EventLog, Sink, TensorBoardSink, WandbSink, read_events, truncate_events
from patchgym.core.plugins import registry
from patchgym.core.rollout import Batch, GroupTally, RolloutManager
from patchgym.core.tasks import Task, TaskSet
from patchgym.core.tools import bash_call_text
from patchgym.core.trajectory import Trajectory
from patchgym.core.validation import oracle_turns
from patchgym.envs.agent import AgentConfig, describe, episode_stats, run_agent
from patchgym.envs.recording import RecordingLimits
from patchgym.envs.scaffold import load_scaffold, run_scaffold
from patchgym.envs.swe import AsyncSWEEnv, EnvConfig
from patchgym.launch.cluster import plan_placement
from patchgym.launch.context import run_logs
from patchgym.launch.lifecycle import close_parts, start_parts, watched
from patchgym.launch.ranks import follow_torchrun, torchrun_follower
from patchgym.launch.sync import SyncReport, WeightSync, probe_ids
from patchgym.pipeline.checks import check_config, model_dir
from patchgym.pipeline.config import RunConfig, TraceSource
from patchgym.pipeline.export import export_policy
from patchgym.pipeline.feedback import RunningScore, ZeroRewardWatch, eval_line, pass_rate, quiet_third_party_bars
from patchgym.pipeline.model_source import fetch_model
from patchgym.pipeline.progress import stage_progress
from patchgym.pipeline.sandboxes import RunLabelledBackend
from patchgym.pipeline.state import STATE_FILE, RunState
from patchgym.pipeline.traces import TooLong, TraceTally, load_samples, read_traces

SUBMIT_MESSAGE = "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"


class OraclePolicy:
    """A scripted policy that runs a task's oracle commands, one per turn, then submits: SFT traces by replay."""

    max_context = 1 << 30

    def __init__(self, tokenizer: Any, task: Task, turn_end_id: int, actions: str = "bash_blocks") -> None:
        if actions == "tool_calls":  # each command as a bash tool call in the model's own template format
            render = functools.partial(assistant_text, tokenizer)
            commands: list[str | None] = [*oracle_turns(task), None]
            self.messages = [bash_call_text(render, command) for command in commands]
        else:
            self.messages = [*(f"```bash\n{command}\n```" for command in oracle_turns(task)), SUBMIT_MESSAGE]
        self._submit = self.messages[-1]
        self._tokenizer, self._end = tokenizer, turn_end_id

    def longest_turn(self) -> int:
        """Tokens of the longest turn this policy says, its turn end included."""
        return max(len(text_generation(self._tokenizer, m, self._end).token_ids) for m in self.messages)

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        text = self.messages.pop(0) if self.messages else self._submit
        return text_generation(self._tokenizer, text, self._end)


def check_oracle_fits(tasks: Sequence[Task], env: EnvConfig) -> None:
    """A clear error when an oracle needs more turns than `env.max_turns` allows (its replays could not solve)."""
    submit = 1 if env.unsubmitted == "zero" else 0  # a fix left at the cap counts only when graded there
    for task in tasks:
        needed = len(oracle_turns(task)) + submit
        if needed > env.max_turns:
            raise ConfigError(
                f"the oracle of task {task.id!r} takes {needed} turns (commands, then a submission when "
                f"env.unsubmitted is zero) but env.max_turns is {env.max_turns}: raise env.max_turns"
            )


def to_sample(trajectory: Trajectory, advantage: float = 0.0) -> Sample:
    return Sample(
        token_ids=trajectory.token_ids,
        loss_mask=trajectory.loss_mask,
        advantage=advantage,
        engine_logprobs=trajectory.engine_logprobs,
        group_id=trajectory.task_id,
    )


def to_samples(trajectory: Trajectory, advantage: float = 0.0) -> list[Sample]:
    """Its samples, all with `advantage`: its tokens and each earlier segment of a split scaffold episode."""
    earlier = [
        Sample(s["token_ids"], s["loss_mask"], advantage, s["engine_logprobs"], group_id=trajectory.task_id)
        for s in trajectory.segments
    ]
    return [*earlier, to_sample(trajectory, advantage)]


class TaskStream:
    """An endless, seeded stream of train tasks (a fresh shuffle per epoch) that counts its draws."""

    def __init__(self, tasks: list[Task], seed: int, skip: int = 0) -> None:
        self._order = self._epochs(tasks, seed)
        self.drawn = skip
        for _ in range(skip):  # the draws of the run this one resumes
            next(self._order)

    @staticmethod
    def _epochs(tasks: list[Task], seed: int) -> Iterator[Task]:
        for epoch in itertools.count():
            order = list(tasks)
            random.Random(seed * 100_003 + epoch).shuffle(order)
            yield from order

    def __iter__(self) -> TaskStream:
        return self

    def __next__(self) -> Task:
        self.drawn += 1
        return next(self._order)


class Pipeline:
    """One run; see the module docstring."""

    def __init__(self, config: RunConfig, *, console: Console | None = None) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.console = console or Console()
        self.state_path = self.run_dir / STATE_FILE
        self.state = RunState()
        self.results: dict[str, dict[str, float]] = {}
        self.engine: Any = None
        self.trainer: Any = None
        self.backend: Any = None
        self.cluster: Any = None
        self.endpoint: Any = None  # the recording endpoint, for an external agent scaffold
        self.scaffold: Any = None
        self.log: EventLog | None = None

    # -- set-up ----------------------------------------------------------------------------
    def _model_dir(self) -> Path:
        """The policy's folder: model.path's (a Hub id is fetched into the HF cache once), or the tiny model's."""
        return fetch_model(self.config.model.path) if self.config.model.path else model_dir(self.config)

    def _model_path(self) -> Path:
        cfg = self.config.model
        path = self._model_dir()
        if not cfg.path and not (path / "config.json").exists():
            from patchgym.models.tiny import init_tiny_model

            init_tiny_model(path, seed=self.config.seed, **(cfg.init_tiny or {}))
        return path

    def _sinks(self) -> list[Sink]:
        sinks: list[Sink] = []
        if self.config.metrics.tensorboard:
            sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        if self.config.metrics.wandb_project:
            sinks.append(
                WandbSink(self.run_dir, self.config.metrics.wandb_project, mode=self.config.metrics.wandb_mode)
            )
        return sinks

    async def _setup(self, resume: bool) -> None:
        from transformers import AutoTokenizer

        check_config(self.config)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume and self.state_path.exists():
            self.state = RunState.load(self.state_path)
            truncate_events(self.run_dir, self.state.events_offset)
            self.results = {e["stage"]: e for e in read_events(self.run_dir, "eval")}
        self.log = EventLog(self.run_dir, self._sinks())
        self.log.emit(
            "run", event="resume" if resume else "start", config=self.config.model_dump(), state=self.state.state_dict()
        )
        self._save_state()  # the run's label is on record before its first sandbox starts
        model_path = self._model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        reg = registry()
        c = self.config
        self.train_tasks: TaskSet = reg.create("task_set", c.tasks.train.name, **c.tasks.train.options)
        self.eval_tasks: TaskSet = reg.create("task_set", c.tasks.eval.name, **c.tasks.eval.options)
        self.backend = RunLabelledBackend(reg.create("sandbox", c.sandbox.name, **c.sandbox.options), self.state.run_id)
        if resume:
            reaped = await self.backend.reap_run()
            self.log.emit("run", event="reaped", sandboxes=reaped)
        # Engines start first and come up while the trainer ranks meet and build the model.
        with run_logs(self.run_dir):
            if c.cluster is not None:  # trainer ranks and engines as Ray actors (Ray is imported only here)
                from patchgym.launch.ray_cluster import RayCluster

                placement = plan_placement(c.cluster, c.trainer.options, c.inference.options)
                self.cluster = RayCluster(c.cluster, placement)
                self.engine = self.cluster.sglang(model_path, **c.inference.options)
                self.trainer = self.cluster.megatron(model_path, **c.trainer.options)
            else:
                self.engine = reg.create("inference", c.inference.name, model=str(model_path), **c.inference.options)
                self.trainer = reg.create("trainer", c.trainer.name, model=str(model_path), **c.trainer.options)
        await start_parts([self.engine, self.trainer])
        if c.agent.scaffold != "builtin":
            self.scaffold = load_scaffold(c.agent.scaffold, c.agent.scaffold_options)
            endpoint = RecordingEndpoint(self.engine, self.tokenizer, RecordingLimits.of(c.agent))
            self.endpoint = await endpoint.start()
        self.weight_sync = WeightSync(
            self.trainer,
            self.engine,
            mode=c.weight_sync,
            run_dir=self.run_dir,
            verify=c.verify_sync,
            tolerance=c.verify_sync_tolerance,
            probe=probe_ids(self.tokenizer),
            timeout_s=c.weight_sync_timeout_s,
        )
        settings = {name: getattr(part, "settings", dict)() for name, part in self._parts().items()}
        self.log.emit("launch", weight_sync=self.weight_sync.settings(), **settings)
        checkpoint = self.run_dir / "checkpoints" / "latest"
        if resume and checkpoint.exists():
            await self.trainer.load(checkpoint)
            await self._sync_weights(self.state.version)

    def _parts(self) -> dict[str, Any]:
        parts = {"inference": self.engine, "trainer": self.trainer, "sandbox": self.backend}
        if self.endpoint is not None:  # closes before the engine behind it
            parts = {"endpoint": self.endpoint, **parts}
        return {**parts, "cluster": self.cluster} if self.cluster is not None else parts  # the cluster closes last

    async def aclose(self) -> None:
        """Stop everything that was started (servers, ranks, sandboxes), also after a failed set-up."""
        try:
            if self.backend is not None:
                await self.backend.reap_run()  # what a cancelled episode could not close (Ctrl-C, a failed stage)
        finally:
            try:
                await close_parts(list(self._parts().values()))
            finally:
                if self.log is not None:
                    self.log.close()

    # -- shared pieces ---------------------------------------------------------------------
    async def _episode(self, task: Task, engine: Any, agent: AgentConfig) -> Trajectory:
        env = AsyncSWEEnv(self.train_tasks, self.backend, config=self.config.env)
        try:
            if self.scaffold is not None and engine is self.engine:  # oracle replays stay in patchgym's own loop
                return await self._scaffold_episode(env, task, agent)
            return await run_agent(env, engine, self.tokenizer, task, agent)
        finally:
            await env.close()

    async def _scaffold_episode(self, env: AsyncSWEEnv, task: Task, agent: AgentConfig) -> Trajectory:
        key, recorder = self.endpoint.open(RecordingLimits.of(agent))
        try:
            return await run_scaffold(
                env,
                self.scaffold,
                recorder,
                self.endpoint.base_url,
                key,
                task,
                engine_fault=lambda: self.endpoint.close(key),  # the key closes as the scaffold returns
            )
        finally:
            self.endpoint.close(key)

    async def _sync_weights(self, version: int) -> SyncReport:
        report = await self.weight_sync(version)
        self.log.emit("weight_sync", **report.as_dict())
        return report

    def _save_state(self) -> None:
        self.state.events_offset = self.log.position()
        self.state.save(self.state_path)

    async def _checkpoint(self) -> None:
        staging = self.run_dir / "checkpoints" / "staging"
        await self.trainer.save(staging)
        latest = self.run_dir / "checkpoints" / "latest"
        if latest.exists():
            old = latest.with_name("previous")
            if old.exists():
                await asyncio.to_thread(shutil.rmtree, old)
            latest.rename(old)
        staging.rename(latest)
        self._save_state()

    async def _export(self, name: str) -> None:
        """The policy as a Hugging Face model directory, `exports/NAME` in the run directory."""
        started = time.perf_counter()
        path = await export_policy(self.trainer, self.run_dir / "exports" / name)
        self.log.emit("export", name=name, path=str(path), seconds=time.perf_counter() - started)

    def _stage_done(self, stage: str) -> None:
        self.state.stages_done.append(stage)
        self._save_state()

    # -- stages ------------------------------------------------------------------------------
    async def evaluate(self, stage: str) -> dict[str, float]:
        c = self.config.eval
        tasks = list(self.eval_tasks)[: c.limit]
        agent = self.config.agent.model_copy(update={"temperature": c.temperature})
        gate = asyncio.Semaphore(c.concurrency)
        score = RunningScore()
        with self._progress() as progress:
            bar = progress.add_task(f"eval ({stage})", total=len(tasks) * c.attempts, unit="episode")

            async def attempt(task: Task) -> Trajectory:
                async with gate:
                    trajectory = await self._episode(task, self.engine, agent)
                self.log.emit("trajectory", stage=f"eval-{stage}", **describe(trajectory))  # as it ends
                progress.update(bar, advance=1, **score.add(trajectory))
                return trajectory

            runs = await asyncio.gather(*(attempt(t) for t in tasks for _ in range(c.attempts)))
        per_task: dict[str, list[float]] = {}
        for trajectory in runs:
            if trajectory.trainable:
                per_task.setdefault(trajectory.task_id, []).append(float(trajectory.resolved))
        scored = [rewards for rewards in per_task.values() if rewards]
        result = {
            "pass_at_1": sum(sum(r) / len(r) for r in scored) / len(scored) if scored else 0.0,
            "pass_at_k": sum(any(r) for r in scored) / len(scored) if scored else 0.0,
            "k": c.attempts,
            "tasks": len(scored),
            "infra_errors": sum(1 for t in runs if t.infra_error),
            **episode_stats(runs),
        }
        self.log.emit("eval", stage=stage, step=self.state.grpo_step, **result)
        self.results[stage] = result
        self.console.print(eval_line(stage, result), highlight=False, soft_wrap=True)  # one line in a log file too
        return result

    def _token_cap(self) -> int:
        """The longest SFT trace: the agent's trajectory cap, the engine's context, the trainer's micro-batch budget."""
        caps = [self.config.agent.max_tokens_per_trajectory, self.engine.max_context]
        budget = getattr(self.trainer, "micro_batch_tokens", None)
        return min(caps if budget is None else [*caps, budget])

    async def _oracle_samples(self, progress: Progress, tally: TraceTally, cap: int, too_long: TooLong) -> list[Sample]:
        """Replay each train task's solution through the env; solved replays are the traces."""
        tasks = list(self.train_tasks)
        check_oracle_fits(tasks, self.config.env)
        turn_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        bar = progress.add_task("sft traces (oracle)", total=len(tasks), unit="trace")

        actions = self.config.env.actions
        policies = {task.id: OraclePolicy(self.tokenizer, task, turn_end, actions) for task in tasks}
        self._warn_unsayable(policies)
        gate = asyncio.Semaphore(self.config.sft.replay_concurrency)

        async def trace(task: Task) -> Trajectory:
            async with gate:
                trajectory = await self._episode(task, policies[task.id], self.config.agent)
            progress.advance(bar)
            return trajectory

        samples = []
        for trajectory in await asyncio.gather(*(trace(t) for t in tasks)):
            solved = trajectory.resolved
            skip = "oracle replay infra error" if trajectory.infra_error else "oracle replay not solved"
            sample = tally.admit(trajectory.task_id, to_sample(trajectory) if solved else None, skip, cap, too_long)
            if sample is not None:
                samples.append(sample)
        return samples

    def _warn_unsayable(self, policies: dict[str, OraclePolicy]) -> None:
        """Warn when oracle turns are longer than the policy may generate: it could never finish them."""
        cap = self.config.agent.max_new_tokens_per_turn
        over = {task_id: n for task_id, p in policies.items() if (n := p.longest_turn()) > cap}
        if over:
            message = (
                f"{len(over)} of {len(policies)} oracle replays have a turn longer than agent.max_new_tokens_per_turn "
                f"({max(over.values())} > {cap} tokens): the policy can never finish such a turn; raise the cap"
            )
            self.console.print(f"[yellow]warning:[/] {message}")
            self.log.emit("warning", stage="sft", message=message, task_ids=sorted(over)[:10])

    async def sft(self) -> None:
        cfg = self.config.sft
        cap = self._token_cap()
        samples: list[Sample] = []
        tallies: list[tuple[TraceSource, TraceTally]] = []
        with self._progress() as progress:
            for source in cfg.traces:
                tally = TraceTally()
                if source.format == "oracle":
                    samples += await self._oracle_samples(progress, tally, cap, cfg.too_long)
                else:
                    assert source.path is not None
                    bar = progress.add_task(f"sft traces ({source.path})", total=None)
                    traces = read_traces(
                        source.path,
                        source.format,
                        exit_statuses=source.exit_statuses,
                        resolved_only=source.resolved_only,
                    )
                    for sample in load_samples(traces, self.tokenizer, cap, cfg.too_long, tally):
                        samples.append(sample)
                        progress.update(bar, completed=tally.made)
                tallies.append((source, tally))
                self.console.print(f"sft traces from {source.path or 'the oracle'}: {tally.summary()}")
        total = TraceTally.total([tally for _, tally in tallies])
        sources = [{"source": s.path or "oracle", "format": s.format, **t.as_dict()} for s, t in tallies]
        limits = {"token_cap": cap, "too_long": cfg.too_long, "replay_concurrency": cfg.replay_concurrency}
        self.log.emit("sft_traces", **limits, sources=sources, **total.as_dict())
        if not samples and any(source.format != "oracle" for source in cfg.traces):
            raise ConfigError(f"no SFT trace is left to train on ({total.summary()}); see the sft_traces event")
        if cfg.lr is not None:
            await self.trainer.set_lr(cfg.lr)
        rng = random.Random(self.config.seed)
        steps = 0
        with self._progress() as progress:
            per_epoch = -(-len(samples) // cfg.batch_size)
            bar = progress.add_task("sft", total=per_epoch * cfg.epochs, unit="step")
            for _ in range(cfg.epochs):
                rng.shuffle(samples)
                for start in range(0, len(samples), cfg.batch_size):
                    metrics = await self.trainer.train_step(
                        TrainBatch(samples[start : start + cfg.batch_size]), SFTLoss()
                    )
                    steps += 1
                    self.log.emit("sft_step", step=steps, **metrics)
                    progress.advance(bar)
        self.state.version += 1
        await self._sync_weights(self.state.version)

    def _progress(self) -> Progress:
        return stage_progress(self.console, self.config.progress_interval_s)

    async def grpo(self) -> None:
        cfg = self.config.grpo
        tasks = list(self.train_tasks)
        stream = TaskStream(tasks, self.config.seed, self.state.tasks_drawn)
        by_id = {t.id: t for t in tasks}
        engine, agent = self.engine, self.config.agent
        manager = RolloutManager(
            stream,
            lambda task: self._episode(task, engine, agent),
            cfg.rollout,
            version=self.state.version,
            tally=GroupTally.from_state_dict(self.state.rollout) if self.state.rollout else None,
            restart=[by_id[i] for i in self.state.pending],
            resample=[by_id[i] for i in self.state.queued],
        )
        loss = GRPOLoss(cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.tis_cap)
        if cfg.lr is not None:
            await self.trainer.set_lr(cfg.lr)
        if cfg.reset_optimizer and self.state.grpo_step == 0:  # a resumed GRPO keeps its own moments
            await self.trainer.reset_optimizer()
        self._step_end = time.perf_counter()
        self._zero_watch = ZeroRewardWatch(cfg.zero_reward_warn_steps)
        try:
            with self._progress() as progress:
                done = self.state.grpo_step
                bar = progress.add_task("grpo", total=cfg.steps, completed=done, initial=done, unit="step")
                while self.state.grpo_step < cfg.steps:
                    batch = await manager.next_batch()
                    if batch is None:
                        break
                    await self._train_on(batch, loss, manager, stream)
                    members = [t for g in batch.groups for t in g.members]
                    progress.update(bar, advance=1, reward=batch.metrics["reward_mean"], pass_rate=pass_rate(members))
                    self._watch_rewards(batch.metrics["reward_mean"], episode_stats(members))
        finally:
            await manager.aclose()

    def _watch_rewards(self, reward_mean: float, stats: dict[str, Any]) -> None:
        """The zero-reward warning (`grpo.zero_reward_warn_steps`), once, on the console and in the events."""
        message = self._zero_watch.observe(reward_mean, stats)
        if message is not None:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False)
            self.log.emit("warning", stage="grpo", step=self.state.grpo_step, message=message)

    def _log_groups(self, batch: Batch) -> None:
        """Every trajectory of the step's groups, trained or set aside (with the reason), once."""
        for group in [*batch.groups, *batch.discarded]:
            for trajectory in [*group.members, *group.excluded, *group.retried]:
                extra = {"discarded": group.discarded} if group.discarded else {}
                self.log.emit(
                    "trajectory",
                    stage="grpo",
                    step=self.state.grpo_step,
                    group=group.serial,
                    **describe(trajectory),
                    **extra,
                )

    async def _train_on(self, batch: Batch, loss: GRPOLoss, manager: RolloutManager, stream: TaskStream) -> None:
        samples = []
        for group in batch.groups:
            advantages = group_advantages(group.rewards, normalize_std=self.config.grpo.loss.normalize_std)
            samples += [s for t, a in zip(group.members, advantages, strict=True) for s in to_samples(t, a or 0.0)]
        started = time.perf_counter()
        metrics = await self.trainer.train_step(TrainBatch(samples, temperature=self.config.agent.temperature), loss)
        actor_s = time.perf_counter() - started
        self.state.version += 1
        sync = await self._sync_weights(self.state.version)
        manager.publish(self.state.version)
        self.state.grpo_step += 1
        totals = manager.settle(batch)  # after publish: the stragglers it cancelled belong to this step
        self._log_groups(batch)
        trajectories = [t for g in batch.groups for t in g.members]
        now = time.perf_counter()
        wall_s, self._step_end = now - self._step_end, now
        timings = {"actor_update_s": actor_s, "rollout_wait_s": batch.metrics["rollout_wait_s"]}
        timings["weight_sync_s"] = sync.seconds
        self.log.emit(
            "step",
            step=self.state.grpo_step,
            # orchestration: the rest of the step's wall time (batch assembly, logging, the loop itself)
            timings={**timings, "orchestration_s": max(0.0, wall_s - sum(timings.values())), "step_s": wall_s},
            weight_sync=sync.as_dict(),
            response_length_mean=sum(sum(t.loss_mask) for t in trajectories) / len(trajectories),
            **episode_stats(trajectories),
            trainer=metrics,
            group_outcomes=[[g.serial, g.task.id, g.discarded or "trained"] for g in [*batch.groups, *batch.discarded]],
            accounting=totals,
            **{k: v for k, v in batch.metrics.items() if k != "rollout_wait_s"},
        )
        last = self.state.grpo_step == self.config.grpo.steps
        checkpoint = self.state.grpo_step % self.config.checkpoint_every == 0 or last
        if checkpoint:  # the rollouts' state as of this step's event, before anything else awaits
            self.state.tasks_drawn = stream.drawn
            self.state.pending = [g.task.id for g in manager.pending_groups()]
            self.state.queued = [t.id for t in manager.queued_tasks()]
            self.state.rollout = manager.tally.state_dict()
        every = self.config.export_every
        if last or (every is not None and self.state.grpo_step % every == 0):  # before the checkpoint: a resume
            await self._export(f"grpo-step-{self.state.grpo_step}")  # from it does not redo this export
        if checkpoint:
            await self._checkpoint()

    # -- the whole run -----------------------------------------------------------------------
    async def run(self, *, resume: bool = False) -> dict[str, dict[str, float]]:
        if torchrun_follower():  # a torchrun rank other than 0: it serves rank 0's trainer calls
            follow_torchrun(self._model_dir(), dict(self.config.trainer.options))
            return {}
        quiet_third_party_bars()
        try:
            await self._setup(resume)
            async with watched([self.engine, self.trainer]):
                await self._stages()
        finally:
            await self.aclose()
        self._print_results()
        return self.results

    async def _stages(self) -> None:
        done = self.state.stages_done
        if "eval-base" not in done:
            await self.evaluate("base")
            self._stage_done("eval-base")
        if self.config.sft.enabled and "sft" not in done:
            await self.sft()
            await self._export("sft")
            await self._checkpoint()
            self._stage_done("sft")
        if self.config.sft.enabled and "eval-sft" not in done:
            await self.evaluate("sft")
            self._stage_done("eval-sft")
        if self.config.grpo.enabled and "grpo" not in done:
            await self.grpo()
            self._stage_done("grpo")
        if self.config.grpo.enabled and "eval-grpo" not in done:
            await self.evaluate("grpo")
            self._stage_done("eval-grpo")
        self.log.emit("run", event="end", results=self.results)

    def _print_results(self) -> None:
        k = self.config.eval.attempts
        columns = ("stage", "pass@1", f"pass@{k}", "tasks", "commands", "submitted", "at turn cap")
        table = Table(*columns, title=f"held-out evaluation ({self.run_dir})")
        for stage, r in self.results.items():
            shape = [f"{r.get('commands_mean', 0.0):.2f}", f"{r.get('submit_rate', 0.0):.1%}"]
            shape.append(f"{r.get('turn_cap_share', 0.0):.1%}")
            table.add_row(stage, f"{r['pass_at_1']:.1%}", f"{r['pass_at_k']:.1%}", str(r["tasks"]), *shape)
        self.console.print(table)
