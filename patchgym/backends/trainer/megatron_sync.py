"""The Megatron trainer's streamed weight sync: per bucket, gather → convert → broadcast (async) → free.

A stage's weights reach the engines as HF tensors in the buckets the sync cut (lists of HF names,
in the order `plan` gives them). Each megatron parameter is a *unit*: gathered whole over tensor
parallelism (experts: over expert-TP, then from every expert-parallel rank) and converted to the
HF tensors it holds. For every bucket, every rank of the stage gathers the units that bucket still
needs, in the same order, because the gathers are collectives: the expert-parallel group may span
data-parallel replicas (TP4/EP8/DP2 does), so a rank that skipped them would leave the others
waiting. Only the stage leader (data-parallel rank 0, tensor rank 0) keeps the converted tensors
and broadcasts them; it enqueues a bucket's broadcast and gathers the next while it travels,
waiting for the previous bucket before it sends the next. So it holds at most the bucket in
flight, the bucket being prepared and the rest of a unit cut across two buckets: its extra memory
is bounded by about three buckets (or three times the largest unit), whatever the model's size.

The leader's `WeightBroadcaster` is kept between syncs (`SyncGroup`): the group forms at the first
sync and every later one reuses it; a sync that names another group (the sync re-formed it:
engines restarted or changed) closes the old one first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from patchgym.backends.trainer import megatron_moe
from patchgym.backends.trainer.megatron_convert import unshard
from patchgym.core.errors import TransportError

Gather = Callable[[torch.Tensor, Any], list[torch.Tensor]]
"""`gather(local, group)`: every group member's `local`, in rank order."""


