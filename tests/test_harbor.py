"""Harbor-specific behaviour. The shared sandbox contract runs on Harbor in test_sandbox_conformance.py.

Harbor needs Python >= 3.12: on 3.11 only the clear refusal is tested; CI runs the rest in a
Python 3.12 virtualenv over the local test provider tests/harbor_local_env.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from patchgym.core.errors import ConfigError, SandboxStartError, TransportError
from patchgym.core.plugins import registry
from patchgym.core.sandbox import SandboxSpec
from tests.conftest import make_harbor_backend

needs_312 = pytest.mark.skipif(sys.version_info < (3, 12), reason="Harbor needs Python >= 3.12")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the refusal is for Python < 3.12")
def test_python_311_gets_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"needs Python >= 3\.12"):
        registry().create("sandbox", "harbor")


@needs_312
def test_unknown_environment_is_a_config_error_listing_the_known_ones() -> None:
    make_harbor_backend()  # skips when Harbor is unusable here
    with pytest.raises(ConfigError, match="unknown Harbor environment 'dockr'; known: .*daytona.*docker"):
        registry().create("sandbox", "harbor", environment="dockr")
    with pytest.raises(ConfigError, match="cannot load the Harbor environment 'nowhere:Nothing'"):
        registry().create("sandbox", "harbor", import_path="nowhere:Nothing")


@needs_312
def test_registered_and_settings_report_limits() -> None:
    backend = make_harbor_backend(start_concurrency=3)
    assert backend.settings()["start_concurrency"] == 3
    assert backend.settings()["environment"] == "tests.harbor_local_env:LocalEnvironment"
    assert type(registry().create("sandbox", "harbor", environment="daytona")).__name__ == "HarborSandboxBackend"


@needs_312
async def test_dockerfile_and_image_specs_become_harbor_environments(tmp_path: Path, workspace: Path) -> None:
    backend = make_harbor_backend()
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "task.Dockerfile").write_text("FROM patchgym/base:latest\n")
    async with await backend.create(
        SandboxSpec(workspace=workspace, dockerfile=tmp_path / "ctx" / "task.Dockerfile")
    ) as box:
        env_dir = box.environment.environment_dir
        assert (env_dir / "Dockerfile").read_text() == "FROM patchgym/base:latest\n"
    async with await backend.create(SandboxSpec(workspace=workspace, image="python:3.12", env={"A": "1"})) as box:
        assert (box.environment.environment_dir / "Dockerfile").read_text() == "FROM python:3.12\n"
        assert (await box.exec("echo $A", timeout_s=30)).stdout == "1\n"
    with pytest.raises(SandboxStartError, match="does not exist"):
        await backend.create(SandboxSpec(dockerfile=tmp_path / "missing" / "Dockerfile"))


@needs_312
async def test_provider_failure_is_a_transport_error(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_harbor_backend()
    async with await backend.create(SandboxSpec(workspace=workspace)) as box:

        async def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("docker compose exec timed out")

        monkeypatch.setattr(box.environment, "exec", broken)
        with pytest.raises(TransportError, match="docker compose exec timed out"):
            await box.exec("true", timeout_s=30)


@needs_312
async def test_tiny_task_set_validates_on_harbor() -> None:
    from patchgym.core.validation import validate_task

    backend = make_harbor_backend()
    tasks = list(registry().create("task_set", "tiny"))
    reports = await asyncio.gather(*(validate_task(backend, task) for task in tasks))
    assert [r.problems for r in reports] == [[] for _ in tasks]
