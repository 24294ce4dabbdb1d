"""Local sandbox processes end with what owns them: a SIGKILLed driver, a cancelled start, a close.

Every command of these tests carries a marker (this test's temporary directory) in its command
line, and so does every bwrap process that runs one; `sandbox_processes` finds them, and what
they started, wherever they were reparented. Each test kills whatever it finds at the end, so a
failure leaves nothing running either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from patchgym.backends.sandbox import local
from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.errors import SandboxLostError
from patchgym.core.sandbox import SandboxSpec
from patchgym.process_groups import PARENT_CHECK, process_table
from tests.test_launch import alive, descendants, kill_quietly, wait_gone

ROOT = Path(__file__).resolve().parent.parent
LONG = "sleep 3600"
"""A command that outlives every test unless something kills it."""


def marked(marker: str) -> set[int]:
    """Live processes whose command line holds `marker`, and every process below them."""
    found = set()
    for pid in process_table():
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
    return found | {child for pid in found for child in descendants(pid)}


@contextlib.contextmanager
def sandbox_processes(marker: str) -> Iterator[None]:
    """Kill every process of the marked sandboxes when the block ends, however it ends."""
    try:
        yield
    finally:
        for pid in marked(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def tagged(command: str, marker: str) -> str:
    """`command`, with `marker` in the command line of the bash that runs it (and of bwrap)."""
    return f"{command}; : {marker}"


def require_bwrap() -> None:
    if local._bwrap_problem() is not None:
        if os.environ.get("CI") == "true":
            pytest.fail("bubblewrap must work in CI (.ci/run installs it)")
        pytest.skip("bubblewrap is not installed or does not work here")


@pytest.fixture(params=["none", "bwrap"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LocalSandboxBackend]:
    if request.param == "bwrap":
        require_bwrap()
    backend = LocalSandboxBackend(isolation=request.param, root_dir=tmp_path)
    yield backend
    await backend.aclose()


# -- a SIGKILLed driver --------------------------------------------------------------------------
DRIVER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from patchgym.backends.sandbox.local import LocalSandboxBackend
    from patchgym.core.sandbox import SandboxSpec

    async def main(root: Path, command: str, churn: int) -> None:
        (root / "ws").mkdir()
        backend = LocalSandboxBackend(isolation="bwrap", root_dir=root)
        box = await backend.create(SandboxSpec(workspace=root / "ws"))
        if churn:  # commands start and time out all the time: some are always half-started
            done = asyncio.Event()

            async def again() -> None:
                while True:
                    await box.exec(command, timeout_s=0.05)
                    done.set()

            churning = [asyncio.ensure_future(again()) for _ in range(churn)]
            await done.wait()
        else:
            task = asyncio.ensure_future(box.exec(command, timeout_s=3600))
            while not (await box.exec("test -e up", timeout_s=600)).ok and not task.done():
                await asyncio.sleep(0.05)
            assert not task.done(), task.result()
        print("running", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
    """
)


