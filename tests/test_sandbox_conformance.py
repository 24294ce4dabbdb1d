"""The sandbox contract (patchgym.testing.sandbox) on every built-in backend.

The suite lives in `patchgym.testing.sandbox`, where provider packages import it too. Here it
runs over the `backend` fixture of conftest.py, parametrised over its `BACKENDS` variants; a new
built-in backend joins by adding itself there. Tests of one backend's own guarantees follow.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from patchgym.core.sandbox import SandboxBackend, SandboxSpec
from patchgym.testing.sandbox import SandboxConformance


class TestSandboxConformance(SandboxConformance):
    @pytest.fixture
    def backend(self, backend: SandboxBackend) -> SandboxBackend:
        """conftest's `backend`, one per variant in BACKENDS (it closes them itself)."""
        return backend


async def test_bwrap_isolation_protects_the_host(tmp_path: Path, workspace: Path) -> None:
    from patchgym.backends.sandbox.local import LocalSandboxBackend, _bwrap_problem

    if _bwrap_problem() is not None:
        pytest.skip("bubblewrap is not usable here")
    backend = LocalSandboxBackend(isolation="auto", root_dir=tmp_path)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2); print('connected')\""
    try:
        async with await backend.create(SandboxSpec(workspace=workspace)) as box:
            assert box.workdir == "/workspace"
            denied = await box.exec("touch /usr/patchgym-escape", timeout_s=30)
            assert denied.exit_code != 0 and "Read-only" in denied.stderr
            offline = await box.exec(probe, timeout_s=30)
            assert offline.exit_code != 0 and "connected" not in offline.stdout
        async with await backend.create(SandboxSpec(workspace=workspace, network=True)) as box:
            online = await box.exec(probe, timeout_s=30)
            assert online.stdout == "connected\n"
    finally:
        server.close()
        await backend.aclose()
