"""Docker-specific behaviour: limits, images, the warm pool, leaks, and tasks end to end.

The shared sandbox contract runs on Docker in test_sandbox_conformance.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from patchgym.core.errors import BuildError, SandboxStartError
from patchgym.core.sandbox import SandboxSpec
from tests.conftest import require_docker

pytestmark = pytest.mark.usefixtures("docker_ready")


@pytest.fixture
def docker_ready() -> None:
    require_docker()


@pytest.fixture
async def backend() -> AsyncIterator:
    from patchgym.backends.sandbox.docker import DockerSandboxBackend

    backend = DockerSandboxBackend(concurrency=8, owner="patchgym-test-docker")
    yield backend
    await backend.reap({"patchgym.owner": "patchgym-test-docker"})
    await backend.aclose()


async def test_containers_carry_limits_labels_and_no_network(backend, workspace: Path) -> None:
    spec = SandboxSpec(workspace=workspace, cpus=1.5, memory_mb=512, pids=256, env={"A": "1"}, labels={"task_id": "t"})
    async with await backend.create(spec) as sandbox:
        attrs = sandbox.container.attrs
        host = attrs["HostConfig"]
        assert (host["NanoCpus"], host["Memory"], host["PidsLimit"]) == (1_500_000_000, 512 << 20, 256)
        assert host["NetworkMode"] == "none" and host["Init"] is True
        labels = attrs["Config"]["Labels"]
        assert labels["task_id"] == "t" and labels["patchgym.owner"] == "patchgym-test-docker"
        assert labels["patchgym.owner_pid"] == str(os.getpid())
        assert (await sandbox.exec("echo $A; cat pkg/hello.txt", timeout_s=30)).stdout == "1\nhello\n"
        links = await sandbox.exec("ls /sys/class/net", timeout_s=30)
        assert links.stdout.split() == ["lo"]


async def test_missing_image_says_how_to_build_it(backend, workspace: Path) -> None:
    with pytest.raises(BuildError, match="patchgym sandbox build-base"):
        await backend.create(SandboxSpec(workspace=workspace, image="patchgym/no-such-image:1"))


async def test_network_without_a_shared_network_is_a_clear_error(backend, workspace: Path) -> None:
    with pytest.raises(SandboxStartError, match="network") as caught:
        await backend.create(SandboxSpec(workspace=workspace, network=True))
    assert not caught.value.retryable


async def test_dockerfile_images_are_built_once_and_cached_by_content(backend, tmp_path: Path) -> None:
    context = tmp_path / "ctx"
    context.mkdir()
    dockerfile = context / "Dockerfile"
    dockerfile.write_text("FROM patchgym/base:latest\nCOPY marker.txt /marker.txt\n")
    (context / "marker.txt").write_text("one\n")
    spec = SandboxSpec(dockerfile=dockerfile)
    first = await backend.image_for(spec)
    again = await asyncio.gather(*(backend.image_for(spec) for _ in range(4)))
    assert set(again) == {first} and first.startswith("patchgym/build:")
    async with await backend.create(spec) as sandbox:
        assert (await sandbox.exec("cat /marker.txt", timeout_s=30)).stdout == "one\n"
    (context / "marker.txt").write_text("two\n")
    assert await backend.image_for(spec) != first
    dockerfile.write_text("FROM patchgym/base:latest\nRUN exit 3\n")
    with pytest.raises(BuildError, match="exit 3|returned a non-zero code: 3"):
        await backend.image_for(spec)


async def test_warm_pool_serves_fresh_containers(workspace: Path) -> None:
    from patchgym.backends.sandbox.docker import DockerSandboxBackend

    backend = DockerSandboxBackend(pool_size=2, pool_refill_concurrency=2, owner="patchgym-test-pool")
    try:
        spec = SandboxSpec(workspace=workspace)
        assert await backend.prewarm(spec) == 2
        warm_ids = {c.id for pool in backend._pools.values() for c in pool.ready}
        first = await backend.create(spec)
        assert first.container.id in warm_ids
        await first.exec("echo dirty > pkg/hello.txt", timeout_s=30)
        await first.close()
        await asyncio.gather(*list(backend._refills))
        second = await backend.create(spec)
        assert second.container.id != first.container.id
        assert await second.read_file("pkg/hello.txt") == b"hello\n"
        await second.close()
        assert backend.settings()["pool_size"] == 2
    finally:
        await backend.aclose()
        assert (
            await DockerSandboxBackend(owner="patchgym-test-pool").reap({"patchgym.owner": "patchgym-test-pool"}) == 0
        )


DRIVER = textwrap.dedent(
    """
    import asyncio, sys
    from patchgym.backends.sandbox.docker import DockerSandboxBackend
    from patchgym.core.sandbox import SandboxSpec

    async def main():
        backend = DockerSandboxBackend(owner=sys.argv[1], pool_size=1)
        boxes = [await backend.create(SandboxSpec(workspace=sys.argv[2])) for _ in range(3)]
        print("ready", flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


async def test_killed_run_leaves_no_containers_after_restart(workspace: Path) -> None:
    from patchgym.backends.sandbox.docker import DockerSandboxBackend

    owner = "patchgym-test-kill9"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, owner, str(workspace)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    backend = DockerSandboxBackend(owner=owner)
    try:
        leaked = await backend.run_sync(backend._list, {"patchgym.owner": owner})
        assert len(leaked) >= 3  # three sandboxes (+ pooled spares) survived the kill
        async with await backend.create(SandboxSpec(workspace=workspace)):
            assert backend.reaped_at_start == len(leaked)
        assert await backend.run_sync(backend._list, {"patchgym.owner": owner}) == []
    finally:
        await backend.aclose()


def test_tiny_task_set_validates_on_docker_and_leaves_nothing() -> None:
    from patchgym.cli import app

    owner = f"patchgym-test-cli-{os.getpid()}"
    command = ["tasks", "validate", "tiny", "--sandbox", "docker", "--sandbox-option", f"owner={owner}", "--json"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["valid"] and len(report["tasks"]) == 6
    leftovers = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=patchgym.owner={owner}"], capture_output=True, text=True
    )
    assert leftovers.stdout.strip() == ""


async def test_oracle_episode_on_docker() -> None:
    from patchgym.core.validation import apply_patch_command
    from patchgym.envs.swe import AsyncSWEEnv

    env = AsyncSWEEnv("tiny", "docker", sandbox_options={"owner": "patchgym-test-docker"})
    try:
        _, info = await env.reset(options={"task": "semver-prerelease"})
        assert env.sandbox is not None and env.sandbox.workdir == "/workspace"
        patch = env.task.gold_patch if env.task else None
        assert patch
        await env.step(f"```bash\n{apply_patch_command(patch)}\n```")
        _, reward, terminated, _, info = await env.step("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
        assert (reward, terminated) == (1.0, True) and info["grade"]["resolved"]
    finally:
        await env.close()


async def test_container_removed_underneath_is_sandbox_lost(backend, workspace: Path) -> None:
    from patchgym.core.errors import SandboxLostError

    sandbox = await backend.create(SandboxSpec(workspace=workspace))
    await backend.run_sync(lambda: sandbox.container.remove(force=True))
    with pytest.raises(SandboxLostError, match="gone"):
        await sandbox.exec("true", timeout_s=30)
    with pytest.raises(SandboxLostError):
        await sandbox.read_file("pkg/hello.txt")
    await sandbox.close()  # still idempotent and quiet


async def test_settings_report_every_limit(backend) -> None:
    settings = backend.settings()
    assert settings["threads"] == settings["http_pool_size"] == 8 + settings["pool_refill_concurrency"]
    assert {"pool_size", "kill_grace_s", "default_image", "owner", "run_id"} <= set(settings)


def test_an_exec_refused_because_the_container_stopped_is_a_lost_sandbox() -> None:
    """The engine answers 409, or 500 while the container is still being torn down; both mean the
    sandbox is gone (so a grading sandbox killed by its own code is graded again), not a transport fault."""
    import docker.errors
    import requests

    from patchgym.backends.sandbox.docker import _translate
    from patchgym.core.errors import SandboxLostError, TransportError

    def refused(status: int, explanation: str) -> Exception:
        response = requests.Response()
        response.status_code = status
        return docker.errors.APIError("exec_create", response=response, explanation=explanation)

    stopped = "Container 166ab883e22d is not running: Exited (137) Less than a second ago"
    assert isinstance(_translate(refused(500, stopped), "exec channel"), SandboxLostError)
    assert isinstance(_translate(refused(409, "conflict"), "exec channel"), SandboxLostError)
    assert isinstance(_translate(refused(500, "disk full"), "exec channel"), TransportError)
