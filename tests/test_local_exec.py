"""Local exec: commands run in the sandbox's own environment, and their end is noticed, not polled for."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from patchgym.backends.sandbox import local
from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.errors import ConfigError
from patchgym.core.sandbox import SandboxSpec


@pytest.fixture(params=["none", "bwrap"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LocalSandboxBackend]:
    if request.param == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    backend = LocalSandboxBackend(isolation=request.param, root_dir=tmp_path)
    yield backend
    await backend.aclose()


async def test_spec_path_is_not_reset_by_a_login_shell(backend: LocalSandboxBackend, workspace: Path) -> None:
    path = f"/opt/patchgym-none/bin:{Path(shutil.which('bash') or '/bin/bash').parent}:/usr/bin:/bin"
    async with await backend.create(SandboxSpec(workspace=workspace, env={"PATH": path})) as box:
        result = await box.exec('echo "$PATH"; shopt -q login_shell && echo login', timeout_s=30)
    assert result.stdout == f"{path}\n"


async def test_a_commands_end_is_noticed_without_polling(
    backend: LocalSandboxBackend, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_sleeping(delay: float, result: object = None) -> object:
        raise AssertionError("exec polled with asyncio.sleep")

    monkeypatch.setattr(local.asyncio, "sleep", no_sleeping)
    async with await backend.create(SandboxSpec(workspace=workspace)) as box:
        result = await box.exec("echo out; echo err >&2; exit 5", timeout_s=30)
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 5)


def test_bwrap_without_its_tools_is_a_config_error_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """bwrap sandboxes need util-linux's unshare and setpriv too; `auto` refuses as well (never falls back to
    no isolation): only an explicit `isolation: none` runs commands unisolated."""
    monkeypatch.setattr(local.shutil, "which", lambda tool: None if tool in ("unshare", "setpriv") else f"/bin/{tool}")
    for isolation in ("bwrap", "auto"):
        with pytest.raises(ConfigError) as caught:
            LocalSandboxBackend(isolation=isolation)
        message = str(caught.value)
        assert "(unshare, setpriv not found): install bubblewrap and util-linux" in message
        assert "isolation: none" in message and "--sandbox-option isolation=none" in message
    assert LocalSandboxBackend(isolation="none").isolation == "none"