def kill_driver_while_running(tmp_path: Path, command: str, churn: int) -> set[int]:
    """Start a driver running `command` in a bwrap sandbox, SIGKILL it; what is still alive after
    the bound of tests/test_launch.py (everything it had started is checked)."""
    marker = str(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", DRIVER, str(tmp_path), tagged(command, marker), str(churn)]
    driver = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout is not None and driver.stdout.readline() == "running\n"
        started = descendants(driver.pid) | marked(marker)
        assert started, "the driver started no process"
        driver.kill()
        driver.wait()
        return set(wait_gone(started | marked(marker))) | marked(marker)
    finally:
        kill_quietly(driver)


@pytest.mark.parametrize("churn", [0, 8], ids=["running", "starting"])
def test_a_sigkilled_driver_leaves_no_sandbox_process(tmp_path: Path, churn: int) -> None:
    """Nothing of a bwrap sandbox outlives its driver: not the command, not a process it put in a
    session of its own, not bwrap. `starting`: eight commands start over and over, so the driver
    dies while some of them are still half set up (bubblewrap's own parent-death signal comes
    too late there: containers/bubblewrap#633)."""
    require_bwrap()
    command = f"setsid {LONG} & touch up; {LONG}" if churn == 0 else LONG
    with sandbox_processes(str(tmp_path)):
        survivors = kill_driver_while_running(tmp_path, command, churn)
        assert survivors == set(), [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in survivors if alive(p)]


def test_the_namespace_init_starts_bwrap_only_while_unshare_is_its_parent(tmp_path: Path) -> None:
    """unshare's child arms its parent-death signal after the fork; one whose unshare died before
    must start nothing. Inside the new PID namespace the host's /proc still shows the child's real
    parent, so the check that guards bwrap sees it: with unshare as the expected parent the
    sandboxed command runs, with any other pid nothing does."""
    require_bwrap()
    ran = tmp_path / "ran"
    chain = local._bwrap_argv(["--ro-bind", "/", "/", "--bind", str(tmp_path), str(tmp_path)], ["touch", str(ran)])
    subprocess.run(chain, check=True, timeout=600)
    assert ran.exists()
    ran.unlink()
    init = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--"]
    for expected in ("1", str(os.getpid())):  # host init, or this test: neither is the child's parent
        subprocess.run([*init, "sh", "-c", PARENT_CHECK, expected, "touch", str(ran)], timeout=600)
        assert not ran.exists(), expected


def test_bwrap_takes_its_half_started_sandbox_down_with_it(tmp_path: Path) -> None:
    """bubblewrap#633 made certain: bwrap is held (--userns-block-fd) after it has started its sandbox
    process and before it lets that process go on; bwrap is then SIGKILLed, as a dying driver's
    parent-death signal or asyncio's cancelled start kills it. Its sandbox process must die too."""
    require_bwrap()
    hold, release = os.pipe()
    info, info_w = os.pipe()
    options = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    options += ["--userns-block-fd", str(hold), "--info-fd", str(info_w)]
    argv = local._bwrap_argv(options, ["bash", "-c", tagged(LONG, str(tmp_path))])
    process = subprocess.Popen(argv, pass_fds=(hold, info_w), start_new_session=True)
    os.close(hold)
    os.close(info_w)
    started: set[int] = set()
    try:
        written = b""
        while not written.endswith(b"}\n"):  # written just before bwrap waits on `hold`
            chunk = os.read(info, 4096)
            assert chunk, "bwrap did not start"
            written += chunk
        assert "child-pid" in json.loads(written)
        started = descendants(process.pid) | {process.pid}
        table = process_table()
        (sandboxed,) = [pid for pid in started if not any(table[p][0] == pid for p in started if p in table)]
        os.kill(table[sandboxed][0], signal.SIGKILL)  # bwrap, the parent of its sandbox process
        assert wait_gone(started) == []
    finally:
        os.close(info)
        os.close(release)
        for pid in started | {process.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()


# -- cancelled commands, closed sandboxes --------------------------------------------------------
async def test_cancelled_starts_kill_what_they_started(
    backend: LocalSandboxBackend, workspace: Path, tmp_path: Path
) -> None:
    """A command cancelled at every point of its start ends, and leaves nothing running (asyncio
    kills only the process it started when a start is cancelled; bwrap's half-started sandbox
    process then waited forever for its parent, and the cancellation with it)."""
    marker = str(tmp_path)
    with sandbox_processes(marker):
        async with await backend.create(SandboxSpec(workspace=workspace)) as box:
            for steps in range(12):
                task = asyncio.ensure_future(box.exec(tagged(LONG, marker), timeout_s=3600))
                for _ in range(steps):
                    await asyncio.sleep(0)
                task.cancel()
                done, _ = await asyncio.wait([task], timeout=120)
                assert done, f"a start cancelled after {steps} loop steps did not end"
            assert wait_gone(marked(marker)) == []


async def test_close_kills_the_commands_still_running(
    backend: LocalSandboxBackend, workspace: Path, tmp_path: Path
) -> None:
    """Closing a sandbox (or the backend) ends the commands still running in it; they report a
    lost sandbox, not a result."""
    marker = str(tmp_path)
    escape = "setsid " if backend.isolation == "bwrap" else ""  # no boundary without bwrap: setsid is out of reach
    command = tagged(f"{escape}{LONG} & touch started; {LONG}", marker)
    with sandbox_processes(marker):
        closed, left_open = [await backend.create(SandboxSpec(workspace=workspace)) for _ in range(2)]
        running = [asyncio.ensure_future(box.exec(command, timeout_s=3600)) for box in (closed, left_open)]
        for box in (closed, left_open):
            while not (await box.exec("test -e started", timeout_s=60)).ok:
                await asyncio.sleep(0.05)
        started = marked(marker)
        await closed.close()
        with pytest.raises(SandboxLostError, match="closed while the command ran"):
            await running[0]
        assert not running[1].done()
        await backend.aclose()
        with pytest.raises(SandboxLostError, match="closed while the command ran"):
            await running[1]
        assert wait_gone(started | marked(marker)) == []
