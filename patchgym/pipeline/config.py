"""The run configuration of `patchgym run CONFIG.yaml` (unknown keys are errors with suggestions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from patchgym.core.config import load_yaml
from patchgym.core.rollout import RolloutConfig
from patchgym.envs.agent import AgentConfig
from patchgym.envs.swe import EnvConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Component(_Strict):
    """A registered part by name, with the options its factory takes."""

    name: str
    options: dict[str, Any] = {}


class ModelConfig(_Strict):
    """The policy: an HF-format folder, or a tiny random model created in the run directory."""

    path: str | None = None
    init_tiny: dict[str, Any] | None = Field(None, description="Qwen3Config overrides for a new tiny model")


class TasksConfig(_Strict):
    train: Component
    eval: Component


class SFTConfig(_Strict):
    enabled: bool = True
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1, description="traces per optimiser step")
    lr: float | None = Field(None, gt=0, description="peak learning rate of this stage (None: the trainer's lr)")
    traces: str = Field("oracle", description='"oracle": replay each train task\'s solution through the env')


class LossConfig(_Strict):
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    normalize_std: bool = True


class GRPOConfig(_Strict):
    enabled: bool = True
    steps: int = Field(10, ge=0)
    lr: float | None = Field(None, gt=0, description="peak learning rate of this stage (None: the trainer's lr)")
    rollout: RolloutConfig = RolloutConfig()
    loss: LossConfig = LossConfig()


class EvalConfig(_Strict):
    attempts: int = Field(4, ge=1, description="episodes per task: pass@1 is averaged over them")
    temperature: float = Field(1.0, ge=0)
    concurrency: int = Field(16, ge=1)
    limit: int | None = Field(None, ge=1, description="only the first N eval tasks")


class MetricsConfig(_Strict):
    tensorboard: bool = False
    wandb_project: str | None = None
    wandb_mode: str | None = None


class RunConfig(_Strict):
    run_dir: str = "runs/patchgym"
    seed: int = 0
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
    checkpoint_every: int = Field(5, ge=1, description="GRPO steps between checkpoints")
    metrics: MetricsConfig = MetricsConfig()


def load_run_config(path: str | Path) -> RunConfig:
    return load_yaml(RunConfig, path)
