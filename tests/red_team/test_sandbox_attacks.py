"""Red team: attacks on the sandbox itself (issue 27, kinds 5, 6 and 8), on bwrap and Docker.

Each attack won on main (as its test's docstring or the comments say) and is held now.

Kind 5, leak: a sandbox of a `tiny` task looks for the task's gold patch (find over the whole
file system, patchgym's import path, site-packages), for an editable install and for a real
wheel installed into a fresh venv. On main the wheel's copy was readable from bwrap sandboxes
(the venv is bound read-only); the installed package and the task folder are masked now
(`patchgym.backends.sandbox.hidden`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from patchgym.backends.sandbox.hidden import hidden_host_paths, mask_args
from patchgym.core.errors import AGENT_KILLED_SANDBOX
from patchgym.core.validation import apply_patch_command
from patchgym.envs.swe import AsyncSWEEnv
from patchgym.plugins.folder import tiny_task_set
from tests.conftest import require_docker

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("leak_probe.py")


def require_bwrap() -> None:
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")


def probe(python: str, kind: str, tmp_path: Path, cwd: Path) -> dict:
    done = subprocess.run(
        [python, str(PROBE), kind, str(tmp_path)], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of a fresh venv holding a wheel built from this checkout (its dependencies come
    from this venv through a .pth line, so nothing is downloaded)."""
    folder = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT), "-w"]
    subprocess.run([*build, str(folder / "dist")], check=True, capture_output=True, cwd=folder, timeout=600)
    (wheel,) = (folder / "dist").glob("patchgym-*.whl")
    venv = folder / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)  # type: ignore[attr-defined]
    python = str(venv / "bin" / "python")
    install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    site_dir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    ours = next(p for p in sys.path if p.endswith("site-packages"))
    Path(site_dir, "zz_patchgym_test_deps.pth").write_text(ours + "\n")
    return python


def test_a_wheel_installs_gold_patches_that_no_bwrap_sandbox_can_read(wheel_python: str, tmp_path: Path) -> None:
    require_bwrap()
    found = probe(wheel_python, "bwrap", tmp_path, cwd=tmp_path)
    assert "site-packages" in found["package"] and "/tmp" in found["package"] or str(tmp_path) not in found["package"]
    assert Path(found["package"]).parent.joinpath("plugins/tiny/tasks/roman-subtractive/gold.patch").is_file()
    assert not any(r["found"] for r in found["results"].values()), found


def test_an_editable_install_leaves_no_gold_patch_readable_from_bwrap(tmp_path: Path) -> None:
    require_bwrap()
    found = probe(sys.executable, "bwrap", tmp_path, cwd=ROOT)
    assert found["package"] == str(ROOT / "patchgym" / "__init__.py")
    assert not any(r["found"] for r in found["results"].values()), found


def test_no_gold_patch_is_readable_from_docker(wheel_python: str, tmp_path: Path) -> None:
    require_docker()
    for python, cwd in ((sys.executable, ROOT), (wheel_python, tmp_path)):
        found = probe(python, "docker", tmp_path, cwd=cwd)
        assert not any(r["found"] for r in found["results"].values()), found


def test_masks_cover_the_package_and_task_folders_but_never_the_interpreter(tmp_path: Path) -> None:
    """A checkout holding its own venv (as a development checkout does): the checkout is hidden
    entry by entry, the venv stays; folders outside what is bound need no mask."""
    checkout = tmp_path / "opt" / "patchgym-src"
    for folder in ("patchgym/plugins/tiny", "tests/fixtures", ".venv/bin"):
        (checkout / folder).mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('[project]\nname = "patchgym"\n')
    task = tmp_path / "opt" / "tasks" / "t1"
    (task / "repo").mkdir(parents=True)
    hidden = [str(checkout), str(task), str(tmp_path / "elsewhere")]
    args = mask_args(hidden, bound=[str(tmp_path / "opt")], keep=[str(checkout / ".venv")])
    masked = args[1::4]
    assert masked == sorted([str(checkout / "patchgym"), str(checkout / "tests"), str(task)])
    assert args[:4] == ["--tmpfs", masked[0], "--remount-ro", masked[0]]
    paths = hidden_host_paths(task / "repo", extra=["/srv/tasks"])
    assert str(task) in paths and "/srv/tasks" in paths
    assert os.path.realpath(str(ROOT / "patchgym")) in paths  # this (editable) install


