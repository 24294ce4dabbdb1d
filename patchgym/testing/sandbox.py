"""The sandbox conformance suite: the contract every `SandboxBackend` meets (patchgym.core.sandbox).

patchgym's own backends (local, Docker, E2B, Harbor) pass it, and a provider package proves that
its backend conforms with one import and one method::

    from patchgym.testing.sandbox import SandboxConformance

    class TestAcmeSandbox(SandboxConformance):
        def make_backend(self, root):
            return AcmeSandboxBackend(root_dir=root)

pytest then collects every test below for that class, each with a fresh backend (closed with
`aclose()` afterwards) and, where a test needs one, a started sandbox over a small workspace
(`pkg/hello.txt` holding "hello\\n"). The tests check exit codes and output, bash in the workdir,
the environment, timeouts and cancellation that kill whole process trees, output capped while it
streams, binary output, file round trips, paths confined to the sandbox, independent copies,
idempotent close, typed infrastructure errors, reaping by label and concurrent commands.

Needs pytest and pytest-asyncio (`pip install 'patchgym[testing]'`); works in pytest-asyncio's
strict and auto modes.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

from patchgym.core.errors import InfraError, SandboxLostError, SandboxStartError
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxPathError, SandboxSpec
from patchgym.testing._pytest import pytest, pytest_asyncio

__all__ = ["SandboxConformance", "make_workspace"]


def make_workspace(root: Path) -> Path:
    """The suite's workspace under `root`: `pkg/hello.txt` holding "hello\\n"."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "hello.txt").write_text("hello\n")
    return root


