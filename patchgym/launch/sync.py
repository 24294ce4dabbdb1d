"""The weight hand-off from the trainer to the engines, once per policy version.

`weight_sync` picks the transport: `tensor` (the state dict itself: in-process engines; shared
memory for SGLang on this host), `distributed` (trainer rank 0 broadcasts over a process group
that holds every engine rank, in buckets: `DistributedWeights`), `disk` (an HF export under
`RUN_DIR/weights/`, loaded by every engine) or `auto`: distributed when the engines are other
processes, tensor otherwise. Each sync pauses generation, sends version-tagged weights and
resumes; it reports seconds, bytes and the version every engine then holds.

A Megatron trainer's distributed sync is staged and streamed (`megatron_sync`): one group per
pipeline stage, hosted by the stage's leader rank, which binds its port itself (held until the
group forms) and streams buckets of at most the trainer's `sync_bucket_bytes` (and the engine's
`weight_bucket_bytes`). The groups form at the first sync and are reused by every later one; they
are formed anew (a new name) when the engines' membership changes or after a sync failed. With `verify`
the engines' log-probs of a fixed probe sequence are compared with the trainer's after each
sync: a gap over `tolerance` stops the run.
"""

from __future__ import annotations

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
    bucket_bytes: int | None = None
    """Distributed: the most bytes one bucket may carry (the cut the sync asked for)."""
    groups_formed: bool | None = None
    """Staged: whether this sync formed its groups (the first, or after a change) or reused them."""
    senders: list[dict[str, Any]] | None = None
    """Staged: each stage leader's measurements (`SyncStats`: buckets, extra peak bytes, seconds)."""

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
        self._groups: list[dict[str, Any]] | None = None
        """Staged: the groups' settings the trainer holds, reused while `_members` stays the same."""
        self._members: Any = None
        self._generation = 0
        self._last: dict[str, Any] = {}
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
        self._last = {}
        weights, size = await self._payload(version)
        await self.engine.pause()
        try:
            await self.engine.update_weights(weights, version=version)
        except BaseException:
            self._groups = None  # whatever broke, the next sync forms new groups
            raise
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
        return SyncReport(version, self.mode, seconds, size, groups, versions, gap, _masters(weights), **self._last)

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

        self._last = {"bucket_bytes": self.engine.weight_bucket_bytes}
        # port 0: the engine's broadcaster binds a free one and holds it until the group forms
        return DistributedWeights(state, master_port=0, timeout_s=self.timeout_s), size

    def bucket_bytes(self) -> int:
        """The staged sync's bucket: the trainer's `sync_bucket_bytes` (its sender memory) and the
        engine's `weight_bucket_bytes` (what one engine call carries), the smaller where both are set."""
        sizes = [self.trainer.settings().get("sync_bucket_bytes"), getattr(self.engine, "weight_bucket_bytes", None)]
        sizes = [size for size in sizes if size]
        if not sizes:
            raise ConfigError("a staged weight sync needs the trainer's sync_bucket_bytes or the engine's")
        return min(sizes)

    async def _staged(self, version: int) -> tuple[Any, int]:
        """One group per trainer pipeline stage, hosted by that stage's sending rank (Megatron)."""
        from patchgym.backends.inference.sglang import StagedWeights, WeightGroup
        from patchgym.backends.inference.weight_group import split_buckets

        stages = await self.trainer.weight_stages()
        bucket_bytes = self.bucket_bytes()
        formed = await self._form_groups(len(stages))
        groups, buckets, size = [], [], 0
        for settings, tensors in zip(self._groups or [], stages, strict=True):
            sizes = {name: _numel(shape) * _itemsize(dtype) for name, dtype, shape in tensors}
            size += sum(sizes.values())
            cut = split_buckets(sizes, bucket_bytes)
            address, port, name = settings["master_address"], settings["master_port"], settings["group_name"]
            groups.append(WeightGroup(name, address, port, tensors, cut))
            buckets.append(cut)
        self._last = {"bucket_bytes": bucket_bytes, "groups_formed": formed}

        async def send() -> None:
            self._last["senders"] = await self.trainer.broadcast_weights(self._groups, buckets)

        return StagedWeights(groups, send, self._groups[0]["backend"]), size

    async def _form_groups(self, stages: int) -> bool:
        """Settings of each stage's group: those held while the membership is unchanged, else new ones
        (a new name) bound by the trainer where it can (`open_weight_groups`). Whether it formed them."""
        backend = group_backend(self.trainer.settings())
        world_size = sum(await self.engine.engine_ranks()) + 1
        members = (world_size, backend, stages, tuple(getattr(self.engine, "urls", ())))
        if self._groups is not None and members == self._members:
            return False
        self._generation += 1
        groups = []
        for stage in range(stages):
            address, port = await self._endpoint(stage)
            groups.append(
                {
                    "master_address": address,
                    "master_port": port,
                    "world_size": world_size,
                    "backend": backend,
                    "group_name": f"patchgym_weights_g{self._generation}_stage{stage}",
                    "timeout_s": self.timeout_s,
                }
            )
        opener = getattr(self.trainer, "open_weight_groups", None)
        if opener is not None:  # the stage leaders bind the ports and hold them: no pick-then-release
            groups = await opener([{**g, "master_port": 0} for g in groups])
        self._groups, self._members = groups, members
        return True

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