# -- kind 6: retry as a channel -------------------------------------------------------------
# An agent that ends its own sandbox got a retryable `sandbox_lost` infrastructure error on main
# (its 0 traded for another try). A sandbox that ended from inside is scored now.

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
KILLERS = {
    "kill-all": "kill -9 -1; sleep 5",
    "kill-init": "kill 1; sleep 5",
    "kill-init-child": "kill -9 $(cat /proc/1/task/1/children); sleep 5",
}


async def play(backend: Any, commands: list[str], **settings: Any) -> dict[str, Any]:
    env = AsyncSWEEnv(tiny_task_set(), backend, **settings)
    try:
        await env.reset(options={"task": "roman-subtractive"})
        for command in [*commands, SUBMIT]:
            _, reward, terminated, truncated, info = await env.step(f"```bash\n{command}\n```")
            if terminated or truncated:
                break
    finally:
        await env.close()
    return {"reward": reward, **info}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def docker_backend() -> AsyncIterator[Any]:
    require_docker()
    from patchgym.backends.sandbox.docker import DockerSandboxBackend

    backend = DockerSandboxBackend(concurrency=4)
    yield backend
    await backend.aclose()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("attack", sorted(KILLERS))
async def test_an_agent_that_ends_its_docker_sandbox_is_scored_not_retried(docker_backend: Any, attack: str) -> None:
    info = await play(docker_backend, [KILLERS[attack]])
    assert info["infra_error"] is None, info["infra_error"]
    assert info["termination"] == AGENT_KILLED_SANDBOX and info["reward"] == 0.0
    assert info["grade"]["details"]["reason"] == AGENT_KILLED_SANDBOX
    assert (
        "exited by itself" in info["grade"]["details"]["message"]
        or "stopped by itself" in info["grade"]["details"]["message"]
    )


@pytest.mark.asyncio(loop_scope="module")
async def test_a_killer_left_behind_ends_the_sandbox_between_commands(docker_backend: Any) -> None:
    """The background killer escapes the command's process group and ends the container while no
    command runs: the next command finds it stopped, and that is still the agent's doing."""
    killer = "setsid sh -c 'sleep 2; kill -9 -1' >/dev/null 2>&1 < /dev/null & sleep 1"  # 1 s to leave the group
    info = await play(docker_backend, [killer, "sleep 4", "sleep 1"])
    assert info["infra_error"] is None, info["infra_error"]
    assert (info["termination"], info["reward"]) == (AGENT_KILLED_SANDBOX, 0.0), info


@pytest.mark.asyncio(loop_scope="module")
async def test_a_container_removed_on_the_host_is_still_an_infrastructure_fault(docker_backend: Any) -> None:
    """Control: the agent cannot remove its container; a loss it cannot have caused stays retryable."""
    env = AsyncSWEEnv(tiny_task_set(), docker_backend)
    try:
        await env.reset(options={"task": "roman-subtractive"})
        assert env.sandbox is not None
        await docker_backend.remove(env.sandbox.container)  # type: ignore[attr-defined]
        _, _, _, _, info = await env.step("```bash\nls\n```")
    finally:
        await env.close()
    assert info["infra_error"]["kind"] == "sandbox_lost" and info["infra_error"]["retryable"] is True
    assert info["termination"] == "infra_error"


