"""Resumable checkpoints of the Megatron trainer: megatron-core's distributed checkpointing.

`save` writes one `torch_dist` checkpoint (PyTorch distributed checkpoint files plus megatron's
`metadata.json` and `common.pt`): the model's sharded state dict (each tensor once, whatever
its TP, EP or PP split) and the optimizer's, which holds the Adam moments and the float32 main
parameters of a bf16 model. The distributed optimizer's state is written in megatron's
`dp_reshardable` format: each gradient bucket's state as one tensor that the data-parallel
ranks hold slices of, with no data exchange at save or load, readable at another data-parallel
size (not at another TP/PP split: resharding those needs `fully_reshardable`, which gathers the
state over the data-parallel ranks). Every rank writes its own shards in parallel (megatron's
fully parallel strategy spreads replicated tensors over the data-parallel ranks). `load` reads
what this rank's shards need, then restores the step counters and rank 0's RNG state (CPU
generators only: every rank seeds and draws alike). The Hugging Face export is separate
(`MegatronTrainer.export`).
"""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from patchgym.backends.trainer.common import rng_state, set_rng_state
from patchgym.core.errors import ConfigError

FORMAT = "patchgym-megatron-dist-v1"
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
"""Optimizer checkpoint metadata: reshardable over data parallelism, no per-optimizer key prefix
(megatron-core 0.16's `fully_sharded_model_space` builds shards its own validation refuses)."""
INFO_FILE = "megatron.json"


def _sharded_state(trainer: Any, *, loading: bool) -> dict[str, Any]:
    model = trainer.gpt.sharded_state_dict()
    return {
        "model": model,
        "optimizer": trainer.optimizer.sharded_state_dict(model, is_loading=loading, metadata=SHARDING),
    }


def _save_strategy(group: Any) -> Any:
    """torch_dist, with the writing of replicated tensors spread over the data-parallel ranks.

    megatron's writer collects its write results in a module-level queue, by default a
    `multiprocessing.Manager().Queue()`: a server process that outlives a rank killed by a signal.
    Our saves are synchronous (the results are put and read in this process), so a thread queue
    serves and no process is started.
    """
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), group)


def _torch_adams(trainer: Any) -> list[Any]:
    """The torch Adam(W) optimizers inside megatron's (TransformerEngine's and Apex's Adam keep the
    step count in their parameter groups, which megatron's checkpoint handles itself)."""
    inner = [optimizer.optimizer for optimizer in trainer._optimizers()]
    return [o for o in inner if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


def _init_adam_state(trainer: Any) -> None:
    """Give every parameter without Adam state torch's initial state (step 0, zero moments): what a
    fresh optimizer would start with, and what megatron's checkpoint code expects to find."""
    for optimizer in _torch_adams(trainer):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not optimizer.state[param]:
                    optimizer.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def _adam_steps(trainer: Any) -> list[float | None]:
    """Each torch optimizer's Adam step count (None: no state yet)."""
    steps = []
    for optimizer in _torch_adams(trainer):
        counts = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
        if len(counts) > 1:
            raise RuntimeError(f"parameters of one optimizer are at different Adam steps: {sorted(counts)}")
        steps.append(counts.pop() if counts else None)
    return steps


def _set_adam_steps(trainer: Any, steps: list[float | None]) -> None:
    """Restore the Adam step counts. megatron-core 0.16's `dp_reshardable` load keeps the step the
    loading optimizer had (a fresh one's: 0), and shares one tensor between parameters."""
    for optimizer, step in zip(_torch_adams(trainer), steps, strict=True):
        for state in optimizer.state.values():
            if step is not None and "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def save(trainer: Any, directory: Path) -> None:
    """Write the trainer's distributed checkpoint to `directory` (every rank takes part)."""
    from megatron.core import dist_checkpointing

    checkpoint = directory / "dist"
    if trainer.rank == 0:
        checkpoint.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with torch.no_grad():
        _init_adam_state(trainer)
        state = _sharded_state(trainer, loading=False)
    state["patchgym"] = {
        "format": FORMAT,
        "version": trainer.version,
        "step": trainer.step_count,
        "adam_steps": _adam_steps(trainer),
        "rng": rng_state(),
    }
    group = trainer.ps.get_data_parallel_group(with_context_parallel=True)
    dist_checkpointing.save(state, str(checkpoint), sharded_strategy=_save_strategy(group))
    if trainer.rank == 0:
        (directory / INFO_FILE).write_text(json.dumps({"format": FORMAT, **trainer.settings()}))
    dist.barrier()


def load(trainer: Any, directory: Path) -> None:
    """Restore model, optimizer (main parameters and moments), counters and RNG from `save`'s checkpoint."""
    from megatron.core import dist_checkpointing

    checkpoint = directory / "dist"
    if not (checkpoint / "metadata.json").is_file():
        raise ConfigError(
            f"{directory} is not a megatron distributed checkpoint (no dist/metadata.json); checkpoints of "
            "patchgym before distributed checkpointing (megatron_state_rank*.pt) cannot be resumed"
        )
    # no_grad: in float32 the distributed optimizer's main parameters are views of the model's
    # parameters (leaves that require grad), which the load writes in place
    with torch.no_grad():
        _init_adam_state(trainer)
        state = dist_checkpointing.load(_sharded_state(trainer, loading=True), str(checkpoint))
        if state["patchgym"].get("format") != FORMAT:
            raise ConfigError(f"{checkpoint}: unknown checkpoint format {state['patchgym'].get('format')!r}")
        trainer.gpt.load_state_dict(state["model"], strict=True)
        trainer.optimizer.load_state_dict(state["optimizer"])
        _set_adam_steps(trainer, state["patchgym"]["adam_steps"])
    trainer.model.zero_grad_buffer()
    set_rng_state(state["patchgym"]["rng"])
    trainer.version, trainer.step_count = state["patchgym"]["version"], state["patchgym"]["step"]
