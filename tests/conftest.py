"""Shared fixtures: sandbox backends under test and a small workspace."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.plugins import reset_registry
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec


def docker_problem() -> str | None:
    """Why the Docker tests cannot run here, or None if they can."""
    try:
        import docker
        import docker.errors

        from patchgym.backends.sandbox.docker import DEFAULT_IMAGE
    except ImportError:
        return "the docker SDK is not installed (pip install 'patchgym[docker]')"
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # any failure to reach the engine
        return f"no Docker engine is reachable ({exc})"
    try:
        client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        return f"the base image {DEFAULT_IMAGE} is missing: run `patchgym sandbox build-base`"
    finally:
        client.close()
    return None


def require_docker() -> None:
    """Skip outside CI when Docker is unusable; in CI (CI=true) that is a failure."""
    problem = docker_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"Docker tests must run in CI: {problem}")
    pytest.skip(problem)


BACKENDS = ["local-none", "local-bwrap", "docker"]


def make_backend(kind: str, tmp_path: Path) -> SandboxBackend:
    if kind == "docker":
        require_docker()
        from patchgym.backends.sandbox.docker import DockerSandboxBackend

        return DockerSandboxBackend(concurrency=8)
    if kind == "local-bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    root = tmp_path / "sandboxes"
    root.mkdir(exist_ok=True)
    return LocalSandboxBackend(root_dir=root, isolation=kind.removeprefix("local-"))  # type: ignore[arg-type]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "hello.txt").write_text("hello\n")
    return root


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SandboxBackend]:
    backend = make_backend(request.param, tmp_path)
    yield backend
    await backend.aclose()


@pytest.fixture
async def sandbox(backend: SandboxBackend, workspace: Path) -> AsyncIterator[Sandbox]:
    box = await backend.create(SandboxSpec(workspace=workspace, labels={"suite": "conformance"}))
    yield box
    await box.close()


@pytest.fixture(autouse=True)
def fresh_registry() -> None:
    reset_registry()


def require_train_extra() -> None:
    """Skip outside CI when torch/transformers are missing; in CI (CI=true) that is a failure."""
    try:
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the train extra must be installed in CI: {exc}")
        pytest.skip(f"needs pip install 'patchgym[train]' ({exc})", allow_module_level=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 model and tokenizer (patchgym.models.tiny), written once per session."""
    require_train_extra()
    from patchgym.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny-model"))
