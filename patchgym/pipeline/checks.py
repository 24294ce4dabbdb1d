"""The checks `patchgym run` makes before anything is written, built or heavily imported.

The run configuration's schema is checked by `load_run_config`; `check_config` then checks
every registered name and its options, and every file the config names. The task sets and the
sandbox come first (their options need no torch), so a mistake there is refused in well under
a second; the trainer's and engine's options are read from their factories' signatures, which
imports them (torch and transformers, seconds).
"""

from __future__ import annotations

from pathlib import Path

from patchgym.core.errors import ConfigError
from patchgym.core.plugins import registry
from patchgym.launch.cluster import plan_placement
from patchgym.pipeline.config import RunConfig
from patchgym.pipeline.model_source import is_hub_id
from patchgym.pipeline.traces import trace_files


def check_config(config: RunConfig) -> None:
    """Every registered name and its options, and every file the config names, checked before
    anything is written or built: a mistake is a `ConfigError` at once, not after the base evaluation."""
    check_light_parts(config)
    check_files(config)
    check_model_parts(config)


def check_parts(config: RunConfig) -> None:
    """Every registered name and the options it is given (no file is read); light parts first."""
    check_light_parts(config)
    check_model_parts(config)


def check_light_parts(config: RunConfig) -> None:
    """The task sets, the sandbox and the cluster placement: nothing heavy is imported."""
    reg = registry()
    reg.check("task_set", config.tasks.train.name, config.tasks.train.options)
    reg.check("task_set", config.tasks.eval.name, config.tasks.eval.options)
    reg.check("sandbox", config.sandbox.name, config.sandbox.options)
    if config.cluster is not None:
        plan_placement(config.cluster, config.trainer.options, config.inference.options)


def check_model_parts(config: RunConfig) -> None:
    """The trainer and the engine (their options are read from their factories: torch is imported)."""
    reg = registry()
    model = {"model": config.model.path or "<model-init>"}
    reg.check("trainer", config.trainer.name, {**model, **config.trainer.options})
    reg.check("inference", config.inference.name, {**model, **config.inference.options})
    if config.agent.scaffold != "builtin":  # an external scaffold's package is imported here
        from patchgym.envs.scaffold import load_scaffold

        load_scaffold(config.agent.scaffold, config.agent.scaffold_options)


def check_files(config: RunConfig) -> None:
    """The model folder (a Hub id is fetched when the run starts) and the SFT trace files exist."""
    path = config.model.path
    if path is not None and not Path(path).is_dir() and not is_hub_id(path):
        raise ConfigError(
            f"model.path {path!r} is not a folder (a Hugging Face model) nor a Hub id such as Qwen/Qwen3-0.6B"
        )
    if config.sft.enabled:
        for source in config.sft.traces:
            if source.path is not None:
                trace_files(source.path)


def model_dir(config: RunConfig) -> Path:
    """The policy's folder: `model.path`, or `RUN_DIR/model-init` where a tiny model is created.
    (A Hub id's folder is known once it is fetched: `patchgym.pipeline.model_source.fetch_model`.)"""
    return Path(config.model.path) if config.model.path else Path(config.run_dir) / "model-init"
