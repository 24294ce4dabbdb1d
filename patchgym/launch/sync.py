"""The weight hand-off from the trainer to the engines, once per policy version.

`weight_sync` picks the transport: `tensor` (the state dict itself: in-process engines; shared
memory for SGLang on this host), `distributed` (trainer rank 0 broadcasts over a process group
that holds every engine rank, in buckets: `DistributedWeights`), `disk` (an HF export under
`RUN_DIR/weights/`, loaded by every engine) or `auto`: distributed when the engines are other
processes, tensor otherwise. Each sync pauses generation, sends version-tagged weights and
resumes; it reports seconds, bytes and the version every engine then holds. With `verify`
the engines' log-probs of a fixed probe sequence are compared with the trainer's after each
sync: a gap over `tolerance` stops the run.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from patchgym.core.batch import Sample, TrainBatch
from patchgym.core.errors import ConfigError, InfraError
from patchgym.launch.engines import free_port

SyncMode = Literal["auto", "distributed", "tensor", "disk"]
PROBE_TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n"
"""The probe sequence `verify` scores on both sides (tokenised with the run's tokenizer)."""


class WeightSyncError(InfraError):
    """The engines do not hold the weights the trainer sent, or did not all take them."""

    kind = "weight_sync"
    retryable = False


@dataclass(frozen=True)
class SyncReport:
    """One sync: how, how long, how many bytes, what each engine then holds."""

    version: int
    mode: str
    seconds: float
    bytes: int
    groups: int = 0
    """Process groups the weights crossed (distributed: one per trainer pipeline stage), 0 otherwise."""
    engine_versions: list[int] | None = None
    logprob_gap: float | None = None
    """Max |trainer - engine| log-prob over the probe's tokens and every engine (with `verify`)."""
    masters: list[str] | None = None
    """Distributed: where each group met ("address:port" of the trainer rank hosting it)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_mode(mode: SyncMode, engine: Any) -> str:
    """`auto` → distributed for engines in other processes, tensor for an engine in this one."""
    separate = bool(getattr(engine, "out_of_process", False))
    if mode == "auto":
        return "distributed" if separate else "tensor"
    if mode == "distributed" and not separate:
        raise ConfigError("weight_sync: distributed needs engines in other processes (e.g. sglang); use tensor")
    return mode


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def probe_ids(tokenizer: Any, text: str = PROBE_TEXT) -> list[int]:
    ids = tokenizer(text)["input_ids"]
    return list(ids)


class WeightSync:
    """Sends the trainer's weights to the engine; see the module docstring."""

    def __init__(
        self,
        trainer: Any,
        engine: Any,
        *,
        mode: SyncMode = "auto",
        run_dir: Path,
        verify: bool = False,
        tolerance: float = 1e-4,
        probe: Sequence[int] = (),
        timeout_s: float = 600.0,
    ) -> None:
        self.trainer, self.engine = trainer, engine
        self.mode = resolve_mode(mode, engine)
        self.run_dir = Path(run_dir)
        self.verify = verify
        self.tolerance = tolerance
        self.probe = list(probe)
        self.timeout_s = timeout_s
        if verify and (len(self.probe) < 2 or not hasattr(engine, "prompt_logprobs")):
            raise ConfigError(
                "verify_sync needs an engine that scores prompts (sglang) and a probe of at least 2 tokens"
            )

    def settings(self) -> dict[str, Any]:
        return {"mode": self.mode, "verify": self.verify, "tolerance": self.tolerance, "timeout_s": self.timeout_s}

    async def __call__(self, version: int) -> SyncReport:
        started = time.perf_counter()
        check = getattr(self.engine, "check_engines", None)
        if check is not None:
            check()  # a dead engine cannot take the weights: say which one, not a connection error
        weights, size = await self._payload(version)
        await self.engine.pause()
        try:
            await self.engine.update_weights(weights, version=version)
        finally:
            await self.engine.resume()
        seconds = time.perf_counter() - started
        versions = await self.engine.weight_versions() if hasattr(self.engine, "weight_versions") else None
        if versions is not None and any(v != version for v in versions):
            raise WeightSyncError(f"after sending version {version} the engines report versions {versions}")
        gap = await self._gap() if self.verify else None
        if gap is not None and gap > self.tolerance:
            raise WeightSyncError(
                f"after the sync of version {version} the engines' log-probs of the probe differ from the "
                f"trainer's by up to {gap:.3g} (verify_sync tolerance {self.tolerance:g}): the engines do not "
                "hold the trained weights"
            )
        groups = len(weights.groups) if hasattr(weights, "groups") else int(self.mode == "distributed")
        return SyncReport(version, self.mode, seconds, size, groups, versions, gap, _masters(weights))

    async def _payload(self, version: int) -> tuple[Any, int]:
        """What `update_weights` takes for this mode, and its size in bytes."""
        if self.mode == "disk":
            target = self.run_dir / "weights" / f"v{version}"
            exported = await self.trainer.weights(export_to=target)
            for old in target.parent.glob("v*"):  # only the newest export is kept
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)
            path = Path(exported.path or target)
            return str(path), sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        if self.mode == "distributed" and hasattr(self.trainer, "weight_stages"):
            return await self._staged(version)
        state = (await self.trainer.weights()).state_dict
        size = sum(t.numel() * t.element_size() for t in state.values())
        if self.mode == "tensor":
            return state, size
        from patchgym.backends.inference.sglang import DistributedWeights

        return DistributedWeights(state, master_port=free_port(), timeout_s=self.timeout_s), size

    async def _staged(self, version: int) -> tuple[Any, int]:
        """One group per trainer pipeline stage, hosted by that stage's sending rank (Megatron)."""
        from patchgym.backends.inference.sglang import StagedWeights, WeightGroup
        from patchgym.backends.inference.weight_group import split_buckets

        backend = group_backend(self.trainer.settings())
        world_size = sum(await self.engine.engine_ranks()) + 1
        groups, settings, buckets, size = [], [], [], 0
        for stage, tensors in enumerate(await self.trainer.weight_stages()):
            sizes = {name: _numel(shape) * _itemsize(dtype) for name, dtype, shape in tensors}
            size += sum(sizes.values())
            cut = split_buckets(sizes, self.engine.weight_bucket_bytes)
            name, (address, port) = f"patchgym_weights_v{version}_stage{stage}", await self._endpoint(stage)
            groups.append(WeightGroup(name, address, port, tensors, cut))
            settings.append(
                {
                    "master_address": address,
                    "master_port": port,
                    "world_size": world_size,
                    "backend": backend,
                    "group_name": name,
                    "timeout_s": self.timeout_s,
                }
            )
            buckets.append(cut)
        send = functools.partial(self.trainer.broadcast_weights, settings, buckets)
        return StagedWeights(groups, send, backend), size

    async def _endpoint(self, stage: int) -> tuple[str, int]:
        """Where stage `stage`'s group meets: where the trainer says (its ranks on other nodes: the
        stage leader's node), else on this machine's loopback."""
        endpoint = getattr(self.trainer, "weight_group_endpoint", None)
        return await endpoint(stage) if endpoint is not None else ("127.0.0.1", free_port())

    async def _gap(self) -> float:
        """Max |trainer - engine| log-prob of the probe's tokens (temperature 1), over every engine."""
        sample = Sample(self.probe, [0] + [1] * (len(self.probe) - 1))
        (mine,) = await self.trainer.logprobs(TrainBatch([sample], temperature=1.0))
        rows = await self.engine.prompt_logprobs(self.probe)
        return max(abs(a - b) for row in rows for a, b in zip(mine[1:], row[1:], strict=True))


def group_backend(trainer_settings: dict[str, Any]) -> str:
    """A staged weight group's backend: NCCL (RCCL on ROCm) when the trainer's tensors are on a GPU,
    else gloo. The trainer's device decides, not this process's: a Ray driver may have no GPU."""
    return "nccl" if str(trainer_settings.get("device", "cpu")).startswith("cuda") else "gloo"


def _masters(weights: Any) -> list[str] | None:
    """ "address:port" of each group a distributed sync formed (None for the other modes)."""
    groups = getattr(weights, "groups", None)
    if groups is not None:
        return [f"{g.master_address}:{g.master_port}" for g in groups]
    if hasattr(weights, "master_address"):
        return [f"{weights.master_address}:{weights.master_port}"]
    return None
