"""The trainer's end of SGLang's weight-update process group.

SGLang's `/init_weights_update_group` has each engine rank join a named torch.distributed
group through a TCP rendezvous at the trainer (rank 0), with the keys prefixed by the group
name, outside the default process group. This joins the same group from the trainer, so the
trainer's own distributed setup (if any) is untouched. Blocking calls: run them in a thread.
"""

from __future__ import annotations

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
    """Rank 0 of a `world_size` group named `group_name` (gloo on CPU, NCCL on GPU).

    `bind()` opens the group's store on its port and holds it from then on (port 0: one the OS
    picks, read back from `master_port`), so no other process can take a port between its choice
    and the rendezvous; `join()` forms the group; `broadcast()` enqueues each tensor (async) and
    `wait()` waits for what is enqueued; `close()` waits too before it destroys the group. A
    broadcaster is kept across syncs: the group forms once and carries every later sync.
    """

    def __init__(
        self, master_address: str, master_port: int, world_size: int, backend: str, group_name: str, timeout_s: float
    ) -> None:
        self.master_address, self.master_port = master_address, master_port
        self.world_size = world_size
        self.backend = backend
        self.group_name = group_name
        self.timeout = timedelta(seconds=timeout_s)
        self._store: Any = None
        self._group: Any = None
        self._pending: list[Any] = []

    @property
    def joined(self) -> bool:
        return self._group is not None

    def bind(self) -> int:
        """Open the store this rank hosts, on `master_port` (0: a free one); the port, now held."""
        from torch.distributed import TCPStore

        if self._store is None:
            where = f"{self.master_address}:{self.master_port}"
            try:
                # This rank hosts the store itself: under torchrun, `c10d.rendezvous` would only connect
                # to the launcher's agent store (TORCHELASTIC_USE_AGENT_STORE) and never meet the engines.
                self._store = TCPStore(
                    self.master_address,
                    self.master_port,
                    self.world_size,
                    True,
                    self.timeout,
                    wait_for_workers=False,
                    multi_tenant=True,
                )
            except (RuntimeError, ValueError) as exc:
                raise TransportError(f"cannot open the weight-update group's store at {where}: {exc}") from exc
            self.master_port = self._store.port
        return self.master_port

    def join(self) -> None:
        """Rendezvous with every engine rank; returns once the group exists (binds first if needed).

        Raises `TransportError` once the timeout has passed without it, whichever member is
        missing: one wait, through the store this rank holds, bounded by the timeout; the group
        then gets the whole timeout again for each broadcast.
        """
        from torch.distributed import distributed_c10d as c10d

        if self._group is not None:
            return
        self.bind()
        try:
            group, _ = c10d._new_process_group_helper(
                self.world_size,
                0,
                [],
                c10d.Backend(self.backend),
                c10d.PrefixStore(self.group_name, self._store),
                group_name=self.group_name,
                timeout=self.timeout,
            )
            c10d._set_pg_timeout(self.timeout, group)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            seconds = self.timeout.total_seconds()
            raise TransportError(
                f"the weight-update group {self.group_name!r} did not form within {seconds:g} s: not all "
                f"{self.world_size} members joined at {self.master_address}:{self.master_port} "
                f"(an engine that died or was not asked to join?): {exc}"
            ) from exc
        c10d._world.pg_group_ranks[group] = {i: i for i in range(self.world_size)}
        self._group = group

    def broadcast(self, tensors: list[Any]) -> None:
        """Enqueue each tensor's broadcast from rank 0, in the order the engines were told; `wait()`
        (or `close()`) before changing or freeing them."""
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError("join() the weight-update group before broadcasting")
        try:
            for tensor in tensors:
                self._pending.append(dist.broadcast(tensor, src=0, group=self._group, async_op=True))
        except RuntimeError as exc:
            raise TransportError(f"broadcasting weights over {self.group_name!r} failed: {exc}") from exc

    def wait(self) -> None:
        """Wait until every enqueued broadcast has completed."""
        pending, self._pending = self._pending, []
        try:
            for work in pending:
                work.wait()
        except RuntimeError as exc:
            raise TransportError(f"broadcasting weights over {self.group_name!r} failed: {exc}") from exc

    def close(self) -> None:
        """Wait for the enqueued broadcasts, then destroy the group and release the port."""
        import torch.distributed as dist

        try:
            self.wait()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
            self._store = None