def all_gather(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every member's `local` (a group of one: `local` itself, not a copy)."""
    size = dist.get_world_size(group)
    if size == 1:
        return [local]
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return parts


def gather_unit(trainer: Any, name: str, local: torch.Tensor, gather: Gather = all_gather) -> dict[str, torch.Tensor]:
    """One stage parameter (`name`, this rank's `local` part) whole, under its whole-model megatron
    names: one tensor, or for an expert that expert on every expert-parallel rank."""
    ps = trainer.ps
    full_name = trainer.names[name]
    if not megatron_moe.is_expert(name):
        return {full_name: unshard(name, gather(local, ps.get_tensor_model_parallel_group()))}
    whole = unshard(name, gather(local, ps.get_expert_tensor_parallel_group()))
    blocks = gather(whole, ps.get_expert_model_parallel_group())
    count = trainer.local_experts
    return {megatron_moe.renumber_expert(full_name, name, rank, count): block for rank, block in enumerate(blocks)}


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Unit:
    """One stage parameter and the HF tensors it yields: (name, dtype, shape) each, in order."""

    param: str
    hf: tuple[tuple[str, str, tuple[int, ...]], ...]


def plan(trainer: Any) -> list[Unit]:
    """This stage's units in parameter order, computed on meta tensors (no communication; the same
    HF names on every rank of the stage). The last stage's copy of a tied embedding is left out."""
    dtype = str(trainer.dtype).removeprefix("torch.")
    units = []
    for name, param in trainer.gpt.named_parameters():
        if getattr(param, "shared", False):
            continue
        meta = torch.empty(param.shape, dtype=trainer.dtype, device="meta")
        full = gather_unit(trainer, name, meta, lambda local, group: [local] * dist.get_world_size(group))
        hf = [(k, dtype, tuple(v.shape)) for n, t in full.items() for k, v in trainer.layout.tensor_to_hf(n, t).items()]
        units.append(Unit(name, tuple(hf)))
    return units


@dataclass
class SyncStats:
    """What one stage's sender measured: bytes sent, buckets, its extra memory and where time went."""

    bucket_bytes: int = 0
    """The largest bucket it sent."""
    buckets: int = 0
    bytes: int = 0
    sender_extra_peak_bytes: int = 0
    """The most bytes of sync tensors the leader held at once, counted by the streamer: buckets in
    flight, converted tensors waiting for their bucket (by storage), and while a unit converts, what
    its gathers allocated (their intermediate parts too) and its conversion's copies."""
    device_peak_bytes: int | None = None
    """On a GPU: the allocator's peak during the sync above what was allocated before it."""
    gather_s: float = 0.0
    wait_s: float = 0.0
    seconds: float = 0.0
    _held: int = field(default=0, repr=False)

    def hold(self, delta: int) -> None:
        self._held += delta
        self.sender_extra_peak_bytes = max(self.sender_extra_peak_bytes, self._held)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class Streamer:
    """One sync of one stage, run by every rank of it; `broadcaster` only on the leader."""

    def __init__(self, trainer: Any, units: list[Unit], broadcaster: Any | None) -> None:
        self.trainer, self.units, self.broadcaster = trainer, units, broadcaster
        self.owner = {hf[0]: index for index, unit in enumerate(units) for hf in unit.hf}
        self.params = dict(trainer.gpt.named_parameters())
        self.ready: dict[str, torch.Tensor] = {}  # converted, not yet sent (a unit cut across buckets)
        self.done: set[int] = set()
        self.storages: dict[int, list[int]] = {}  # storage -> [bytes, tensors held that view it]
        self.own = {_storage(p) for p in self.params.values()}  # views of parameters are not extra memory
        self.stats = SyncStats()

    def _convert(self, index: int) -> None:
        """Gather unit `index` (a collective on every rank) and keep its HF tensors on the leader."""
        trainer, unit = self.trainer, self.units[index]
        started = time.perf_counter()
        param = self.params[unit.param].detach().contiguous()
        owned = set(self.own)  # storages already counted (parameters are not extra)
        gathered = 0  # bytes the gathers allocate, and the tensors they join

        def gather(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
            nonlocal gathered
            parts = all_gather(local, group)
            for tensor in (local, *parts):
                if _storage(tensor) not in owned:
                    owned.add(_storage(tensor))
                    gathered += tensor.untyped_storage().nbytes()
            return parts

        full = gather_unit(trainer, unit.param, param, gather)
        gathered += sum(t.untyped_storage().nbytes() for t in full.values() if _storage(t) not in owned)
        owned.update(_storage(t) for t in full.values())
        converted: list[tuple[str, torch.Tensor]] = []
        if self.broadcaster is not None:
            for n, t in full.items():
                converted += [(k, v.to(trainer.dtype)) for k, v in trainer.layout.tensor_to_hf(n, t).items()]
        new = {_storage(v): v.untyped_storage().nbytes() for _, v in converted if _storage(v) not in owned}
        self.stats.hold(gathered + sum(new.values()))  # the gathered unit and its conversion, at once
        self.stats.hold(-gathered - sum(new.values()))
        del full
        for k, v in converted:
            self._keep(v)
            self.ready[k] = v
        self.done.add(index)
        self.stats.gather_s += time.perf_counter() - started

    def _keep(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage as held (once, however many tensors view it)."""
        key = _storage(tensor)
        if key in self.own:
            return
        if key not in self.storages:
            self.storages[key] = [tensor.untyped_storage().nbytes(), 0]
            self.stats.hold(self.storages[key][0])
        self.storages[key][1] += 1

    def _drop(self, tensor: torch.Tensor) -> None:
        key = _storage(tensor)
        if key in self.own:
            return
        self.storages[key][1] -= 1
        if not self.storages[key][1]:
            self.stats.hold(-self.storages.pop(key)[0])

    def _prepare(self, bucket: list[str]) -> list[torch.Tensor]:
        for name in bucket:
            index = self.owner.get(name)
            if index is None:
                raise KeyError(f"the sync asked for {name!r}, which this pipeline stage does not hold")
            if index not in self.done:
                self._convert(index)
        return [self.ready.pop(name) for name in bucket] if self.broadcaster is not None else []

    def _release(self, sent: list[torch.Tensor]) -> None:
        started = time.perf_counter()
        self.broadcaster.wait()
        self.stats.wait_s += time.perf_counter() - started
        for tensor in sent:
            self._drop(tensor)

    def run(self, buckets: list[list[str]]) -> SyncStats:
        started = time.perf_counter()
        device = next(iter(self.params.values())).device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        in_flight: list[torch.Tensor] | None = None
        try:
            for bucket in buckets:
                tensors = self._prepare(bucket)  # overlaps the previous bucket's broadcast
                if self.broadcaster is None:
                    continue
                if in_flight is not None:
                    self._release(in_flight)
                self.broadcaster.broadcast(tensors)
                in_flight = tensors
                size = nbytes(tensors)
                self.stats.bucket_bytes = max(self.stats.bucket_bytes, size)
                self.stats.buckets += 1
                self.stats.bytes += size
            if in_flight is not None:
                self._release(in_flight)
        finally:
            self.ready.clear()
        if device.type == "cuda":
            self.stats.device_peak_bytes = torch.cuda.max_memory_allocated(device) - before
        self.stats.seconds = time.perf_counter() - started
        return self.stats


class SyncGroup:
    """The weight group a stage leader keeps between syncs (see the module docstring)."""

    def __init__(self) -> None:
        self.broadcaster: Any = None

    def open(self, settings: dict[str, Any]) -> Any:
        """The broadcaster for `settings`: the one held when it is the same group, else a new one
        (bound: its port is held from now on) after the old one is closed."""
        from patchgym.backends.inference.weight_group import WeightBroadcaster

        held = self.broadcaster
        if held is not None and _same(held, settings):
            return held
        self.close()
        self.broadcaster = WeightBroadcaster(**settings)
        self.broadcaster.bind()
        return self.broadcaster

    def close(self) -> None:
        """Wait for what the held group has enqueued, then destroy it; a broken group is dropped."""
        held, self.broadcaster = self.broadcaster, None
        if held is not None:
            with contextlib.suppress(TransportError, RuntimeError):
                held.close()


def _same(broadcaster: Any, settings: dict[str, Any]) -> bool:
    keys = ("master_address", "world_size", "backend", "group_name")
    port = settings.get("master_port") or broadcaster.master_port  # 0: wherever it was bound
    return port == broadcaster.master_port and all(getattr(broadcaster, k) == settings[k] for k in keys)
