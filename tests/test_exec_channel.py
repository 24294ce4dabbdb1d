"""The Docker exec channel: which path a sandbox takes, and what happens when the server dies.

The shared contract runs on both paths in test_sandbox_conformance.py (variants `docker` and
`docker-exec`); these tests cover what only the channel has.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from patchgym.core.errors import TransportError
from patchgym.core.sandbox import SandboxSpec
from tests.conftest import require_docker

pytestmark = pytest.mark.usefixtures("docker_ready")
LABELS = {"suite": "exec-channel"}
PROCESSES = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"
"""Every process's command line (the base image has no `ps`)."""


@pytest.fixture
def docker_ready() -> None:
    require_docker()


@pytest.fixture(params=[True, False], ids=["channel", "exec"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator:
    from patchgym.backends.sandbox.docker import DockerSandboxBackend

    backend = DockerSandboxBackend(concurrency=4, exec_channel=request.param, kill_grace_s=0.5)
    yield backend
    await backend.reap(LABELS)
    await backend.aclose()


@pytest.fixture
async def channel_backend() -> AsyncIterator:
    from patchgym.backends.sandbox.docker import DockerSandboxBackend

    backend = DockerSandboxBackend(concurrency=4, kill_grace_s=0.5)
    yield backend
    await backend.reap(LABELS)
    await backend.aclose()


def _dockerfile(tmp_path: Path, *lines: str) -> Path:
    dockerfile = tmp_path / "image" / "Dockerfile"
    dockerfile.parent.mkdir()
    dockerfile.write_text("\n".join(["FROM patchgym/base:latest", *lines]) + "\n")
    return dockerfile


async def test_image_env_path_holds_on_both_paths(backend, tmp_path: Path) -> None:
    """Commands run in the image's environment: a login shell would reset PATH from /etc/profile."""
    dockerfile = _dockerfile(
        tmp_path,
        "RUN mkdir -p /opt/x/bin && printf '#!/bin/sh\\necho x-tool here\\n' > /opt/x/bin/xtool",
        "RUN chmod +x /opt/x/bin/xtool",
        "ENV PATH=/opt/x/bin:$PATH",
    )
    async with await backend.create(SandboxSpec(dockerfile=dockerfile, workdir="/tmp", labels=LABELS)) as box:
        result = await box.exec('xtool; echo "$PATH"', timeout_s=60)
        assert result.exit_code == 0, result
        assert result.stdout.splitlines() == ["x-tool here", result.stdout.splitlines()[1]]
        assert result.stdout.splitlines()[1].startswith("/opt/x/bin:")
    path = "channel" if backend.exec_channel else "exec"
    assert backend.settings()["exec_paths"][path] == 1


async def test_image_without_python_falls_back_to_plain_exec(channel_backend, tmp_path: Path) -> None:
    dockerfile = _dockerfile(tmp_path, "RUN rm -f /usr/bin/python3* /usr/bin/python /usr/local/bin/python*")
    async with await channel_backend.create(SandboxSpec(dockerfile=dockerfile, workdir="/tmp", labels=LABELS)) as box:
        result = await box.exec("echo hi; exit 4", timeout_s=60)
        assert (result.stdout, result.exit_code) == ("hi\n", 4)
        assert box.channel.path == "exec" and "did not start" in box.channel.fallback_reason
    assert channel_backend.settings()["exec_paths"] == {"channel": 0, "exec": 1}


async def test_base_image_runs_on_the_channel(channel_backend, workspace: Path) -> None:
    async with await channel_backend.create(SandboxSpec(workspace=workspace, labels=LABELS)) as box:
        results = await asyncio.gather(*(box.exec(f"echo {i}", timeout_s=60) for i in range(5)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
        assert box.channel.path == "channel"
    assert channel_backend.settings()["exec_paths"] == {"channel": 1, "exec": 0}


async def test_a_command_that_kills_the_server_fails_as_its_own_and_the_channel_restarts(
    channel_backend, workspace: Path
) -> None:
    async with await channel_backend.create(SandboxSpec(workspace=workspace, labels=LABELS)) as box:
        first = await box.exec("echo $PPID", timeout_s=60)
        server_pid = int(first.stdout)
        # a second command is running when the server dies: its process group is killed by the next server
        running = asyncio.create_task(box.exec("sleep 300; echo never", timeout_s=600))
        while "sleep 300" not in (await box.exec(PROCESSES, timeout_s=60)).stdout:
            await asyncio.sleep(0.05)
        killer = await box.exec("kill -9 $PPID; sleep 5", timeout_s=60)
        assert killer.exit_code == 137 and "exec server was killed" in killer.stderr
        orphan = await running
        assert orphan.exit_code == 137 and "never" not in orphan.stdout
        after = await box.exec("echo $PPID; " + PROCESSES, timeout_s=60)
        assert after.exit_code == 0
        assert int(after.stdout.splitlines()[0]) != server_pid
        assert "sleep 300" not in after.stdout, "the dead server's command outlived it"
        assert box.channel.restarts == 1 and box.channel.path == "channel"


async def test_a_broken_stream_is_an_infrastructure_fault(channel_backend, workspace: Path) -> None:
    async with await channel_backend.create(SandboxSpec(workspace=workspace, labels=LABELS)) as box:
        await box.exec("true", timeout_s=60)
        running = asyncio.create_task(box.exec("sleep 300", timeout_s=600))
        while "sleep 300" not in (await box.exec(PROCESSES, timeout_s=60)).stdout:
            await asyncio.sleep(0.05)
        box.channel._server.writer.transport.abort()  # the engine connection drops under a live server
        with pytest.raises(TransportError, match="exec channel"):
            await running
        after = await box.exec(PROCESSES, timeout_s=60)  # a new stream, a new server
        assert after.exit_code == 0 and "sleep 300" not in after.stdout
        assert box.channel.restarts == 0


async def test_each_sandbox_has_its_own_server(channel_backend, workspace: Path) -> None:
    spec = SandboxSpec(workspace=workspace, labels=LABELS)
    async with await channel_backend.create(spec) as one, await channel_backend.create(spec) as two:
        assert one.channel is not two.channel
        await one.exec("kill -9 $PPID", timeout_s=60)
        assert (await two.exec("echo ok", timeout_s=60)).stdout == "ok\n"
        assert (one.channel.restarts, two.channel.restarts) == (1, 0)
