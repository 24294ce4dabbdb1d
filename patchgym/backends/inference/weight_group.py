"""The trainer's end of SGLang's weight-update process group.

SGLang's `/init_weights_update_group` has each engine rank join a named torch.distributed
group through a TCP rendezvous at the trainer (rank 0), with the keys prefixed by the group
name, outside the default process group. This joins the same group from the trainer, so the
trainer's own distributed setup (if any) is untouched. Blocking calls: run them in a thread.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from patchgym.core.errors import ConfigError, TransportError


def split_buckets(sizes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """The names in order, cut into consecutive buckets of at most `bucket_bytes` each.

    `sizes` maps each tensor's name to its size in bytes; a tensor larger than `bucket_bytes`
    travels alone in its own bucket.
    """
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, not {bucket_bytes}")
    buckets: list[list[str]] = []
    filled = bucket_bytes  # the first tensor opens a bucket
    for name, size in sizes.items():
        if filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += size
    return buckets


class WeightBroadcaster:
    """Rank 0 of a `world_size` group named `group_name` (gloo on CPU, NCCL on GPU)."""

    def __init__(
        self, master_address: str, master_port: int, world_size: int, backend: str, group_name: str, timeout_s: float
    ) -> None:
        self.master_address, self.master_port = master_address, master_port
        self.world_size = world_size
        self.backend = backend
        self.group_name = group_name
        self.timeout = timedelta(seconds=timeout_s)
        self._group: Any = None

    def join(self) -> None:
        """Rendezvous with every engine rank; returns once the group exists.

        Raises `TransportError` once the timeout has passed without it, whichever member is
        missing. The group forms in two waits, each given a timeout: every member connects to
        the store this rank hosts, then the backend's own rendezvous (gloo exchanges addresses
        through the store). Given the whole timeout each, a member that reached the store but
        never its backend (an engine that died in between) held the join for twice the timeout;
        the second wait gets what the first one left, and broadcasts the whole timeout again.
        """
        from torch.distributed import TCPStore
        from torch.distributed import distributed_c10d as c10d

        seconds = self.timeout.total_seconds()
        deadline = time.monotonic() + seconds
        # The store's wait for its clients counts whole seconds and gives up only past the next
        # one: asked for a second less, it ends within the timeout.
        store_timeout = timedelta(seconds=max(seconds - 1, seconds / 2))
        where = f"{self.master_address}:{self.master_port}"
        try:
            # This rank hosts the store itself: under torchrun, `c10d.rendezvous` would only connect
            # to the launcher's agent store (TORCHELASTIC_USE_AGENT_STORE) and never meet the engines.
            store = TCPStore(
                self.master_address, self.master_port, self.world_size, True, store_timeout, multi_tenant=True
            )
        except (RuntimeError, TimeoutError, ValueError) as exc:
            raise self._failed(f"not all {self.world_size} members reached its store at {where}", exc) from exc
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the store's own wait used all of it")
            group, _ = c10d._new_process_group_helper(
                self.world_size,
                0,
                [],
                c10d.Backend(self.backend),
                c10d.PrefixStore(self.group_name, store),
                group_name=self.group_name,
                timeout=timedelta(seconds=left),
            )
            c10d._set_pg_timeout(self.timeout, group)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            raise self._failed(f"every member reached its store at {where}, but not all joined the group", exc) from exc
        c10d._world.pg_group_ranks[group] = {i: i for i in range(self.world_size)}
        self._group = group

    def _failed(self, what: str, cause: Exception) -> TransportError:
        seconds = self.timeout.total_seconds()
        return TransportError(
            f"the weight-update group {self.group_name!r} did not form within {seconds:g} s: {what} "
            f"(an engine that died or was not asked to join?): {cause}"
        )

    def broadcast(self, tensors: list[Any]) -> None:
        """Send each tensor from rank 0, in the order the engines were told."""
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError("join() the weight-update group before broadcasting")
        try:
            for tensor in tensors:
                dist.broadcast(tensor, src=0, group=self._group)
        except RuntimeError as exc:
            raise TransportError(f"broadcasting weights over {self.group_name!r} failed: {exc}") from exc

    def close(self) -> None:
        import torch.distributed as dist

        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
