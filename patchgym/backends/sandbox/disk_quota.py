"""A disk quota per sandbox where the file system gives none: a watch over each running command.

While a command runs, the sandbox's disk use is measured from the host every `interval_s`
(`measure`: the local backend sums the blocks of the sandbox's folder, Docker asks the engine
for the container's writable layer); when it is over `quota_bytes`, the command is cancelled
(which kills its process group, as a timeout does) and its result says why. Use is measured
once more when the command ends, so a command that filled the disk faster than the interval
still gets the note. What a command wrote stays until the agent deletes it; the grader's own
limits (`patchgym.core.tree_limits`) refuse an oversized tree before copying it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from patchgym.core.sandbox import ExecResult

QUOTA_NOTE = (
    "\npatchgym: the sandbox is over its disk quota ({used} bytes used, quota {quota} bytes): "
    "the command was killed; delete files to go on\n"
)


def disk_usage(root: Path) -> int:
    """Bytes of disk the files under `root` occupy (allocated blocks: a sparse file counts what it holds)."""
    total = 0
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(folder, name))
                total += info.st_blocks * 512 if not stat.S_ISLNK(info.st_mode) else 0
    return total


@dataclass(frozen=True)
class DiskQuota:
    """`quota_bytes` (None: no quota) checked every `interval_s` while a command runs."""

    quota_bytes: int | None
    interval_s: float = 1.0

    async def run(self, command: Awaitable[ExecResult], measure: Callable[[], Awaitable[int]]) -> ExecResult:
        """`command`'s result; cancelled with a note if the sandbox goes over the quota meanwhile."""
        if self.quota_bytes is None:
            return await command
        running = asyncio.ensure_future(command)
        used = 0
        try:
            while not running.done():
                await asyncio.wait([running], timeout=self.interval_s)
                if running.done():
                    break
                used = await measure()
                if used > self.quota_bytes:
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
                    note = QUOTA_NOTE.format(used=used, quota=self.quota_bytes)
                    return ExecResult(exit_code=137, stdout="", stderr=note.lstrip("\n"))
        except asyncio.CancelledError:
            running.cancel()
            raise
        result = running.result()
        used = await measure()
        if used > self.quota_bytes:
            result = replace(result, stderr=result.stderr + QUOTA_NOTE.format(used=used, quota=self.quota_bytes))
        return result