@pytest.mark.parametrize("attack", sorted(KILLERS))
async def test_on_bwrap_a_killer_ends_only_its_own_command(attack: str, tmp_path: Path) -> None:
    """bwrap gives each command its own PID namespace: the killer ends its command, the episode
    goes on and the gold patch applied afterwards still scores 1."""
    require_bwrap()
    from patchgym.backends.sandbox.local import LocalSandboxBackend

    backend = LocalSandboxBackend(isolation="bwrap", root_dir=tmp_path)
    gold = tiny_task_set().get("roman-subtractive").gold_patch
    assert gold is not None
    try:
        info = await play(backend, [KILLERS[attack], apply_patch_command(gold)])
    finally:
        await backend.aclose()
    assert info["infra_error"] is None and (info["termination"], info["reward"]) == ("submitted", 1.0)


# -- kind 8: host harm ----------------------------------------------------------------------
# On main the agent's whole tree was copied to the host before any limit applied (a 2 GB sparse
# file grew the driver to 2.1 GB RSS and filled the disk), 3,000 files took 403 s to grade on
# Docker (a put_archive per file), nothing bounded a sandbox's disk, and on `none` a setsid
# child outlived its command.


def make(kind: str, root: Path, **settings: Any) -> Any:
    if kind == "docker":
        require_docker()
        from patchgym.backends.sandbox.docker import DockerSandboxBackend

        return DockerSandboxBackend(concurrency=4, **settings)
    require_bwrap()
    from patchgym.backends.sandbox.local import LocalSandboxBackend

    return LocalSandboxBackend(isolation="bwrap", root_dir=root, **settings)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["local-bwrap", "docker"])
async def any_backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    backend = make(request.param, tmp_path_factory.mktemp("sandboxes"))
    yield backend
    await backend.aclose()


