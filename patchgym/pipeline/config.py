"""The run configuration of `patchgym run CONFIG.yaml` (unknown keys are errors with suggestions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from patchgym.core.config import load_yaml
from patchgym.core.rollout import RolloutConfig
from patchgym.envs.agent import AgentConfig
from patchgym.envs.swe import EnvConfig
from patchgym.launch.cluster import ClusterSettings
from patchgym.pipeline.traces import TooLong, TraceFormat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Component(_Strict):
    """A registered part by name, with the options its factory takes."""

    name: str = Field(description="the registered name (`patchgym plugins` lists them) or module:attr")
    options: dict[str, Any] = Field({}, description="the part's options (listed below for the built-in parts)")


class ModelConfig(_Strict):
    """The policy: an HF-format folder, or a tiny random model created in the run directory."""

    path: str | None = Field(
        None,
        description="the policy: a Hugging Face model folder, or a Hub id (e.g. Qwen/Qwen3-0.6B) downloaded "
        "into the Hugging Face cache at the start of the run; the same for every backend",
    )
    init_tiny: dict[str, Any] | None = Field(None, description="Qwen3Config overrides for a new tiny model")
    hf_config: dict[str, Any] | None = Field(
        None,
        description="the model's config.json keys (hidden_size, num_hidden_layers, ...), for `--dry-run` where `path` "
        "is not on this machine: it checks the layout and estimates memory from them (path/config.json, when "
        "there, must agree)",
    )


class TasksConfig(_Strict):
    """The task sets: one to train on (SFT oracle replays, GRPO) and one held out for evaluation."""

    train: Component = Field(description="the task set trained on")
    eval: Component = Field(description="the held-out task set of every evaluation")


class TraceSource(_Strict):
    """Where SFT traces come from: the oracle (each train task's solution replayed through the env)
    or a trace file, JSONL file or directory of trajectory files (see patchgym.pipeline.traces)."""

    format: Literal["oracle", TraceFormat] = Field(
        "auto", description="oracle, or the file format (auto: told apart by the records)"
    )
    path: str | None = Field(None, description="a trace file or a folder of them (not for the oracle)")
    exit_statuses: list[str] | None = Field(
        ["Submitted"], description="mini-swe-agent trajectories kept by info.exit_status (null: all)"
    )
    resolved_only: bool = Field(True, description='skip records that say "resolved": false')

    @model_validator(mode="after")
    def _path_matches_format(self) -> TraceSource:
        if self.format == "oracle" and self.path is not None:
            raise ValueError("the oracle source replays the train tasks and takes no path")
        if self.format != "oracle" and self.path is None:
            raise ValueError(f"a {self.format} trace source needs a path (a file or a directory)")
        return self


class SFTConfig(_Strict):
    """Supervised fine-tuning on traces, between the base and the SFT evaluation."""

    enabled: bool = Field(True, description="run the SFT stage and the evaluation after it")
    epochs: int = Field(1, ge=1, description="passes over the traces")
    batch_size: int = Field(16, ge=1, description="traces per optimiser step")
    lr: float | None = Field(None, gt=0, description="peak learning rate of this stage (None: the trainer's lr)")
    traces: list[TraceSource] = Field(
        default_factory=lambda: [TraceSource(format="oracle")],
        description='"oracle", a source {path, format} or a list of them',
    )
    replay_concurrency: int = Field(32, ge=1, description="oracle replays (episodes and their sandboxes) run at once")
    too_long: TooLong = Field(
        "skip",
        description="traces over the token cap (the agent's trajectory cap, the engine's context, the trainer's "
        "micro-batch budget): skip them or truncate them",
    )

    @field_validator("traces", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        if value == "oracle" or isinstance(value, dict):
            value = [value]
        if isinstance(value, str):
            raise ValueError(f'{value!r} is not a trace source: write "oracle", or {{path: {value}}} for a file')
        if not isinstance(value, list):
            raise ValueError('write "oracle", a source {path: ..., format: ...} or a list of them')
        return [{"format": "oracle"} if item == "oracle" else item for item in value]


class LossConfig(_Strict):
    """The GRPO loss: a clipped policy-gradient objective with truncated importance sampling."""

    clip_low: float = Field(0.2, description="the ratio's lower clip is 1 - clip_low")
    clip_high: float = Field(0.28, description="the ratio's upper clip is 1 + clip_high (above clip_low: clip-higher)")
    tis_cap: float | None = Field(
        2.0, description="cap of the trainer/engine probability ratio that reweights stale samples (null: off)"
    )
    normalize_std: bool = Field(True, description="divide group advantages by the group's reward std")


class GRPOConfig(_Strict):
    """GRPO on the policy's own rollouts, between the SFT and the final evaluation."""

    enabled: bool = Field(True, description="run the GRPO stage and the evaluation after it")
    steps: int = Field(10, ge=0, description="optimiser steps, each on batch_groups groups of group_size episodes")
    reset_optimizer: bool = Field(
        True, description="start GRPO with fresh optimiser moments and warm-up (SFT's would distort its steps)"
    )
    lr: float | None = Field(None, gt=0, description="peak learning rate of this stage (None: the trainer's lr)")
    rollout: RolloutConfig = Field(RolloutConfig(), description="how GRPO groups are sampled and batched")
    zero_reward_warn_steps: int | None = Field(
        10,
        ge=1,
        description="warn (console and a warning event) when every episode earned 0 for this many steps in a row, "
        "with likely causes (null: never)",
    )
    loss: LossConfig = LossConfig()


class EvalConfig(_Strict):
    """The held-out evaluations (base, after SFT, after GRPO): pass@1 and pass@k."""

    attempts: int = Field(4, ge=1, description="episodes per task: pass@1 is averaged over them")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of evaluation episodes (0: greedy)")
    concurrency: int = Field(16, ge=1, description="evaluation episodes (and their sandboxes) at once")
    limit: int | None = Field(None, ge=1, description="only the first N eval tasks")


class MetricsConfig(_Strict):
    """Where metrics go besides RUN_DIR/events.jsonl: TensorBoard and Weights & Biases."""

    tensorboard: bool = Field(False, description="write TensorBoard scalars to RUN_DIR/tensorboard")
    wandb_project: str | None = Field(
        None, description="log to this Weights & Biases project (needs the wandb extra; null: off)"
    )
    wandb_mode: str | None = Field(None, description="wandb's mode: online, offline or disabled (null: wandb's own)")


class RunConfig(_Strict):
    run_dir: str = Field("runs/patchgym", description="where events, checkpoints and plots go (--resume takes it)")
    seed: int = Field(0, description="seeds the tiny model, the task order, SFT shuffling and sampling")
    model: ModelConfig = ModelConfig()
    tasks: TasksConfig
    sandbox: Component = Component(name="local")
    inference: Component = Component(name="embedded")
    trainer: Component = Component(name="embedded")
    env: EnvConfig = EnvConfig()
    agent: AgentConfig = AgentConfig()
    sft: SFTConfig = SFTConfig()
    grpo: GRPOConfig = GRPOConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint_every: int = Field(5, ge=1, description="GRPO steps between (resumable) checkpoints")
    export_every: int | None = Field(
        None,
        ge=1,
        description="GRPO steps between Hugging Face exports of the policy (RUN_DIR/exports/grpo-step-N); "
        "none: only at the end of SFT and of GRPO",
    )
    progress_interval_s: float = Field(
        30.0, gt=0, description="seconds between progress lines when the output is not a terminal (a log file)"
    )
    weight_sync: Literal["auto", "distributed", "tensor", "disk"] = Field(
        "auto", description="trainer -> engine transport (auto: distributed to engines in other processes)"
    )
    verify_sync: bool = Field(False, description="after each sync, compare engine and trainer log-probs of a probe")
    verify_sync_tolerance: float = Field(1e-4, gt=0, description="largest probe log-prob gap verify_sync accepts")
    weight_sync_timeout_s: float = Field(
        600.0, gt=0, description="seconds a distributed sync waits for every engine rank to join its group"
    )
    metrics: MetricsConfig = MetricsConfig()
    cluster: ClusterSettings | None = Field(
        None, description="run trainer ranks and engines on a Ray cluster (patchgym.launch.cluster); none: this machine"
    )

    @model_validator(mode="after")
    def _cluster_parts(self) -> RunConfig:
        if self.cluster is None:
            return self
        if (self.trainer.name, self.inference.name) != ("megatron", "sglang"):
            raise ValueError(
                f"cluster: ray places megatron trainer ranks and sglang engines, not trainer {self.trainer.name!r} "
                f"and inference {self.inference.name!r}: use trainer: megatron and inference: sglang, or drop cluster"
            )
        if self.weight_sync == "tensor":
            raise ValueError(
                "weight_sync: tensor shares memory with engines on the driver's machine; under cluster: use "
                "distributed (auto) or disk"
            )
        return self

    @model_validator(mode="after")
    def _grpo_samples(self) -> RunConfig:
        if self.grpo.enabled and self.grpo.steps and self.agent.temperature == 0:
            raise ValueError(
                "agent.temperature is 0 (greedy) but GRPO learns from sampled rollouts: set agent.temperature > 0 "
                "(evaluation has its own eval.temperature)"
            )
        return self


def load_run_config(path: str | Path) -> RunConfig:
    return load_yaml(RunConfig, path)
