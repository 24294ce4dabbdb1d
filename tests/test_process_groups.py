"""Stopping whole process groups within a grace period, children that die with their parent, and
Ctrl-C that works in a background job."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings, server_command
from patchgym.core.errors import ConfigError
from patchgym.process_groups import group_members, killed_with_parent, stop_groups
from tests.processes import ignore_sigint, kill_survivors
from tests.test_launch import wait_gone

# A leader that exits on SIGTERM and a worker child that ignores it (an SGLang scheduler that lingers).
LINGERING_CHILD = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""
POLITE_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def start_group(source: str) -> tuple[subprocess.Popen, int]:
    """A process group of a leader and one child; returns the leader and the child's pid once both run."""
    leader = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(leader.stdout.readline())  # type: ignore[union-attr]
    return leader, child


def test_a_lingering_worker_is_killed_after_the_grace() -> None:
    leader, child = start_group(LINGERING_CHILD)
    try:
        assert sorted(group_members(leader.pid)) == sorted([leader.pid, child])
        killed = stop_groups([leader], grace_s=0.5)
        assert killed == [child]  # the leader left on SIGTERM, its worker needed SIGKILL
        assert leader.returncode == -signal.SIGTERM and group_members(leader.pid) == []
    finally:
        kill_survivors({leader.pid})


def test_a_group_that_exits_on_sigterm_is_not_killed() -> None:
    leaders = [start_group(POLITE_CHILD)[0] for _ in range(2)]
    try:
        started = time.monotonic()
        assert stop_groups(leaders, grace_s=600) == []
        assert time.monotonic() - started < 600  # it returns when the groups are empty, not at the deadline
        assert all(p.returncode == -signal.SIGTERM and group_members(p.pid) == [] for p in leaders)
    finally:
        kill_survivors({p.pid for p in leaders})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_handle_interrupts_works_when_sigint_was_inherited_ignored(sig: signal.Signals) -> None:
    source = (
        "import time\nfrom patchgym.process_groups import handle_interrupts\nhandle_interrupts()\n"
        "try:\n    print('ready', flush=True)\n    time.sleep(600)\nexcept KeyboardInterrupt:\n    print('stopped')\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", source],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
        preexec_fn=ignore_sigint,
    )
    try:
        assert process.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        process.send_signal(sig)
        assert process.stdout.read().strip() == "stopped" and process.wait() == 0  # type: ignore[union-attr]
    finally:
        process.kill()
        process.wait()


def test_killed_with_parent_runs_only_under_the_process_that_made_it() -> None:
    """Started by another process (as if this one had died before the signal was set), it runs nothing."""
    argv = killed_with_parent(["echo", "ran"])
    direct = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert (direct.returncode, direct.stdout) == (0, "ran\n"), direct.stderr
    relay = ["bash", "-c", '"$@"; exit $?', "bash", *argv]  # bash forks it: bash is its parent
    relayed = subprocess.run(relay, capture_output=True, text=True, timeout=120)
    assert (relayed.returncode, relayed.stdout) == (1, ""), relayed.stderr


def test_killed_with_parent_dies_with_a_sigkilled_parent() -> None:
    parent_source = (
        "import subprocess, sys, time\n"
        "from patchgym.process_groups import killed_with_parent\n"
        "child = subprocess.Popen(killed_with_parent(['sleep', '3600']))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(3600)\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_source], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": root}
    )
    child = 0
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        while Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":  # setpriv, sh, then sleep
            time.sleep(0.01)
        parent.kill()
        parent.wait()
        assert wait_gone([child]) == []
    finally:
        parent.kill()
        parent.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_cpu_servers_sleep_on_idle_and_the_stop_grace_is_checked(tmp_path: Path) -> None:
    cpu = SGLangLaunchSettings(model_path=tmp_path, device="cpu", max_total_tokens=4096)
    assert "--sleep-on-idle" in server_command(cpu, 0)
    assert "--sleep-on-idle" not in server_command(SGLangLaunchSettings(model_path=tmp_path), 0)
    awake = SGLangLaunchSettings(model_path=tmp_path, device="cpu", max_total_tokens=4096, sleep_on_idle=False)
    assert "--sleep-on-idle" not in server_command(awake, 0)
    with pytest.raises(ConfigError, match="stop_grace_s"):
        SGLangLaunchSettings(model_path=tmp_path, stop_grace_s=-1)