def gold() -> str:
    patch = tiny_task_set().get("roman-subtractive").gold_patch
    assert patch is not None
    return patch


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("where", ["big.bin", ".git/objects/big.bin", "tests/big.bin"])
async def test_a_sparse_file_is_refused_in_the_sandbox_before_any_copy(any_backend: Any, where: str) -> None:
    """The gold fix plus a 2 GB sparse file (in the repository, in .git, among the tests: none of
    them is skipped by the measure, all of them were downloaded on main)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = await play(any_backend, [apply_patch_command(gold()), f"truncate -s 2G {where}"])
    grading = info["grade"]["details"]["grading"]
    assert (info["reward"], info["grade"]["details"]["reason"]) == (0.0, "diff_too_large"), info["grade"]
    assert "nothing was copied out" in info["grade"]["details"]["message"]
    assert "diff_s" not in grading and grading["tree_bytes"] > 2 * 10**9  # measured, never downloaded
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 500_000  # KiB: no 2 GB read


@pytest.mark.asyncio(loop_scope="module")
async def test_thousands_of_files_beyond_max_diff_files_are_refused_before_the_copy(any_backend: Any) -> None:
    spray = "mkdir spray && cd spray && for i in $(seq 1200); do echo $i > f$i.py; done"
    info = await play(any_backend, [apply_patch_command(gold()), spray], max_diff_files=1000)
    assert (info["reward"], info["grade"]["details"]["reason"]) == (0.0, "too_many_files"), info["grade"]
    assert "diff_s" not in info["grade"]["details"]["grading"]


@pytest.mark.asyncio(loop_scope="module")
async def test_three_thousand_changed_files_are_graded_in_one_write(any_backend: Any) -> None:
    """Under the limits, 3,000 extra files are carried into the grading sandbox (all of them: the
    gold fix among them still scores 1). Docker wrote them one put_archive each on main."""
    spray = 'mkdir spray && cd spray && for i in $(seq 3000); do echo "X$i = $i" > f$i.py; done'
    info = await play(any_backend, [apply_patch_command(gold()), spray])
    grading = info["grade"]["details"]["grading"]
    assert (info["reward"], grading["diff_files"]) == (1.0, 3001), info["grade"]
    print(f"3,000 files graded in {grading['total_s']} s")  # noqa: T201 - the figure the issue asks for


@pytest.mark.parametrize("kind", ["local-bwrap", "docker"])
async def test_a_command_filling_the_disk_is_stopped_at_the_quota(kind: str, tmp_path: Path) -> None:
    """48 MiB quota: a loop writing 4 MB files forever (a 20 GB writer, scaled down) is killed near
    the quota; on Docker without --storage-opt a single file beyond it is refused (RLIMIT_FSIZE)."""
    from patchgym.core.sandbox import SandboxSpec

    spec = tiny_task_set().get("roman-subtractive").sandbox
    backend = make(kind, tmp_path, disk_quota_mb=48, disk_check_interval_s=0.5)
    sandbox = await backend.create(SandboxSpec(workspace=spec.workspace, labels={"red": "quota"}))
    try:
        # at most ~80 MB/s (a pause after each 4 MB), so that one check interval's overshoot is bounded
        # in bytes on any machine: an unpaced writer on a fast disk passes 200 MB between two checks
        filler = "i=0; while true; do i=$((i+1)); head -c 4000000 /dev/zero > fill$i || exit 9; sleep 0.05; done"
        done = await sandbox.exec(filler, timeout_s=600)
        assert done.exit_code in (137, 9) and "over its disk quota" in done.stderr, done
        used = await sandbox.exec("du -sk . | cut -f1", timeout_s=60)
        assert int(used.stdout) < 48 * 1024 + 200 * 1024  # stopped: far below what it would write
        freed = await sandbox.exec("rm -f fill* && echo ok", timeout_s=60)
        assert freed.stdout == "ok\n" and "quota" not in freed.stderr
        if kind == "docker" and not backend.storage_opt_quota:
            big = await sandbox.exec("truncate -s 1G big.bin; echo $?; stat -c %s big.bin", timeout_s=60)
            assert big.stdout.split() == [str(128 + signal.SIGXFSZ), "0"], big  # killed by SIGXFSZ, nothing written
    finally:
        await sandbox.close()
        await backend.aclose()


async def test_grading_time_is_a_setting(tmp_path: Path) -> None:
    """Code that hangs only under the test runner costs `grading_timeout_s`, then a zero of its own."""
    require_bwrap()
    from patchgym.backends.sandbox.local import LocalSandboxBackend

    backend = LocalSandboxBackend(isolation="bwrap", root_dir=tmp_path)
    hang = "printf 'import time\\ntime.sleep(600)\\n' >> roman/__init__.py"
    try:
        info = await play(backend, [hang], grading_timeout_s=5)
    finally:
        await backend.aclose()
    assert (info["reward"], info["grade"]["details"]["reason"]) == (0.0, "grading_timeout")
    assert info["limits"]["grading_timeout_s"] == 5


async def test_on_none_no_process_outlives_its_command(tmp_path: Path) -> None:
    """setsid, a double fork, nohup: on main the setsid children outlived the command (and a
    timeout); the subreaper kills every descendant now."""
    from patchgym.backends.sandbox.local import LocalSandboxBackend

    marker = f"redteam{os.getpid()}x{tmp_path.name[-6:]}"
    backend = LocalSandboxBackend(isolation="none", root_dir=tmp_path)
    spec = tiny_task_set().get("roman-subtractive").sandbox
    from patchgym.core.sandbox import SandboxSpec

    sandbox = await backend.create(SandboxSpec(workspace=spec.workspace))
    escapes = (
        f"setsid bash -c 'exec -a {marker}a sleep 300' </dev/null >/dev/null 2>&1 & "
        f"(bash -c 'exec -a {marker}b sleep 300' </dev/null >/dev/null 2>&1 &); "
        f"nohup setsid bash -c 'exec -a {marker}c sleep 300' </dev/null >/dev/null 2>&1 & echo started"
    )
    try:
        assert (await sandbox.exec(escapes, timeout_s=60)).stdout == "started\n"
        late = await sandbox.exec(
            f"setsid bash -c 'exec -a {marker}d sleep 300' </dev/null >/dev/null 2>&1 & sleep 60", timeout_s=1
        )
        assert late.timed_out
    finally:
        await sandbox.close()
        await backend.aclose()
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker.encode() in _cmdline(p)]
    for proc in left:  # never leave them running, even when the test fails
        with contextlib.suppress(OSError):
            os.kill(int(proc.name), signal.SIGKILL)
    assert not left


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


async def test_a_rewritten_grading_helper_reaches_no_later_grading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On `none` a command can rewrite patchgym's own files. The unittest runner copied into every
    grading sandbox is now the copy read at import: pointing its path at a forging runner (as a
    rewrite of the file would) no longer turns a no-op into a pass (on main it did)."""
    require_bwrap()
    from patchgym.backends.sandbox.local import LocalSandboxBackend
    from patchgym.core import grading

    forger = tmp_path / "unittest_junit.py"
    forger.write_text("import sys\nsys.exit(0)\n")
    monkeypatch.setattr(grading, "UNITTEST_RUNNER", forger)
    backend = LocalSandboxBackend(isolation="bwrap", root_dir=tmp_path)
    try:
        info = await play(backend, ["true"])
    finally:
        await backend.aclose()
    assert info["reward"] == 0.0 and info["grade"]["details"]["reason"] != "resolved"


