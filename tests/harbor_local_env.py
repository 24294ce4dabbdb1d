"""A Harbor environment provider that runs on this machine, for testing the harbor backend.

Harbor's own local provider (docker) drives `docker compose` v2 and creates a network per trial,
neither of which this test machine allows (see docs/sandboxes.md). This provider implements
Harbor's `BaseEnvironment` contract over `tests.private_root.PrivateRoot` (private
`/workspace`, `/tmp`, `/home`, host tools read-only, processes under bubblewrap) and is loaded by
Harbor through `import_path="tests.harbor_local_env:LocalEnvironment"`, exactly as a
third-party provider would be.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
from pathlib import Path

from harbor.environments.base import BaseEnvironment, ExecResult

from tests.private_root import PrivateRoot


class LocalEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "patchgym-test-local"

    def _validate_definition(self) -> None:
        if not (self.environment_dir / "Dockerfile").is_file():
            raise FileNotFoundError(f"{self.environment_dir}/Dockerfile is missing")

    async def start(self, force_build: bool) -> None:
        disk = Path(tempfile.mkdtemp(prefix="harbor-local-"))
        self.root = PrivateRoot(
            disk, f"harbor{secrets.token_hex(6)}", network=bool(self.task_env_config.allow_internet)
        )
        self._maybe_resolve_task_env()

    async def stop(self, delete: bool) -> None:
        await asyncio.to_thread(self.root.destroy)

    def _host(self, path: str, *, write: bool = False) -> Path:
        host = self.root.host_path(path)
        if write and not self.root.writable(host):
            raise PermissionError(f"{path} is read-only in this environment")
        return host

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._host(target_path, write=True)
        await asyncio.to_thread(shutil.copyfile, source_path, target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        target = self._host(target_dir, write=True)
        await asyncio.to_thread(shutil.copytree, source_dir, target, symlinks=True, dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await asyncio.to_thread(shutil.copyfile, self._host(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        copy = shutil.copytree
        await asyncio.to_thread(copy, self._host(source_dir), target_dir, symlinks=True, dirs_exist_ok=True)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        proc = await asyncio.create_subprocess_exec(
            *self.root.argv("bash", ["-c", command], cwd or "/home/user"),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.root.env(self._merge_env(env) or {}),
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except TimeoutError:  # as Harbor's docker provider: kill the client, raise
            proc.kill()
            raise RuntimeError(f"command timed out after {timeout_sec} seconds") from None
        finally:
            if proc.returncode is None:
                proc.kill()
        decode = {"encoding": "utf-8", "errors": "replace"}
        return ExecResult(stdout=stdout.decode(**decode), stderr=stderr.decode(**decode), return_code=proc.returncode)
