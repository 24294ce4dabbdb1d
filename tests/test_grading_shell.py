"""Reading a report back from the grading shell: the output cap leaves room for base64 and the shell's
own words, so a report of any size up to `max_bytes` comes back whole, and one byte more is refused."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.grading_shell import GradingRoom
from patchgym.core.sandbox import Sandbox, SandboxSpec
from patchgym.core.test_reports import ReportError


@pytest.fixture
async def sandbox(tmp_path: Path, workspace: Path) -> AsyncIterator[Sandbox]:
    backend = LocalSandboxBackend(isolation="none", root_dir=tmp_path)
    try:
        async with await backend.create(SandboxSpec(workspace=workspace)) as box:
            yield box
    finally:
        await backend.aclose()


@pytest.mark.parametrize("size", [0, 1, 2, 3, 1000, 4097, 65_536, 65_537])
async def test_a_report_up_to_the_limit_comes_back_whole(sandbox: Sandbox, size: int) -> None:
    room = await GradingRoom.open(sandbox)
    data = os.urandom(size)
    path = await room.write("report.xml", data)
    assert await room.read_report(path, max_bytes=size) == data  # exactly at the limit
    assert await room.read_report(path, max_bytes=size + 2) == data


@pytest.mark.parametrize("size", [1, 4097, 65_537])
async def test_one_byte_over_the_limit_is_a_report_error_naming_the_size(sandbox: Sandbox, size: int) -> None:
    room = await GradingRoom.open(sandbox)
    path = await room.write("report.xml", os.urandom(size))
    with pytest.raises(ReportError, match=f"holds {size} bytes .limit {size - 1} bytes"):
        await room.read_report(path, max_bytes=size - 1)


async def test_what_is_not_a_regular_file_is_refused(sandbox: Sandbox) -> None:
    room = await GradingRoom.open(sandbox)
    target = await room.write("real.xml", b"<testsuites/>")
    await room.run(
        f"ln -s {target} {room.root}/link.xml; mkdir {room.root}/dir.xml; mkfifo {room.root}/fifo.xml", timeout_s=60
    )
    for name, why in [
        ("link.xml", "is a symbolic link"),
        ("dir.xml", "is not a regular file"),
        ("fifo.xml", "is not a regular file"),
    ]:
        with pytest.raises(ReportError, match=why):
            await room.read_report(f"{room.root}/{name}", max_bytes=1000)
    with pytest.raises(FileNotFoundError):
        await room.read_report(f"{room.root}/absent.xml", max_bytes=1000)