@pytest.mark.asyncio
class SandboxConformance:
    """Subclass it (with a name starting with `Test`) and implement `make_backend`.

    A subclass may instead override the `backend` fixture, e.g. to parametrise it over several
    configurations of one backend.
    """

    def make_backend(self, root: Path) -> SandboxBackend:
        """A new backend under test; `root` is an empty directory of this test for any files it keeps."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_backend(self, root) -> SandboxBackend "
            "(or override the `backend` fixture)"
        )

    @pytest_asyncio.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[SandboxBackend]:
        root = tmp_path / "backend"
        root.mkdir()
        backend = self.make_backend(root)
        try:
            yield backend
        finally:
            await backend.aclose()

    @pytest.fixture
    def workspace(self, tmp_path: Path) -> Path:
        return make_workspace(tmp_path / "workspace")

    @pytest_asyncio.fixture
    async def sandbox(self, backend: SandboxBackend, workspace: Path) -> AsyncIterator[Sandbox]:
        box = await backend.create(SandboxSpec(workspace=workspace, labels={"suite": "conformance"}))
        try:
            yield box
        finally:
            await box.close()

    async def test_exec_returns_output_and_exit_code(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec("cat pkg/hello.txt; echo oops >&2; exit 3", timeout_s=30)
        assert result.exit_code == 3
        assert result.stdout == "hello\n"
        assert result.stderr == "oops\n"
        assert not result.timed_out and not result.truncated
        assert result.duration_s > 0

    async def test_commands_run_in_workdir_with_bash_not_a_login_shell(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec('pwd; shopt -q login_shell || echo plain; echo "$0"', timeout_s=30)
        assert result.stdout.splitlines() == [sandbox.workdir, "plain", "bash"]
        sub = await sandbox.exec("pwd", timeout_s=30, cwd="pkg")
        assert sub.stdout.strip() == f"{sandbox.workdir}/pkg"

    async def test_env_is_spec_plus_call_and_host_secrets_do_not_leak(
        self, backend: SandboxBackend, workspace: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("PATCHGYM_TEST_SECRET", "s3cret")
        async with await backend.create(SandboxSpec(workspace=workspace, env={"FROM_SPEC": "1"})) as box:
            result = await box.exec(
                'echo "$FROM_SPEC $FROM_CALL [$PATCHGYM_TEST_SECRET]"', timeout_s=30, env={"FROM_CALL": "2"}
            )
        assert result.stdout == "1 2 []\n"

    async def test_failing_command_is_data_not_exception(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec("no-such-command-xyz", timeout_s=30)
        assert result.exit_code == 127
        assert "not found" in result.stderr

    async def test_a_command_killed_by_a_signal_exits_128_plus_the_signal(self, sandbox: Sandbox) -> None:
        """As a shell reports it: SIGKILL is 137, SIGTERM 143 (not a negative code, not 0)."""
        killed = await sandbox.exec("echo before; kill -KILL $$; echo after", timeout_s=30)
        assert (killed.exit_code, killed.stdout, killed.timed_out) == (137, "before\n", False)
        terminated = await sandbox.exec("kill -TERM $$", timeout_s=30)
        assert terminated.exit_code == 143

    async def test_timeout_kills_the_whole_process_tree(self, sandbox: Sandbox) -> None:
        ticker = "(while true; do echo t >> ticks; sleep 0.05; done) & bash -c 'sleep 300' & wait"
        result = await sandbox.exec(ticker, timeout_s=2)
        assert result.timed_out and result.exit_code is None
        before = len(await sandbox.read_file("ticks"))
        await asyncio.sleep(0.5)
        assert len(await sandbox.read_file("ticks")) == before, "a grandchild survived the timeout"

    async def test_background_processes_do_not_outlive_their_command(self, sandbox: Sandbox) -> None:
        ticker = "(while true; do echo t >> ticks; sleep 0.05; done) & until [ -s ticks ]; do sleep 0.01; done; echo hi"
        result = await sandbox.exec(ticker, timeout_s=30)
        assert result.stdout == "hi\n" and result.exit_code == 0
        before = len(await sandbox.read_file("ticks"))
        await asyncio.sleep(0.5)
        assert len(await sandbox.read_file("ticks")) == before

    async def test_gigabyte_of_output_is_capped_while_streaming(self, sandbox: Sandbox) -> None:
        tracemalloc.start()
        try:
            result = await sandbox.exec(
                "head -c 1000000000 /dev/zero | tr '\\0' x", timeout_s=120, max_output_bytes=65536
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert result.exit_code == 0 and result.truncated
        assert result.stdout.startswith("x" * 32768) and result.stdout.endswith("x" * 32768)
        assert "999934464 bytes omitted" in result.stdout
        assert peak < 8 * 1024 * 1024, f"peak Python memory {peak / 1e6:.1f} MB while capturing 1 GB"

    async def test_non_utf8_and_binary_output(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec("printf 'ok \\377\\376 done'; head -c 256 /dev/urandom >&2", timeout_s=30)
        assert result.stdout == "ok \ufffd\ufffd done"
        assert isinstance(result.stderr, str)

    async def test_files_round_trip(self, sandbox: Sandbox, tmp_path: Path) -> None:
        payload = bytes(range(256)) * 10
        await sandbox.write_file("new/dir/data.bin", payload)
        assert await sandbox.read_file("new/dir/data.bin") == payload
        assert await sandbox.read_file(f"{sandbox.workdir}/new/dir/data.bin") == payload
        listed = await sandbox.exec("wc -c < new/dir/data.bin", timeout_s=30)
        assert listed.stdout.strip() == "2560"
        await sandbox.write_file("text.txt", "héllo")
        assert (await sandbox.read_file("text.txt")).decode() == "héllo"
        with pytest.raises(FileNotFoundError):
            await sandbox.read_file("missing.txt")

        local = tmp_path / "up"
        (local / "a").mkdir(parents=True)
        (local / "a" / "b.txt").write_text("b")
        await sandbox.upload_dir(local, "uploaded")
        assert (await sandbox.exec("cat uploaded/a/b.txt", timeout_s=30)).stdout == "b"
        await sandbox.download_dir("uploaded", tmp_path / "down")
        assert (tmp_path / "down" / "a" / "b.txt").read_text() == "b"

    async def test_paths_outside_the_sandbox_are_rejected(self, sandbox: Sandbox) -> None:
        for path in ("/etc/passwd", "../outside.txt", "pkg/../../outside.txt"):
            with pytest.raises(SandboxPathError, match="outside this sandbox"):
                await sandbox.read_file(path)
        with pytest.raises(SandboxPathError):
            await sandbox.write_file("/etc/patchgym-should-not-exist", b"x")
        await sandbox.exec("ln -s /etc/hostname escape", timeout_s=30)
        with pytest.raises(SandboxPathError):
            await sandbox.read_file("escape")

    async def test_temp_files_are_reachable_through_tmpdir(self, sandbox: Sandbox) -> None:
        made = await sandbox.exec('d=$(mktemp -d); echo hi > "$d/f"; echo "$d/f"', timeout_s=30)
        assert await sandbox.read_file(made.stdout.strip()) == b"hi\n"

    async def test_sandboxes_are_independent_copies(self, backend: SandboxBackend, workspace: Path) -> None:
        spec = SandboxSpec(workspace=workspace)
        async with await backend.create(spec) as one, await backend.create(spec) as two:
            await one.exec("echo changed > pkg/hello.txt", timeout_s=30)
            assert (await two.read_file("pkg/hello.txt")) == b"hello\n"
        assert (workspace / "pkg" / "hello.txt").read_text() == "hello\n"

    async def test_close_is_idempotent_and_final(self, backend: SandboxBackend, workspace: Path) -> None:
        box = await backend.create(SandboxSpec(workspace=workspace))
        await box.exec("chmod -R a-w .", timeout_s=30)  # cleanup must cope with read-only files
        await box.close()
        await box.close()
        with pytest.raises(SandboxLostError):
            await box.exec("true", timeout_s=30)
        with pytest.raises(InfraError):
            await box.read_file("pkg/hello.txt")

    async def test_failure_to_start_is_a_typed_infra_error(self, backend: SandboxBackend, tmp_path: Path) -> None:
        with pytest.raises(SandboxStartError, match="does not exist") as caught:
            await backend.create(SandboxSpec(workspace=tmp_path / "missing"))
        assert caught.value.retryable and caught.value.kind == "sandbox_start"

    async def test_reap_removes_sandboxes_by_label(self, backend: SandboxBackend, workspace: Path) -> None:
        keep = await backend.create(SandboxSpec(workspace=workspace, labels={"run": "a"}))
        leaked = [
            await backend.create(SandboxSpec(workspace=workspace, labels={"run": "b", "i": str(i)})) for i in range(2)
        ]
        assert await backend.reap({"run": "b"}) == 2
        assert (await keep.exec("echo alive", timeout_s=30)).stdout == "alive\n"
        assert await backend.reap({"run": "b"}) == 0
        for box in [keep, *leaked]:
            await box.close()

    async def test_concurrent_commands(self, sandbox: Sandbox) -> None:
        results = await asyncio.gather(*(sandbox.exec(f"sleep 0.2; echo {i}", timeout_s=30) for i in range(8)))
        assert [r.stdout.strip() for r in results] == [str(i) for i in range(8)]

    async def test_cancelled_exec_kills_the_command(self, sandbox: Sandbox) -> None:
        task = asyncio.create_task(sandbox.exec("while true; do echo t >> ticks; sleep 0.05; done", timeout_s=60))
        while not (await sandbox.exec("test -s ticks", timeout_s=30)).ok:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        before = len(await sandbox.read_file("ticks"))
        await asyncio.sleep(0.3)
        assert len(await sandbox.read_file("ticks")) == before
