"""Stopping what patchgym starts: whole process groups, bounded in time, children that die with
their parent, and Ctrl-C that always works.

A server started with `start_new_session=True` leads a process group that also holds its
workers (SGLang's scheduler and detokenizer). Stopping only the leader orphans those workers,
so `stop_groups` signals every group, waits a grace period for the members (not just the
leader) to exit, then SIGKILLs whatever is left.

A shell runs background jobs with SIGINT ignored, and Python then installs no Ctrl-C handler:
a command whose contract is "runs until Ctrl-C" calls `handle_interrupts()` first.

`killed_with_parent(argv)` is a command that the kernel SIGKILLs when the thread starting it
ends (`PR_SET_PDEATHSIG`), so that not even a SIGKILLed parent leaves it running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

POLL_S = 0.05
PARENT_CHECK = 'read -r _ _ _ parent _ < /proc/self/stat; [ "$parent" = "$0" ] && exec "$@"'
"""sh: run "$@" only if the process whose pid is $0 (as /proc shows it) is still this one's parent."""


def killed_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv`, run so that it gets SIGKILL when the thread that starts it ends (util-linux `setpriv`).

    A parent that died before the signal was set would never send it, so `sh` then checks that
    this process is still the parent and runs nothing otherwise. Unlike a `preexec_fn` doing the
    same, this keeps `subprocess`'s vfork: a preexec_fn makes Python fork, which copies the page
    tables of the parent (about 100 ms for a parent holding 2 GB, measured here).
    """
    return ["setpriv", "--pdeathsig", "KILL", "--", "sh", "-c", PARENT_CHECK, str(os.getpid()), *argv]


def handle_interrupts() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, even if SIGINT was inherited ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def process_table() -> dict[int, tuple[int, int]]:
    """Every live (not zombie) process as pid -> (parent pid, process group), read from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        state, ppid, pgid = stat[stat.rindex(")") + 2 :].split()[:3]  # after "pid (comm) "
        if state not in ("Z", "X"):
            table[int(entry.name)] = (int(ppid), int(pgid))
    return table


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid`."""
    return [pid for pid, (_, group) in process_table().items() if group == pgid]


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """`os.killpg`, quiet when the group is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM for the block (main thread only: elsewhere they cannot interrupt it anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_groups(
    processes: Sequence[subprocess.Popen], grace_s: float, first_signal: signal.Signals = signal.SIGTERM
) -> list[int]:
    """Send `first_signal` to each process's group, SIGKILL the groups still alive after `grace_s`.

    Each process must lead its group (started with `start_new_session=True`). Returns the pids
    that had to be killed. The leaders are reaped; the other members are gone once SIGKILL lands.
    """
    for process in processes:
        if process.poll() is None or group_members(process.pid):  # a reaped leader's pid may be reused
            signal_group(process.pid, first_signal)
    deadline = time.monotonic() + grace_s
    try:
        while time.monotonic() < deadline:
            for process in processes:
                process.poll()
            if not any(group_members(p.pid) for p in processes):
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # a second Ctrl-C: no more grace
        pass
    with _uninterrupted():
        killed = [pid for p in processes for pid in group_members(p.pid)]
        for process in processes:
            if process.returncode is None or group_members(process.pid):
                signal_group(process.pid, signal.SIGKILL)
        for process in processes:
            process.wait()
        deadline = time.monotonic() + grace_s  # SIGKILL is not instant (a process in the kernel finishes its call)
        while any(group_members(p.pid) for p in processes) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    return killed
