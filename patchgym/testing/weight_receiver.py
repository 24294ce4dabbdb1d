"""An engine's end of a staged weight sync without an inference server, for tests and benchmarks.

`ReceiverEngine` takes `StagedWeights` as `SGLangEngine` does (joins each group it has not joined,
keeps them for the next sync, tells the receiver each bucket's names, dtypes and shapes in order,
leaves them on failure), but the receiving rank is a plain process (`python -m
patchgym.testing.weight_receiver`) that joins the groups as SGLang's engine ranks do (a TCP
rendezvous at the sender, keys prefixed by the group name) and receives each bucket into the
tensors it holds by name (as an engine loads into its weights; allocated at the first sync). It
reads one JSON command per line and answers one, in order: `join`, `receive`, `save` (a
safetensors file of what it holds), `destroy`.

    engine = ReceiverEngine(weight_bucket_bytes=64 << 20)
    await WeightSync(trainer, engine, mode="distributed", run_dir=run)(version)
    await engine.save(path)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any


class ReceiverEngine:
    """One receiving rank in a subprocess, driven like an out-of-process engine (`WeightSync`)."""

    out_of_process = True

    def __init__(
        self, *, weight_bucket_bytes: int = 512 << 20, timeout_s: float = 600.0, python: str = sys.executable
    ) -> None:
        self.weight_bucket_bytes = weight_bucket_bytes
        self.timeout_s = timeout_s
        self.python = python
        self._process: asyncio.subprocess.Process | None = None
        self._joined: list[str] = []
        self._version = 0
        self.joins = 0
        """Groups joined so far (a reused group is not joined again)."""

    async def _send(self, op: str, **fields: Any) -> None:
        """Write one command; its answer comes in order (`_answer`)."""
        if self._process is None:
            self._process = await asyncio.create_subprocess_exec(
                self.python, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        await self._process.stdin.drain()

    async def _answer(self, op: str) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        line = await self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the weight receiver exited (code {await self._process.wait()}) during {op}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"the weight receiver failed {op}: {answer.get('error')}")
        return answer

    async def _command(self, op: str, **fields: Any) -> dict[str, Any]:
        await self._send(op, **fields)
        return await self._answer(op)

    async def engine_ranks(self) -> list[int]:
        return [1]

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def weight_versions(self) -> list[int]:
        return [self._version]

    async def update_weights(self, weights: Any, *, version: int) -> None:
        """Receive `StagedWeights` (see the module docstring)."""
        names = [group.name for group in weights.groups]
        if any(name not in names for name in self._joined):
            await self._leave()
        sending = asyncio.ensure_future(weights.send())
        sending.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            for group in weights.groups:
                if group.name not in self._joined:
                    self._joined.append(group.name)
                    await self._command(
                        "join",
                        master_address=group.master_address,
                        master_port=group.master_port,
                        world_size=2,
                        rank=1,
                        backend=weights.backend,
                        group_name=group.name,
                        timeout_s=self.timeout_s,
                    )
                    self.joins += 1
            sent = 0  # every bucket's command at once: the receiver takes them in order, without a round trip each
            for group in weights.groups:
                meta = {name: (dtype, shape) for name, dtype, shape in group.tensors}
                for bucket in group.buckets:
                    dtypes, shapes = [meta[n][0] for n in bucket], [list(meta[n][1]) for n in bucket]
                    await self._send("receive", group_name=group.name, names=list(bucket), dtypes=dtypes, shapes=shapes)
                    sent += 1
            for _ in range(sent):
                await self._answer("receive")
            await sending
        except BaseException:
            sending.cancel()
            with contextlib.suppress(RuntimeError):
                await self._leave()
            raise
        self._version = version

    async def _leave(self) -> None:
        names, self._joined = self._joined, []
        for name in names:
            await self._command("destroy", group_name=name)

    async def save(self, path: Path) -> None:
        """Write what the receiver holds (the last tensor of each name) as safetensors."""
        await self._command("save", path=str(path))

    async def aclose(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()


def _serve() -> None:
    """The receiving rank: one JSON command per stdin line, one JSON answer per stdout line."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed import distributed_c10d as c10d

    groups: dict[str, Any] = {}
    held: dict[str, torch.Tensor] = {}
    for line in sys.stdin:
        command = json.loads(line)
        op, answer = command.pop("op"), {"ok": True}
        try:
            if op == "join":
                started = time.monotonic()
                timeout = timedelta(seconds=command.get("timeout_s", 600))
                world, rank, name = command["world_size"], command["rank"], command["group_name"]
                where = f"tcp://{command['master_address']}:{command['master_port']}"
                store, _, _ = next(dist.rendezvous(where, rank, world, timeout=timeout))
                group, _ = c10d._new_process_group_helper(
                    world, rank, [], c10d.Backend(command["backend"]), c10d.PrefixStore(name, store),
                    group_name=name, timeout=timeout,
                )  # fmt: skip
                c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
                groups[name] = group
                answer["join_s"] = time.monotonic() - started
            elif op == "receive":
                group = groups[command["group_name"]]
                for name, dtype, shape in zip(command["names"], command["dtypes"], command["shapes"], strict=True):
                    tensor = held.get(name)
                    if tensor is None or list(tensor.shape) != shape or tensor.dtype != getattr(torch, dtype):
                        tensor = held[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(tensor, src=0, group=group)  # into the buffer of the last sync, as weights
            elif op == "save":
                save_file(held, command["path"])
            elif op == "destroy":
                group = groups.pop(command["group_name"], None)
                if group is not None:
                    dist.destroy_process_group(group)
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as exc:  # answered, not raised: the driver reports it
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _serve()