# -- unit tests of the limits -----------------------------------------------------------------


def test_check_tree_compares_with_the_pristine_tree() -> None:
    from patchgym.core.tree_limits import TreeLimitExceeded, TreeSize, check_tree

    pristine = TreeSize(entries=100, bytes=10_000)
    check_tree(TreeSize(110, 10_500), pristine, max_files=10, max_bytes=500)  # at the limits: fine
    check_tree(None, None, max_files=1, max_bytes=1)  # no GNU find in the image: the copy's checks only
    for agent, reason in (
        (TreeSize(111, 10_000), "too_many_files"),
        (TreeSize(100, 10_501), "diff_too_large"),
        (None, "tree_unmeasurable"),
    ):
        with pytest.raises(TreeLimitExceeded) as refused:
            check_tree(agent, pristine, max_files=10, max_bytes=500)
        assert refused.value.reason == reason


def test_a_tree_that_grew_after_its_measure_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from patchgym.core.tree_diff import TreeTooLarge, tree_changes

    pristine, changed = tmp_path / "a", tmp_path / "b"
    pristine.mkdir(), changed.mkdir()
    (pristine / "f.py").write_text("x = 1\n")
    (changed / "f.py").write_text("x = 2\n")
    with (changed / "sparse.bin").open("wb") as sparse:
        sparse.truncate(2 << 30)
    with pytest.raises(TreeTooLarge):
        tree_changes(pristine, changed, lambda path: False, max_extra_bytes=1 << 20)
    (changed / "sparse.bin").unlink()
    assert [c.path for c in tree_changes(pristine, changed, lambda path: False, max_extra_bytes=0)] == ["f.py"]


async def test_the_disk_quota_cancels_a_command_over_it_and_notes_one_that_ended_over_it() -> None:
    import asyncio

    from patchgym.backends.sandbox.disk_quota import DiskQuota
    from patchgym.core.sandbox import ExecResult

    used = [0]
    cancelled = asyncio.Event()

    async def measure() -> int:
        return used[0]

    async def command(seconds: float) -> ExecResult:
        try:
            used[0] = 2_000
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return ExecResult(exit_code=0, stdout="done", stderr="")

    quota = DiskQuota(quota_bytes=1_000, interval_s=0.05)
    killed = await quota.run(command(60), measure)
    assert cancelled.is_set() and killed.exit_code == 137 and "over its disk quota" in killed.stderr
    quick = await DiskQuota(quota_bytes=1_000, interval_s=60).run(command(0), measure)
    assert quick.exit_code == 0 and quick.stdout == "done" and "2000 bytes used" in quick.stderr
    used[0] = 0
    assert (await DiskQuota(None).run(command(0), measure)).stderr == ""
