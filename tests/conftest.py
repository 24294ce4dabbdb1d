"""Shared fixtures: sandbox backends under test and a small workspace."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.plugins import reset_registry
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec

BACKENDS = [
    pytest.param({"isolation": "none"}, id="local-none"),
    pytest.param(
        {"isolation": "bwrap"},
        id="local-bwrap",
        marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    ),
]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "hello.txt").write_text("hello\n")
    return root


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SandboxBackend]:
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    backend = LocalSandboxBackend(root_dir=sandboxes, **request.param)
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
